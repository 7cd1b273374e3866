"""Tool-call formats: the call syntax per model family, its guide on both backends, its parser (docs/tool-calls.md)."""

from tpguide.serving.tool_formats.call_format import CallFormat
from tpguide.serving.tool_formats.choose import FAMILY_FORMATS, ToolSetup, choose_tool_format
from tpguide.serving.tool_formats.json_calls import JsonCallFormat
from tpguide.serving.tool_formats.scan import Scan, ScannedCall
from tpguide.serving.tool_formats.table import FORMATS, hermes

__all__ = ["CallFormat", "FAMILY_FORMATS", "FORMATS", "JsonCallFormat", "Scan", "ScannedCall", "ToolSetup",
           "choose_tool_format", "hermes"]

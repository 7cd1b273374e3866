"""The call formats by ``--tool-call-parser`` name (docs/tool-calls.md)."""

from __future__ import annotations

from typing import Dict

from tpguide.serving.tool_formats.call_format import CallFormat
from tpguide.serving.tool_formats.json_calls import JsonCallFormat
from tpguide.serving.tool_formats.xml_calls import XmlCallFormat


def hermes(begin: str = "<tool_call>", end: str = "</tool_call>") -> JsonCallFormat:
    """Hermes / ChatML tool calls, optionally with other tags (``--tool-call-begin`` / ``--tool-call-end``)."""
    if not begin or not end:
        raise ValueError(f"tool-call begin and end tags must be non-empty, got {begin!r}, {end!r}")
    return JsonCallFormat("hermes", call_open=f"{begin}\n", call_close=f"\n{end}", separator="\n", trigger=begin,
                          markers=(begin,))


FORMATS: Dict[str, CallFormat] = {
    "hermes": hermes(),
    # Qwen3 writes hermes calls; xgrammar has the format ("qwen_3"), so its tags build the guide
    "qwen3": JsonCallFormat("qwen3", call_open="<tool_call>\n", call_close="\n</tool_call>", separator="\n",
                            trigger="<tool_call>", xgrammar_model="qwen_3", markers=("<tool_call>",)),
    # Llama 3.1 / 3.2 / 3.3 (JSON tool calling, tools in the user turn); vLLM joins several calls with "; "
    "llama3_json": JsonCallFormat("llama3_json", call_open="", call_close="", separator="; ", trigger='{"name": ',
                                  args_key="parameters", xgrammar_model="llama",
                                  markers=("<|python_tag|>", '"parameters"')),
    # Mistral 7B v0.3 / Nemo / Small (the v3 tokenizer's chat template): one list of calls
    "mistral": JsonCallFormat("mistral", call_open="", call_close="", separator=", ", trigger="[TOOL_CALLS]",
                              block_open="[TOOL_CALLS] [", block_close="]",
                              markers=("[TOOL_CALLS]", "[AVAILABLE_TOOLS]"), id_length=9),
    # Phi-4-mini (a Phi3ForCausalLM checkpoint): functools[{...}, ...]
    "phi4_mini_json": JsonCallFormat("phi4_mini_json", call_open="", call_close="", separator=", ",
                                     trigger="functools[", block_open="functools[", block_close="]",
                                     markers=("functools",)),
    # Qwen3-Coder: XML parameters (xgrammar's "qwen_3_coder"; no llguidance form)
    "qwen3_coder": XmlCallFormat(),
}

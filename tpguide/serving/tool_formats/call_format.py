"""The interface of a tool-call syntax (:class:`CallFormat`): how a call is written, and how output text is read.

Two implementations: :class:`~tpguide.serving.tool_formats.json_calls.JsonCallFormat`
(hermes, qwen3, llama3_json, mistral, phi4_mini_json) and
:class:`~tpguide.serving.tool_formats.xml_calls.XmlCallFormat` (qwen3_coder);
the table of them is :data:`tpguide.serving.tool_formats.table.FORMATS`
(docs/tool-calls.md).
"""

from __future__ import annotations

import secrets
import string
from typing import Any, Dict, Optional, Protocol, Sequence, Tuple, runtime_checkable

from tpguide.serving.tool_formats.scan import Scan


@runtime_checkable
class CallFormat(Protocol):
    """A tool-call syntax: its literals, writing calls (the guide, the prompt's example), reading them back.

    Attributes (read only; the formats are frozen dataclasses)
    ----------------------------------------------------------
    name : str
        The ``--tool-call-parser`` value.
    call_open, call_close : str
        Around each call (hermes: ``"<tool_call>\\n"``, ``"\\n</tool_call>"``).
    separator : str
        Between calls with ``tool_choice="required"`` (and inside a list).
    block_open, block_close : str
        Around the calls of a list format (``[TOOL_CALLS] [`` ... ``]``); empty otherwise.
    trigger : str
        The text that starts calls in free text (``tool_choice="auto"``).
    xgrammar_model : str or None
        xgrammar's ``get_model_structural_tag`` key when xgrammar has this
        format: the guide's call tags are then taken from xgrammar.
    markers : tuple of str
        Strings in a chat template that show it writes this syntax.
    id_length : int
        0: OpenAI-style ids ``call_<24 hex>``; else that many alphanumerics (Mistral: 9).
    controls : tuple of (str, int)
        The markers that are control tokens of the tokenizer, with their ids.
    json_arguments : bool
        The arguments are one JSON object (a Lark form exists for llguidance).
    """

    @property
    def name(self) -> str: ...
    @property
    def call_open(self) -> str: ...
    @property
    def call_close(self) -> str: ...
    @property
    def separator(self) -> str: ...
    @property
    def block_open(self) -> str: ...
    @property
    def block_close(self) -> str: ...
    @property
    def trigger(self) -> str: ...
    @property
    def xgrammar_model(self) -> Optional[str]: ...
    @property
    def markers(self) -> Tuple[str, ...]: ...
    @property
    def id_length(self) -> int: ...
    @property
    def controls(self) -> tuple: ...
    @property
    def json_arguments(self) -> bool: ...
    @property
    def call_suffix(self) -> str:
        """Everything of a call after its arguments."""

    def call_prefix(self, name: str) -> str:
        """Everything of a call of ``name`` before its arguments (the forced header)."""

    def render_call(self, name: str, arguments: str) -> str:
        """One call of ``name`` with ``arguments`` (JSON text) as the model writes it."""

    def render_calls(self, calls: Sequence[Tuple[str, str]]) -> str:
        """``calls`` ((name, arguments JSON text)) as the model writes them in one turn."""

    def new_call_id(self) -> str:
        """A fresh id for a call read back (:func:`new_call_id` of :attr:`id_length`)."""

    def call_pattern(self, name: str) -> str:
        """A regex of how this format begins a call of ``name``."""

    def scan(self, text: str, final: bool = False, schemas: Optional[Dict[str, Any]] = None) -> Scan:
        """Calls and content of ``text`` (a whole output, or its prefix while streaming).

        ``final``: no more text follows.  ``schemas``: each tool's parameters
        schema by name (a format whose arguments are not JSON types its values by it).
        """


def new_call_id(length: int = 0) -> str:
    """``call_<24 hex>`` (OpenAI's form), or ``length`` alphanumerics (Mistral: 9)."""
    if length:
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(length))
    return f"call_{secrets.token_hex(12)}"

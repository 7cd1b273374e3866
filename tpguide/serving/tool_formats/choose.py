"""``--tool-call-parser``: the call format of a model, chosen by name or from its family and chat template.

``auto`` reads the chat template first (a template that renders ``tools``
shows the syntax the model was trained on: ``[TOOL_CALLS]``,
``<tool_call>``, ``<|python_tag|>``, ``functools``), then a ChatML template
(``<|im_start|>``: hermes, the embedded SmolLM2 included), then the family
(:data:`FAMILY_FORMATS`).  A named format that contradicts the template's
own call syntax, or an unknown name, is a startup error (docs/tool-calls.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tpguide.serving.tool_formats.json_calls import JsonCallFormat
from tpguide.serving.tool_formats.table import FORMATS, hermes

#: Format of each supported architecture when its chat template does not say.
FAMILY_FORMATS = {
    "LlamaForCausalLM": "llama3_json",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "hermes",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "hermes",  # Gemma 2 / 3 have no call syntax of their own: the tool prompt teaches hermes
    "Gemma3ForCausalLM": "hermes",
    "Phi3ForCausalLM": "hermes",
}
#: Template markers, most specific first: (marker, format).
_TEMPLATE_MARKERS = (("[TOOL_CALLS]", "mistral"), ("[AVAILABLE_TOOLS]", "mistral"), ("functools", "phi4_mini_json"),
                     ("<|python_tag|>", "llama3_json"), ('"parameters"', "llama3_json"),
                     ("<tool_call>", "hermes"))
#: Formats with the same call syntax (a template showing one fits the other).
_SAME_SYNTAX = {"qwen3": "hermes"}


@dataclass(frozen=True)
class ToolSetup:
    """The server's tool calling: the call format and whether the chat template renders ``tools``.

    ``template_tools`` False: tpguide's own tool prompt (in the format's
    syntax) goes into the system message, and past calls and tool results
    are written as text; True: ``tools``, assistant ``tool_calls`` and
    ``tool`` messages go to the template as they are.
    """

    fmt: JsonCallFormat
    template_tools: bool = False


def template_renders_tools(chat_template: Optional[str]) -> bool:
    """True if the chat template reads a ``tools`` variable (transformers passes ``tools=`` as one)."""
    return bool(chat_template) and "tools" in chat_template


def template_format(chat_template: Optional[str]) -> Optional[str]:
    """The format whose call syntax a tool-rendering template shows, or None."""
    if not template_renders_tools(chat_template):
        return None
    return next((name for marker, name in _TEMPLATE_MARKERS if marker in chat_template), None)


def choose_tool_format(parser: str, architecture: str, chat_template: Optional[str],
                       begin: Optional[str] = None, end: Optional[str] = None) -> ToolSetup:
    """The :class:`ToolSetup` for ``--tool-call-parser parser`` on this model.

    Parameters
    ----------
    parser : str
        ``"auto"`` or a key of :data:`~tpguide.serving.tool_formats.table.FORMATS`.
    architecture : str
        The checkpoint's architecture (``config.architectures[0]``).
    chat_template : str or None
        The tokenizer's chat template.
    begin, end : str, optional
        ``--tool-call-begin`` / ``--tool-call-end``: other hermes tags (hermes only).

    Raises
    ------
    ValueError
        An unknown parser name; a parser whose syntax contradicts the one
        the chat template renders; begin/end tags with a non-hermes format.
    """
    if parser != "auto" and parser not in FORMATS:
        raise ValueError(f"--tool-call-parser must be 'auto' or one of {sorted(FORMATS)}, got {parser!r}")
    shown = template_format(chat_template)
    if parser == "auto":
        if shown is not None:
            name = "qwen3" if shown == "hermes" and architecture == "Qwen3ForCausalLM" else shown
        elif chat_template and "<|im_start|>" in chat_template:
            name = "qwen3" if architecture == "Qwen3ForCausalLM" else "hermes"
        else:
            name = FAMILY_FORMATS.get(architecture, "hermes")
    else:
        name = parser
        if shown is not None and _SAME_SYNTAX.get(name, name) != _SAME_SYNTAX.get(shown, shown):
            raise ValueError(f"--tool-call-parser {parser} does not match the model's chat template, which "
                             f"renders tools with {shown} calls; use --tool-call-parser {shown} or auto")
    fmt = FORMATS[name]
    if (begin, end) != (None, None) and (begin, end) != ("<tool_call>", "</tool_call>"):
        if name != "hermes":
            raise ValueError(f"--tool-call-begin/--tool-call-end apply to hermes calls, not to {name}")
        fmt = hermes(begin or "<tool_call>", end or "</tool_call>")
    return ToolSetup(fmt, template_renders_tools(chat_template))

"""``--tool-call-parser``: the call format of a model, chosen by name or from its family and chat template.

``auto`` reads the chat template first (the call syntax it shows:
``[TOOL_CALLS]``, ``<tool_call>``, ``<|python_tag|>``, ``functools``), then
a ChatML template (``<|im_start|>``: hermes, the embedded SmolLM2
included), then the family (:data:`FAMILY_FORMATS`).  Whether the template
renders ``tools`` is probed by rendering a probe tool.  A named format that
contradicts the call syntax of a template that renders tools, or an unknown
name, is a startup error (docs/tool-calls.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

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
_TEMPLATE_MARKERS = (("<function=", "qwen3_coder"), ("[TOOL_CALLS]", "mistral"), ("[AVAILABLE_TOOLS]", "mistral"), ("functools", "phi4_mini_json"),
                     ("<|tool|>", "phi4_mini_json"), ("<|python_tag|>", "llama3_json"),
                     ('"parameters"', "llama3_json"), ('\\"parameters\\"', "llama3_json"), ("<tool_call>", "hermes"))
#: Formats with the same call syntax (a template showing one fits the other).
_SAME_SYNTAX = {"qwen3": "hermes"}
_PROBE = "tpguide_probe_tool_7f3a"


@dataclass(frozen=True)
class ToolSetup:
    """The server's tool calling: the call format, and how the prompt shows the tools.

    Attributes
    ----------
    fmt : JsonCallFormat
    template_tools : bool
        True: ``tools``, assistant ``tool_calls`` and ``tool`` messages go to
        the chat template as they are.  False: tpguide's own tool prompt (in
        the format's syntax) is added, and past calls and tool results are
        written as text.
    prompt_role : {"system", "user"}
        Where tpguide's tool prompt goes: the system message, or the first
        user message for a template that refuses a system role (Gemma 2).
    json_whitespace : {"compact", "bounded", "any"}
        Whitespace in the arguments (the engine's ``--json-whitespace``).
    """

    fmt: JsonCallFormat
    template_tools: bool = False
    prompt_role: str = "system"
    json_whitespace: str = "bounded"

    def __post_init__(self) -> None:
        if self.prompt_role not in ("system", "user"):
            raise ValueError(f"prompt_role must be 'system' or 'user', got {self.prompt_role!r}")


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(v) for v in template.values())
    return template or ""


def _renders(tokenizer: Any, messages: list, **kwargs: Any) -> Optional[str]:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception:  # a template that refuses the probe (roles, variables) does not render it
        return None


def template_renders_tools(tokenizer: Any) -> bool:
    """True if the chat template shows a probe tool passed as ``tools=`` (transformers' convention)."""
    if not _template_text(tokenizer):
        return False
    probe = [{"type": "function", "function": {"name": _PROBE, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    text = _renders(tokenizer, [{"role": "user", "content": "hi"}], tools=probe)
    return text is not None and _PROBE in text


def template_takes_system(tokenizer: Any) -> bool:
    """False if the chat template refuses a system message (Gemma 2 raises)."""
    if not _template_text(tokenizer):
        return True
    return _renders(tokenizer, [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]) is not None


def template_format(tokenizer: Any) -> Optional[str]:
    """The format whose call syntax the chat template shows, or None."""
    text = _template_text(tokenizer)
    return next((name for marker, name in _TEMPLATE_MARKERS if marker in text), None)


def choose_tool_format(parser: str, architecture: str, tokenizer: Any, begin: Optional[str] = None,
                       end: Optional[str] = None, json_whitespace: str = "bounded",
                       guided_backend: str = "auto") -> ToolSetup:
    """The :class:`ToolSetup` for ``--tool-call-parser parser`` on this model.

    Parameters
    ----------
    parser : str
        ``"auto"`` or a key of :data:`~tpguide.serving.tool_formats.table.FORMATS`.
    architecture : str
        The checkpoint's architecture (``config.architectures[0]``).
    tokenizer : transformers tokenizer
        Its chat template is read and probed.
    begin, end : str, optional
        ``--tool-call-begin`` / ``--tool-call-end``: other hermes tags (hermes only).
    json_whitespace : str
        The engine's ``--json-whitespace`` (applies to the arguments).
    guided_backend : str
        The engine's ``--guided-backend``: ``llguidance`` cannot take an
        XML format's guide (``qwen3_coder``).

    Raises
    ------
    ValueError
        An unknown parser name; a parser whose syntax contradicts the one
        of a template that renders tools; begin/end tags with a non-hermes format.
    """
    if parser != "auto" and parser not in FORMATS:
        raise ValueError(f"--tool-call-parser must be 'auto' or one of {sorted(FORMATS)}, got {parser!r}")
    shown, renders = template_format(tokenizer), template_renders_tools(tokenizer)
    if parser == "auto":
        if shown is not None:
            name = shown
        elif "<|im_start|>" in _template_text(tokenizer):
            name = "hermes"
        else:
            name = FAMILY_FORMATS.get(architecture, "hermes")
        if name == "hermes" and architecture == "Qwen3ForCausalLM":
            name = "qwen3"
    else:
        name = parser
        if renders and shown is not None and _SAME_SYNTAX.get(name, name) != _SAME_SYNTAX.get(shown, shown):
            raise ValueError(f"--tool-call-parser {parser} does not match the model's chat template, which "
                             f"renders tools with {shown} calls; use --tool-call-parser {shown} or auto")
    fmt = FORMATS[name]
    if guided_backend == "llguidance" and not fmt.json_arguments:
        raise ValueError(f"--tool-call-parser {name} needs the xgrammar backend (its XML arguments have no "
                         "llguidance grammar here); use --guided-backend xgrammar or auto")
    if (begin, end) != (None, None) and (begin, end) != ("<tool_call>", "</tool_call>"):
        if name != "hermes":
            raise ValueError(f"--tool-call-begin/--tool-call-end apply to hermes calls, not to {name}")
        fmt = hermes(begin or "<tool_call>", end or "</tool_call>")
    return ToolSetup(with_special_markers(fmt, tokenizer), renders,
                     "system" if template_takes_system(tokenizer) else "user", json_whitespace)


def with_special_markers(fmt: JsonCallFormat, tokenizer: Any) -> JsonCallFormat:
    """``fmt`` knowing that its trigger is a special token of ``tokenizer`` (decoded text omits it).

    Raises
    ------
    ValueError
        The trigger of a format without a list opening is a special token
        (its calls could not be found in the text): not supported.
    """
    special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    if fmt.trigger not in special:
        return fmt
    if not fmt.block_open:
        raise ValueError(f"the {fmt.name} trigger {fmt.trigger!r} is a special token of this tokenizer, which "
                         "decoded text omits; tpguide cannot read such calls back")
    return dataclasses.replace(fmt, hidden=fmt.trigger)

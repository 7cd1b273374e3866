"""``--tool-call-parser``: the call format of a model, chosen by name or from what its chat template writes.

``auto`` renders a probe conversation through the chat template (an
assistant turn with one ``tool_calls`` entry, besides the same
conversation without it) and takes the format whose call syntax
(:meth:`~tpguide.serving.tool_formats.json_calls.JsonCallFormat.call_pattern`)
the call adds to the text: what the template writes for a call, not the
strings of its source (a hermes template whose tools listing is a Jinja
dict literal with ``"parameters"`` stays hermes).  A template that renders
no assistant call falls back to the call syntax its tools listing (then its
source) shows, then a ChatML template (``<|im_start|>``: hermes, the
embedded SmolLM2 included), then the family (:data:`FAMILY_FORMATS`).  A
named format that contradicts the calls the template renders, or an
unknown name, is a startup error (docs/tool-calls.md).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Optional

from tpguide.serving.tool_formats.call_format import CallFormat
from tpguide.serving.tool_formats.control_tokens import find_controls
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
#: Formats tried on a rendered call, those with an opening first (llama3_json's bare JSON object last).
_CALL_ORDER = ("qwen3_coder", "mistral", "phi4_mini_json", "hermes", "llama3_json")
#: The fallback for a template that renders no call: markers of a call syntax in its tools listing or source.
_LISTING_MARKERS = (("<function=", "qwen3_coder"), ("[TOOL_CALLS]", "mistral"), ("[AVAILABLE_TOOLS]", "mistral"),
                    ("functools", "phi4_mini_json"), ("<|tool|>", "phi4_mini_json"), ("<tool_call>", "hermes"),
                    ("<|python_tag|>", "llama3_json"))
#: Formats with the same call syntax (a template showing one fits the other).
_SAME_SYNTAX = {"qwen3": "hermes"}
_PROBE = "tpguide_probe_tool_7f3a"
_PROBE_ID = "pr0beCa11"  # 9 alphanumerics: Mistral's templates refuse other call ids
_PROBE_TOOLS = [{"type": "function", "function": {"name": _PROBE, "description": "probe", "parameters": {
    "type": "object", "properties": {"tpguide_arg": {"type": "string"}}}}}]


@dataclass(frozen=True)
class ToolSetup:
    """The server's tool calling: the call format, and how the prompt shows the tools.

    Attributes
    ----------
    fmt : CallFormat
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

    fmt: CallFormat
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
    text = _renders(tokenizer, [{"role": "user", "content": "hi"}], tools=_PROBE_TOOLS)
    return text is not None and _PROBE in text


def template_takes_system(tokenizer: Any) -> bool:
    """False if the chat template refuses a system message (Gemma 2 raises)."""
    if not _template_text(tokenizer):
        return True
    return _renders(tokenizer, [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]) is not None


def rendered_call_format(tokenizer: Any) -> Optional[str]:
    """The format of the call the chat template writes for an assistant ``tool_calls`` entry, or None.

    The probe conversation (a user turn, an assistant turn calling the
    probe tool, its tool result) is rendered with arguments as an object
    (transformers' convention), then as a JSON string, with and without
    the tool result; the first rendering that shows the call is read.  A
    format's :meth:`call_pattern` counts only where the call adds it to the
    text of the same conversation without the assistant turn (so a tools
    listing written like a call is not one).  None: no rendering shows the
    call, or it shows it in a syntax no format has.
    """
    if not _template_text(tokenizer):
        return None
    user = {"role": "user", "content": "hi"}
    base = _renders(tokenizer, [user], tools=_PROBE_TOOLS) or ""
    for arguments in ({"tpguide_arg": "v"}, '{"tpguide_arg": "v"}'):
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"id": _PROBE_ID, "type": "function", "function": {"name": _PROBE, "arguments": arguments}}]}
        result = {"role": "tool", "tool_call_id": _PROBE_ID, "name": _PROBE, "content": "ok"}
        for messages in ([user, call, result], [user, call]):
            text = _renders(tokenizer, messages, tools=_PROBE_TOOLS)
            for name in _CALL_ORDER if text is not None else ():
                pattern = FORMATS[name].call_pattern(_PROBE)
                if len(re.findall(pattern, text)) > len(re.findall(pattern, base)):
                    return name
    return None


def listed_format(tokenizer: Any) -> Optional[str]:
    """The format whose call syntax the template's tools listing (else its source) mentions, or None (the fallback)."""
    listing = _renders(tokenizer, [{"role": "user", "content": "hi"}], tools=_PROBE_TOOLS) or ""
    for text in (listing, _template_text(tokenizer)):
        found = next((name for marker, name in _LISTING_MARKERS if marker in text), None)
        if found is not None:
            return found
    return None


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
        Its chat template is rendered (:func:`rendered_call_format`); its
        special tokens decide which markers are control tokens
        (:func:`with_controls`).
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
        An unknown parser name; a parser whose syntax contradicts the calls
        the chat template renders; begin/end tags with a non-hermes format;
        a control-token marker in an XML format.
    """
    if parser != "auto" and parser not in FORMATS:
        raise ValueError(f"--tool-call-parser must be 'auto' or one of {sorted(FORMATS)}, got {parser!r}")
    written, renders = rendered_call_format(tokenizer), template_renders_tools(tokenizer)
    if parser == "auto":
        if written is not None:
            name = written
        else:
            name = listed_format(tokenizer)
            if name is None:
                name = "hermes" if "<|im_start|>" in _template_text(tokenizer) else FAMILY_FORMATS.get(
                    architecture, "hermes")
        if name == "hermes" and architecture == "Qwen3ForCausalLM":
            name = "qwen3"
    else:
        name = parser
        if written is not None and _SAME_SYNTAX.get(name, name) != _SAME_SYNTAX.get(written, written):
            raise ValueError(f"--tool-call-parser {parser} does not match the model's chat template, which "
                             f"writes {written} calls; use --tool-call-parser {written} or auto")
    fmt = FORMATS[name]
    if guided_backend == "llguidance" and not fmt.json_arguments:
        raise ValueError(f"--tool-call-parser {name} needs the xgrammar backend (its XML arguments have no "
                         "llguidance grammar here); use --guided-backend xgrammar or auto")
    if (begin, end) != (None, None) and (begin, end) != ("<tool_call>", "</tool_call>"):
        if name != "hermes":
            raise ValueError(f"--tool-call-begin/--tool-call-end apply to hermes calls, not to {name}")
        fmt = hermes(begin or "<tool_call>", end or "</tool_call>")
    return ToolSetup(with_controls(fmt, tokenizer), renders,
                     "system" if template_takes_system(tokenizer) else "user", json_whitespace)


def with_controls(fmt: CallFormat, tokenizer: Any) -> CallFormat:
    """``fmt`` knowing which of its markers are control tokens of ``tokenizer`` (forced and read as ids).

    Raises
    ------
    ValueError
        A marker of an XML format (``qwen3_coder``) is a control token: its
        calls are read from text only.
    """
    controls = find_controls((fmt.call_open, fmt.call_close, fmt.block_open, fmt.block_close, fmt.trigger),
                             tokenizer)
    if not controls:
        return fmt
    if not fmt.json_arguments:
        raise ValueError(f"the {fmt.name} markers {[text for text, _ in controls]} are special tokens of this "
                         "tokenizer, which decoded text omits; tpguide reads such markers as ids for JSON formats only")
    return dataclasses.replace(fmt, controls=controls)

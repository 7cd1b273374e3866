"""Qwen3-Coder's XML calls: ``<function=N>`` with one ``<parameter=K>`` block per argument (docs/tool-calls.md).

::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The guide is xgrammar's (``get_model_structural_tag("qwen_3_coder")``, its
``qwen_xml`` content has no Lark form here, so llguidance is refused at
startup).  Reading a call back turns its parameters into a JSON object: a
value whose schema type is ``string`` stays text (one newline trimmed at
each end, as vLLM's parser does), any other value is parsed as JSON (text
when it does not parse).  A call is reported once complete, its arguments
in one piece.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

from tpguide.serving.tool_formats.call_format import new_call_id
from tpguide.serving.tool_formats.scan import Scan, ScannedCall, prefix_hold

_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _value(raw: str, schema: Any) -> Any:
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    if isinstance(schema, dict) and schema.get("type") == "string":
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@dataclass(frozen=True)
class XmlCallFormat:
    """Qwen3-Coder calls (see the module docstring); a :class:`~tpguide.serving.tool_formats.call_format.CallFormat`."""

    name: str = "qwen3_coder"
    trigger: str = "<tool_call>\n<function="
    separator: str = "\n"
    block_open: str = ""
    block_close: str = ""
    xgrammar_model: Optional[str] = "qwen_3_coder"
    markers: Tuple[str, ...] = ("<function=",)
    id_length: int = 0
    controls: tuple = ()  # Qwen3-Coder's markers are text; a control-token marker is refused at startup
    call_open: str = "<tool_call>\n"
    call_close: str = "\n</tool_call>"
    json_arguments: bool = False  # the arguments are XML: no Lark form (llguidance refused)

    def call_prefix(self, name: str) -> str:
        return f"<tool_call>\n<function={name}>\n"

    @property
    def call_suffix(self) -> str:
        return "\n</function>\n</tool_call>"

    def render_call(self, name: str, arguments: str) -> str:
        try:
            args = json.loads(arguments)
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):  # a placeholder (the tool prompt's example)
            return self.call_prefix(name) + arguments + self.call_suffix
        params = "\n".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
                           "</parameter>" for k, v in args.items())
        return self.call_prefix(name) + params + self.call_suffix

    def render_calls(self, calls: Sequence[Tuple[str, str]]) -> str:
        return self.separator.join(self.render_call(n, a) for n, a in calls)

    def new_call_id(self) -> str:
        return new_call_id(self.id_length)

    def call_pattern(self, name: str) -> str:
        """A regex of how this format begins a call of ``name``."""
        return r"<tool_call>\s*<function=" + re.escape(name) + ">"

    def scan(self, text: str, final: bool = False, schemas: Optional[Dict[str, Any]] = None) -> Scan:
        """Complete calls and the content around them; an unfinished call starts at ``open_at``."""
        scan, pos = Scan(""), 0
        for m in _CALL.finditer(text):
            scan.content += text[pos:m.start()]
            name = m.group(1).strip()
            props = ((schemas or {}).get(name) or {}).get("properties") or {}
            args = {k.strip(): _value(v, props.get(k.strip())) for k, v in _PARAM.findall(m.group(2))}
            scan.calls.append(ScannedCall(name, json.dumps(args, ensure_ascii=False), True, m.start()))
            pos = m.end()
            joined = re.compile(r"\s*" + re.escape(self.trigger)).match(text, pos)
            if joined is not None:  # the separator before the next call is not content
                pos = joined.end() - len(self.trigger)
        rest = text[pos:]
        opened = rest.find(self.trigger)
        if opened >= 0 and not (final and "<function=" not in rest[opened:]):
            scan.content += rest[:opened]
            scan.open_at = pos + opened
            return scan
        hold = max(prefix_hold(rest, self.trigger), prefix_hold(rest, self.separator + self.trigger) if pos else 0)
        if final:
            scan.content, scan.syntax_tail = scan.content + rest, hold
        else:
            scan.content += rest[:len(rest) - hold]
        return scan

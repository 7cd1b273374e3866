"""A structural tag (xgrammar's ``{"type": "structural_tag", "format": ...}``) as an llguidance Lark grammar.

llguidance reads Lark, not xgrammar's structural tags, so the guide of a
tool plan is written once as a structural tag and translated here node by
node: ``tag`` is ``begin content end``, ``json_schema`` is ``%json``,
``tags_with_separator`` is ``tag (sep tag)*``, ``triggered_tags`` is free
text up to the trigger (a lazy lexeme) then a tag, repeated, then text that
holds no trigger.  A ``token`` node (a control token forced by its id) is
llguidance's ``<[id]>``, and ``token_triggered_tags`` is free text, then
the trigger token and a tag, repeated.  Only the node types the tool formats build are known;
any other raises ``ValueError`` naming it (docs/tool-calls.md).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List

_REGEX_META = set("\\.+*?()|[]{}^$#&-~/\"")


def regex_literal(text: str) -> str:
    """``text`` as a Lark ``/regex/`` body matching it literally (Rust regex syntax)."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch in _REGEX_META:
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


class _Builder:
    def __init__(self) -> None:
        self.lines: List[str] = []
        self.count = 0

    def _name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"

    def rule(self, body: str) -> str:
        name = self._name("r")
        self.lines.append(f"{name}: {body}")
        return name

    def expr(self, node: Dict[str, Any]) -> str:
        kind = node.get("type")
        if kind == "token":
            return _token(node)
        if kind == "const_string":
            return _lit(node["value"]) or '""'
        if kind == "json_schema":
            if node.get("style", "json") != "json":
                raise ValueError(f"json_schema style {node['style']!r} has no llguidance form (use xgrammar)")
            return f"%json {json.dumps(_with_whitespace(node))}"
        if kind == "tag":
            return " ".join(p for p in (_lit(node["begin"]), self.expr(node["content"]), _lit(node["end"])) if p)
        if kind == "sequence":
            return " ".join(f"({self.expr(e)})" for e in node["elements"])
        if kind == "or":
            return "(" + " | ".join(f"({self.expr(e)})" for e in node["elements"]) + ")"
        if kind == "tags_with_separator":
            alt = self.rule(" | ".join(f"({self.expr(t)})" for t in node["tags"]))
            body = alt if node.get("stop_after_first") else f"{alt} ({_lit(node['separator'])} {alt})*"
            return body if node.get("at_least_one") else f"({body})?"
        if kind == "triggered_tags":
            return self._triggered(node)
        if kind == "token_triggered_tags":
            return self._token_triggered(node)
        raise ValueError(f"structural-tag node type {kind!r} has no llguidance form here")

    def _token_triggered(self, node: Dict[str, Any]) -> str:
        triggers = node["trigger_tokens"]
        if len(triggers) != 1 or node.get("exclude_tokens") or not isinstance(triggers[0], int):
            raise ValueError(f"token_triggered_tags with trigger_tokens {triggers} and exclude_tokens "
                             f"{node.get('exclude_tokens')} has no llguidance form here (one token id, no excludes)")
        trigger = {"type": "token", "token": triggers[0]}
        alts = []
        for t in node["tags"]:
            if t.get("type") != "tag" or t["begin"] != trigger:
                raise ValueError(f"token-triggered tag {t.get('begin')!r} does not begin with its trigger {trigger}")
            alts.append(self.expr(t))
        alt, text = self.rule(" | ".join(f"({a})" for a in alts)), self._name("TEXT")
        self.lines.append(f"{text}: /(.|\\n)*/")  # text holds no special token (llguidance)
        if node.get("stop_after_first"):
            return f"{text} {alt}" if node.get("at_least_one") else f"{text} ({alt})?"
        return f"{text} ({alt} {text})+" if node.get("at_least_one") else f"{text} ({alt} {text})*"

    def _triggered(self, node: Dict[str, Any]) -> str:
        triggers = node["triggers"]
        if len(triggers) != 1 or node.get("excludes"):
            raise ValueError(f"triggered_tags with triggers {triggers} and excludes {node.get('excludes')} "
                             "has no llguidance form here (one trigger, no excludes)")
        trigger = triggers[0]
        alts = []
        for t in node["tags"]:
            if t.get("type") != "tag" or not t["begin"].startswith(trigger):
                raise ValueError(f"triggered tag {t.get('begin')!r} does not start with its trigger {trigger!r}")
            alts.append(self.expr({**t, "begin": t["begin"][len(trigger):]}))
        alt = self.rule(" | ".join(f"({a})" for a in alts))
        pre, tail = self._name("pre"), self._name("TAIL")
        rx = regex_literal(trigger)
        self.lines.append(f"{pre}[lazy]: /(.|\\n)*{rx}/")
        self.lines.append(f"{tail}: /(.|\\n)*/ & ~/(.|\\n)*{rx}(.|\\n)*/")
        if node.get("stop_after_first"):
            return f"{pre} {alt}" if node.get("at_least_one") else f"({tail} | {pre} {alt})"
        return f"({pre} {alt})+ {tail}" if node.get("at_least_one") else f"({pre} {alt})* {tail}"


def _with_whitespace(node: Dict[str, Any]) -> Any:
    """The node's schema with llguidance's whitespace options for its ``max_whitespace_cnt``."""
    schema, most = node["json_schema"], node.get("max_whitespace_cnt")
    if most is None or not isinstance(schema, dict):
        return schema
    options = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,%d}" % most}
    return {**schema, "x-guidance": {**schema.get("x-guidance", {}), **options}}


def _token(node: Dict[str, Any]) -> str:
    if not isinstance(node.get("token"), int):
        raise ValueError(f"a token node needs a token id here, got {node.get('token')!r}")
    return f"<[{node['token']}]>"


def _lit(text: Any) -> str:
    """A tag's begin or end: a string literal, or a token node."""
    if isinstance(text, dict):
        return _token(text)
    return json.dumps(text) if text else ""


def structural_tag_to_lark(tag: Dict[str, Any]) -> str:
    """The Lark grammar (start rule ``start``) that accepts what the structural tag ``tag`` accepts.

    Raises
    ------
    ValueError
        A node type, json_schema style or trigger layout without a form here (the message names it).
    """
    if tag.get("type") != "structural_tag" or "format" not in tag:
        raise ValueError(f"expected {{'type': 'structural_tag', 'format': ...}}, got keys {sorted(tag)}")
    b = _Builder()
    start = b.expr(tag["format"])
    return "\n".join([f"start: {start}", *b.lines]) + "\n"

"""One table row per JSON call syntax: how a call is written, and the scanner that finds calls in output text.

A call is ``call_open {"name": N, "<args_key>": A} call_close``; a list
format wraps every call of a turn in ``block_open ... block_close``,
separated by ``separator`` (docs/tool-calls.md has the table)::

    hermes       <tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>
    llama3_json  {"name": N, "parameters": A}            calls joined by "; "
    mistral      [TOOL_CALLS] [{"name": N, "arguments": A}, ...]

:meth:`JsonCallFormat.scan` reads any prefix of an output: the text outside
calls, the calls whose header is complete (arguments so far), and where an
unfinished call or list starts.  The non-streamed parser and the stream are
two views of it, so their calls and arguments are the same slices of text.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import regex

from tpguide.serving.tool_formats.call_format import new_call_id
from tpguide.serving.tool_formats.control_tokens import Controls, with_sentinels
from tpguide.serving.tool_formats.scan import Scan, ScannedCall, prefix_hold

_DECODER = json.JSONDecoder()


def _ws(literal: str) -> str:
    """A regex for ``literal`` where each run of whitespace may be any whitespace (or none)."""
    parts = re.split(r"(\s+)", literal)
    return "".join(r"\s*" if p.isspace() else re.escape(p) for p in parts if p)


@dataclass(frozen=True)
class JsonCallFormat:
    """A call syntax whose arguments are a JSON object (see the module docstring).

    A :class:`~tpguide.serving.tool_formats.call_format.CallFormat`; its
    attributes mean what the protocol's do, with two more precise here:

    Attributes
    ----------
    args_key : str
        ``"arguments"`` or ``"parameters"`` (Llama 3.1).
    controls : tuple of (str, int)
        The markers of the format's literals that are control tokens of
        the tokenizer (Mistral's ``[TOOL_CALLS]``), with their ids
        (:func:`~tpguide.serving.tool_formats.control_tokens.find_controls`):
        the guide forces them as ids and :meth:`scan` reads text in which
        each is one sentinel character
        (:func:`~tpguide.serving.tool_formats.control_tokens.marker_text`).
    """

    name: str
    call_open: str
    call_close: str
    separator: str
    trigger: str
    args_key: str = "arguments"
    block_open: str = ""
    block_close: str = ""
    xgrammar_model: Optional[str] = None
    markers: Tuple[str, ...] = ()
    id_length: int = 0
    controls: Controls = ()

    def __post_init__(self) -> None:
        if any(text in self.separator for text, _ in self.controls):
            raise ValueError(f"{self.name}: the separator {self.separator!r} holds a control token; not supported")
        if not self.trigger or not (self.block_open or self.call_open or '{"name": ').startswith(self.trigger):
            raise ValueError(f"{self.name}: the trigger {self.trigger!r} must start every call or list")
        if bool(self.block_open) != bool(self.block_close):
            raise ValueError(f"{self.name}: block_open and block_close go together, got "
                             f"{self.block_open!r}, {self.block_close!r}")

    # ------------------------------------------------------------ writing
    def call_prefix(self, name: str) -> str:
        """Everything of a call before its arguments (the forced header)."""
        return f'{self.call_open}{{"name": {json.dumps(name)}, "{self.args_key}": '

    @property
    def call_suffix(self) -> str:
        return "}" + self.call_close

    def render_call(self, name: str, arguments: str) -> str:
        return self.call_prefix(name) + arguments + self.call_suffix

    def render_calls(self, calls: Sequence[Tuple[str, str]]) -> str:
        """``calls`` ((name, arguments JSON text)) as the model writes them in one turn."""
        body = self.separator.join(self.render_call(n, a) for n, a in calls)
        return f"{self.block_open}{body}{self.block_close}"

    json_arguments = True  # the arguments are one JSON object (a Lark form exists)

    def new_call_id(self) -> str:
        return new_call_id(self.id_length)

    # ------------------------------------------------------------ reading
    def call_pattern(self, name: str) -> str:
        """A regex of how this format begins a call of ``name`` (the opening, the name, the arguments key)."""
        return (_ws(self.block_open or self.call_open) + r'\s*\{\s*"name"\s*:\s*' + re.escape(json.dumps(name))
                + r'\s*,\s*"' + self.args_key + '"')

    def _header(self) -> "regex.Pattern[str]":
        key = '"(?:parameters|arguments)"' if self.args_key == "parameters" else f'"{self.args_key}"'
        opener = "" if self.block_open else _ws(self.call_open)
        return regex.compile(opener + r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*' + key + r"\s*:\s*")

    def scan(self, text: str, final: bool = False, schemas: Optional[Dict[str, Any]] = None) -> Scan:
        """Calls and content of ``text`` (a whole output, or its prefix while streaming).

        Parameters
        ----------
        text : str
            The decoded output so far; with :attr:`controls`, decoded by
            :func:`~tpguide.serving.tool_formats.control_tokens.marker_text`
            (each control marker one sentinel character).
        final : bool
            No more text follows: nothing is held back, and a trigger
            followed by what cannot begin a call header is text.
        schemas : dict, optional
            Not used (JSON arguments need no schema to be read).
        """
        if self.controls:
            return _sentinel_view(self).scan(text, final, schemas)
        header, scan, pos, after_call = self._header(), Scan(""), 0, -1
        opener = self.block_open or self.trigger  # what starts a call or a list in the text
        marker = opener.strip() or opener
        start_re = re.compile(_ws(opener) if self.block_open else re.escape(opener))
        tail = re.compile(r"\s*\}" + _ws(self.call_close)) if self.call_close.strip() else re.compile(r"\s*\}")
        while True:
            m = start_re.search(text, pos)
            if m is None:
                piece = text[pos:]
                hold = prefix_hold(piece, opener)
                if pos == after_call:  # right after a call: the separator and the next opening, cut
                    hold = max(hold, prefix_hold(piece, self.separator + self.trigger))
                if final:
                    scan.content, scan.syntax_tail = scan.content + piece, hold
                else:  # hold what may still start a call or a list
                    keep = len(piece) - hold
                    if marker in piece:
                        keep = min(keep, piece.index(marker))
                    scan.content += piece[:keep]
                return scan
            scan.content += text[pos:m.start()]
            start = m.start()
            at = first = m.end() if self.block_open else start
            while True:  # the calls of one list (one call when there is no list)
                h = header.match(text, at)
                if h is None or h.end() == len(text):  # not a complete header yet
                    if final and h is None and at == first and header.match(text, at, partial=True) is None:
                        break  # the trigger was plain text
                    scan.open_at = start
                    return scan
                try:
                    name = json.loads(f'"{h.group(1)}"')
                except json.JSONDecodeError:
                    name = h.group(1)
                call = ScannedCall(name, "", False, start)
                scan.calls.append(call)
                try:
                    _, args_end = _DECODER.raw_decode(text, h.end())
                except json.JSONDecodeError:
                    call.arguments = text[h.end():]
                    scan.open_at = start
                    return scan
                call.arguments = text[h.end():args_end]
                t = tail.match(text, args_end)
                if t is None:
                    scan.open_at = start
                    return scan
                at, call.complete = t.end(), True
                if not self.block_open:
                    joined = re.compile(_ws(self.separator) + re.escape(self.trigger)).match(text, at)
                    if joined is not None:  # the separator before the next call is not content
                        at = joined.end() - len(self.trigger)
                    elif not final and (self.separator + self.trigger).startswith(text[at:]) and at < len(text):
                        return scan  # it may become a separator: hold it
                    after_call = at
                    break
                more = re.compile(_ws(self.separator)).match(text, at)
                close = re.compile(r"\s*" + re.escape(self.block_close)).match(text, at)
                if close is not None:
                    at = close.end()
                    break
                if more is None or more.end() == len(text):
                    scan.open_at = start
                    return scan
                at = more.end()
            if at == first:  # a trigger that starts no call (final): it is content
                scan.content += text[start:m.end()]
                at = m.end()
            pos = at


@functools.lru_cache(maxsize=64)
def _sentinel_view(fmt: JsonCallFormat) -> JsonCallFormat:
    """``fmt`` with each control marker as its sentinel character (the text :meth:`JsonCallFormat.scan` reads)."""
    def view(literal: str) -> str:
        return with_sentinels(literal, fmt.controls)

    return dataclasses.replace(fmt, call_open=view(fmt.call_open), call_close=view(fmt.call_close),
                               block_open=view(fmt.block_open), block_close=view(fmt.block_close),
                               trigger=view(fmt.trigger), controls=())

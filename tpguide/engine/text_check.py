"""Text a tokenizer cannot take, refused where a request is parsed: lone surrogates, with the field named.

JSON's ``\\ud800`` escape decodes (Python's ``json`` accepts it) to a lone
UTF-16 surrogate, a ``str`` that is not valid Unicode: it cannot be encoded
to UTF-8, so the tokenizer raises (``TypeError: TextEncodeInput must be
Union[...]``), and so would xgrammar on a schema holding one.  Found before
anything runs, the request is refused with a 400 naming the field
(docs/serving.md, "Faults stay with their request").  Both doors call it:
:func:`tpguide.engine.request_io.parse_request` (offline lines, and the
server's requests once built) and the server on the raw body, so the
message names the client's own field (``messages[0].content``).

The same walk refuses JSON nested more than :data:`MAX_JSON_DEPTH` levels:
every later walk of the request (schema checks, grammar compiles) recurses
too, and Python's recursion limit would turn a deep body into a 500.
"""

from __future__ import annotations

import re
from typing import Any, Optional

__all__ = ["MAX_JSON_DEPTH", "check_unicode", "find_invalid_text"]

#: Deepest nesting of objects and arrays a request may have (a JSON Schema of real use nests far less).
MAX_JSON_DEPTH = 64

_SURROGATE = re.compile("[\ud800-\udfff]")


def find_invalid_text(obj: Any, path: str = "", depth: int = 0) -> Optional[str]:
    """The first string (value or key) of decoded JSON ``obj`` that is not valid Unicode, as a message; else None.

    The message names the field as a path (``messages[0].content``,
    ``response_format.json_schema.schema.properties.<key>``), the code point and
    its character index, e.g. ``"messages[0].content is not valid Unicode
    (lone surrogate U+D800 at character 0)"``.  Nesting deeper than
    :data:`MAX_JSON_DEPTH` is reported the same way, naming where it passes the limit.
    """
    if depth > MAX_JSON_DEPTH and isinstance(obj, (dict, list)):
        return f"{path or 'the request'} is nested more than {MAX_JSON_DEPTH} levels deep"
    if isinstance(obj, str):
        if obj.isascii():
            return None
        found = _SURROGATE.search(obj)
        if found is None:
            return None
        where = path or "the request"
        return (f"{where} is not valid Unicode (lone surrogate U+{ord(found.group()):04X} at character "
                f"{found.start()})")
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(key, str) and (message := find_invalid_text(key, f"a key of {path}" if path else "a key")):
                return message
            child = f"{path}.{key}" if path else str(key)
            if (message := find_invalid_text(value, child, depth + 1)) is not None:
                return message
        return None
    if isinstance(obj, list):
        for i, value in enumerate(obj):
            if (message := find_invalid_text(value, f"{path}[{i}]", depth + 1)) is not None:
                return message
    return None


def check_unicode(obj: Any, path: str = "") -> None:
    """Raise ValueError (:func:`find_invalid_text`'s message) if ``obj`` holds text that is not valid Unicode."""
    message = find_invalid_text(obj, path)
    if message is not None:
        raise ValueError(message)

"""OpenAI's error JSON, ``{"error": {"message", "type", "param", "code"}}``, with its HTTP status."""

from __future__ import annotations

import re
from typing import Any, Dict, Optional


class APIError(Exception):
    """An error answered to the client as OpenAI's error JSON.

    Parameters
    ----------
    status : int
        HTTP status (400 bad input, 401 api key, 404 unknown model, 413 body
        too large, 503 queue full or engine dead).
    message : str
        What went wrong, naming the offending values.
    type : str
        OpenAI's error type (``invalid_request_error``, ``authentication_error``, ...).
    param : str, optional
        The request field at fault.
    code : str, optional
        A short machine-readable code.
    headers : dict, optional
        Extra response headers (``Retry-After``).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def to_json(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    """400 ``invalid_request_error``; ``param`` defaults to the field the message starts with
    (``"temperature must be ..."``, ``"messages[0].content is not valid Unicode ..."``, ``"a key of logit_bias ..."``)."""
    return APIError(400, message, "invalid_request_error", param if param is not None else field_of(message))


_LEADING_FIELD = re.compile(r"^(?:a key of )?'?([A-Za-z_][\w$]*(?:\[\d+\])?(?:\.[\w$]+(?:\[\d+\])?)*)'? "
                            r"(?:must|is|are|names|allows|needs|lists|has)\b")


def field_of(message: str) -> Optional[str]:
    """The request field a validation message starts with, else None."""
    found = _LEADING_FIELD.match(message)
    return found.group(1) if found else None


def unsupported(field: str, why: str = "") -> APIError:
    """400 for a field that would change the output and that tpguide does not support."""
    tail = f": {why}" if why else ""
    return APIError(400, f"unsupported field {field!r}{tail} (tpguide refuses what it cannot honour)",
                    "invalid_request_error", field, "unsupported_field")

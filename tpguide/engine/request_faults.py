"""One request's fault fails that request alone: :func:`contained` around the driver's per-request work.

docs/serving.md, "Faults stay with their request".  The driver runs code
for one request at a time in four places: admitting it (tokenizer, chat
template, checks), giving it a matcher when it gets a slot, appending its
sampled tokens, and building its output (detokenizer, post-check).  An
exception in any of them (a tokenizer that raises on odd text, a bug) used
to leave the driver's loop and stop the engine for every request.  Inside
:func:`contained` it finishes that request with ``finish_reason="error"``,
``server_fault`` set (the server answers 500, naming the exception) and a
traceback on stderr; the loop steps on.  Only the driver runs this code, so
every rank stays in step: the other ranks see the failed request leave the
next plan, as any finished request does.

Tests inject such a fault with ``TPGUIDE_REQUEST_FAULT=PHASE:MARKER[,...]``:
a request whose prompt or message text contains ``MARKER`` raises
:class:`InjectedFault` in ``PHASE`` (one of :data:`PHASES`; ``"step"``
raises outside any request's containment, in the step itself, to test what
happens when the engine loop dies).  Production runs never set it.
"""

from __future__ import annotations

import os
import sys
import traceback
from functools import lru_cache
from typing import List, Tuple

__all__ = ["PHASES", "REQUEST_FAULT_ENV", "InjectedFault", "contained", "inject_fault"]

REQUEST_FAULT_ENV = "TPGUIDE_REQUEST_FAULT"

#: Where a request's own code runs on the driver (and "step": the step itself).
PHASES = ("admit", "schedule", "finish", "output", "step")


class InjectedFault(RuntimeError):
    """The fault :data:`REQUEST_FAULT_ENV` asked for (tests only)."""


@lru_cache(maxsize=4)
def _faults(text: str) -> Tuple[Tuple[str, str], ...]:
    faults: List[Tuple[str, str]] = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        phase, sep, marker = item.partition(":")
        if not sep or phase not in PHASES or not marker:
            raise ValueError(f"{REQUEST_FAULT_ENV} entries must be PHASE:MARKER with PHASE one of {PHASES}, "
                             f"got {item!r}")
        faults.append((phase, marker))
    return tuple(faults)


def _text_of(req) -> str:
    parts = [req.prompt or ""]
    for message in req.messages or ():
        content = message.get("content") if isinstance(message, dict) else None
        parts.append(content if isinstance(content, str) else repr(content))
    return "\n".join(parts)


def inject_fault(req, phase: str) -> None:
    """Raise :class:`InjectedFault` if :data:`REQUEST_FAULT_ENV` names ``phase`` and a marker in ``req``'s text."""
    spec = os.environ.get(REQUEST_FAULT_ENV)
    if not spec:
        return
    for where, marker in _faults(spec):
        if where == phase and marker in _text_of(req):
            raise InjectedFault(f"{REQUEST_FAULT_ENV}: {phase} fault for request {req.request_id!r}")


class contained:
    """``with contained(req, phase):`` one request's work; an exception fails ``req`` (server fault) instead.

    ``ValueError`` is bad input where it is raised on purpose (the intake's
    checks), so callers that expect it catch it first; here every exception
    is a server fault, reported on stderr with its traceback.  A
    ``BaseException`` that is not an ``Exception`` (KeyboardInterrupt,
    SystemExit) still propagates.  An injected fault (:func:`inject_fault`)
    is raised as the block ends, as if its last statement had raised.
    """

    def __init__(self, req, phase: str) -> None:
        self.req, self.phase = req, phase

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            try:
                inject_fault(self.req, self.phase)
            except InjectedFault as injected:
                exc = injected
        if not isinstance(exc, Exception):
            return False
        print(f"[rank 0] request {self.req.request_id!r} failed in {self.phase}:", file=sys.stderr, flush=True)
        traceback.print_exception(type(exc), exc, exc.__traceback__)
        self.req.fail(f"server error while {_VERBS[self.phase]} the request: {type(exc).__name__}: {exc}",
                      server_fault=True)
        return True


_VERBS = {"admit": "admitting", "schedule": "scheduling", "finish": "finishing a step of",
          "output": "building the output of", "step": "stepping"}

"""Crash-safe output: stream finished requests to ``<output>.partial``, resume from it.

``launch/generate.py --output OUT`` appends each request's line to
``OUT.partial`` the moment it finishes (one ``write`` per line, flushed and
``fsync``-ed), so a crash, a killed rank or a lost node leaves every finished
request on disk.  At the end the in-order ``OUT`` is written atomically
(temporary file + rename, :func:`~tpguide.engine.request_io.write_outputs`)
and the partial file removed.

``--resume`` reads ``OUT`` and ``OUT.partial`` (:func:`load_finished`) and
skips every request id found there.  Lines that finished with ``"error"`` are
kept too, not retried: they come from bad input (unknown field, invalid
schema, prompt too long, ...) or from a deterministic decoding failure (dead
end, non-finite logits at a seeded position) and would fail the same way
again; a request cut off by a crash never has a line, so it always reruns.
``--retry-errors`` reruns the error lines as well (after fixing the input).
A torn last line (the crash hit mid-write) is ignored.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

from tpguide.engine.request import RequestOutput


def partial_path(output_path: str) -> str:
    """Where finished requests are streamed while ``output_path`` is being produced."""
    return output_path + ".partial"


class PartialWriter:
    """Append-only, fsync-per-line writer of finished outputs (driver only).

    Parameters
    ----------
    path : str
        The ``.partial`` file.
    append : bool
        Keep its lines (a resumed run); otherwise start it empty.
    """

    def __init__(self, path: str, append: bool = False) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._f = open(path, "a" if append else "w", encoding="utf-8")

    def __call__(self, output: RequestOutput) -> None:
        """Append one output line and make it durable before returning."""
        self._f.write(json.dumps(output.to_json(), ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self, remove: bool = False) -> None:
        """Close; ``remove=True`` once the final output file is in place."""
        self._f.close()
        if remove and os.path.exists(self.path):
            os.unlink(self.path)


def _read_lines(path: str, done: Dict[str, Dict[str, Any]]) -> None:
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash mid-write: that request reruns
            if isinstance(obj, dict) and "id" in obj and "finish_reason" in obj:
                done[str(obj["id"])] = obj


def load_finished(output_path: str, retry_errors: bool = False) -> Dict[str, Dict[str, Any]]:
    """Finished outputs on disk by request id: ``output_path``, then its ``.partial``.

    Parameters
    ----------
    retry_errors : bool
        Leave out lines with ``finish_reason == "error"`` (they rerun).
    """
    done: Dict[str, Dict[str, Any]] = {}
    _read_lines(output_path, done)
    _read_lines(partial_path(output_path), done)
    if retry_errors:
        done = {k: v for k, v in done.items() if v.get("finish_reason") != "error"}
    return done


def open_partial(output_path: Optional[str], append: bool = False) -> Optional[PartialWriter]:
    """A :class:`PartialWriter` next to ``output_path``, or None without an output file."""
    return PartialWriter(partial_path(output_path), append) if output_path else None

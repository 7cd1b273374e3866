"""The compile queue: jobs (a guide's admission) run in daemon worker threads with a per-job timeout.

docs/architecture.md §5.  Compiling a
large schema takes from milliseconds to minutes.  The driver submits each
guided request's admission (checks + compile,
:func:`~tpguide.guided.admission.admit`) to the
:class:`CompileService` when the request arrives and keeps stepping the
running batch; at each step it collects what finished
(:meth:`CompileService.collect`) and only then lets those requests join the
batch.  When nothing else can run it blocks in :meth:`CompileService.wait`.

A compile that runs longer than ``timeout_s`` (counted from when a worker
started it, not from submission) is reported as a
:class:`GrammarCompileTimeout`; its thread cannot be interrupted, so it is
abandoned (its result dropped) and a fresh worker replaces it, so one slow
grammar never blocks the others.  Workers are daemon threads: an abandoned
compile never delays process exit.

It stays a file of its own, beside admission rather than inside
:mod:`tpguide.engine.intake`: it is a thread queue with a timeout, not a
request check, and it has four users, which share its limit and its
timeout message: the driver's intake, the guide check
(:mod:`tpguide.guided.guide_check`), its offline command
(:mod:`tpguide.engine.guide_check_offline`) and the server's
``/v1/guides/check`` (:mod:`tpguide.serving.server`).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple


class GrammarCompileTimeout(ValueError):
    """A guide took longer than ``--grammar-compile-timeout`` to compile."""


class _Job:
    __slots__ = ("key", "fn", "started", "done", "result", "error", "abandoned")

    def __init__(self, key: Hashable, fn: Callable[[], Any]) -> None:
        self.key, self.fn = key, fn
        self.started: Optional[float] = None
        self.done = False
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.abandoned = False


class CompileService:
    """Runs compile jobs in daemon worker threads; the caller polls for results.

    Parameters
    ----------
    timeout_s : float or None
        Seconds one job may run; None = no limit.
    num_workers : int
        Jobs compiled at once (both backends release the GIL while compiling).

    Raises
    ------
    ValueError
        ``timeout_s <= 0`` or ``num_workers < 1``.
    """

    def __init__(self, timeout_s: Optional[float] = None, num_workers: int = 1) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"grammar compile timeout must be > 0 seconds or None, got {timeout_s}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.timeout_s = timeout_s
        self._queue: "queue.Queue[_Job]" = queue.Queue()
        self._jobs: Dict[Hashable, _Job] = {}
        self._changed = threading.Condition()
        for _ in range(num_workers):
            self._start_worker()

    def _start_worker(self) -> None:
        threading.Thread(target=self._work, name="tpguide-grammar-compile", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            with self._changed:
                job.started = time.monotonic()
            try:
                result, error = job.fn(), None
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                result, error = None, exc
            with self._changed:
                job.result, job.error, job.done = result, error, True
                self._changed.notify_all()
                if job.abandoned:
                    return  # a replacement worker took over while this job overran

    def submit(self, key: Hashable, fn: Callable[[], Any]) -> None:
        """Queue ``fn()`` (no arguments) under ``key`` (unique among pending jobs)."""
        if key in self._jobs:
            raise ValueError(f"a compile job with key {key!r} is already pending")
        job = _Job(key, fn)
        self._jobs[key] = job
        self._queue.put(job)

    @property
    def num_pending(self) -> int:
        """Jobs submitted and not yet collected."""
        return len(self._jobs)

    def collect(self) -> List[Tuple[Hashable, Any, Optional[BaseException]]]:
        """Jobs finished or timed out since the last call: ``(key, result, error)``, submission order.

        A timed-out job's error is a :class:`GrammarCompileTimeout` naming the limit.
        """
        out = []
        now = time.monotonic()
        with self._changed:
            for key, job in list(self._jobs.items()):
                if job.done:
                    out.append((key, job.result, job.error))
                elif job.started is not None and self.timeout_s is not None and now - job.started > self.timeout_s:
                    job.abandoned = True
                    out.append((key, None, GrammarCompileTimeout(
                        f"grammar compilation took longer than the limit of {self.timeout_s:g} s "
                        f"(--grammar-compile-timeout); the request was not started")))
                    self._start_worker()
                else:
                    continue
                del self._jobs[key]
        return out

    def wait(self, max_wait_s: Optional[float] = None) -> None:
        """Block until a pending job finishes, the earliest running job's deadline passes, or ``max_wait_s``."""
        with self._changed:
            if not self._jobs or any(j.done for j in self._jobs.values()):
                return
            deadlines = [j.started + self.timeout_s for j in self._jobs.values()
                         if j.started is not None and self.timeout_s is not None]
            wait_s = max_wait_s
            if deadlines:
                until = max(0.0, min(deadlines) - time.monotonic()) + 1e-3
                wait_s = until if wait_s is None else min(wait_s, until)
            # a queued job's deadline starts when a worker takes it: wake up then too
            if any(j.started is None for j in self._jobs.values()) and self.timeout_s is not None:
                wait_s = min(wait_s if wait_s is not None else self.timeout_s, self.timeout_s)
            self._changed.wait(wait_s)

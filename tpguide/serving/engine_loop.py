"""The engine loop: the one thread on rank 0 that calls the engine (and so issues collectives).

The asyncio server never touches the engine.  It hands commands to the loop
through a thread-safe inbox and receives each request's outputs on its own
:class:`asyncio.Queue`, filled with ``loop.call_soon_threadsafe``::

    HTTP handler --submit(requests)--> inbox --> engine loop thread
                 <--asyncio.Queue----- outputs <-- engine.step()

While no request is unfinished the thread blocks on the inbox for at most
``heartbeat_s`` and then sends a heartbeat plan (``engine.keepalive()``),
so the other ranks, waiting in a broadcast, never reach the collective
timeout, and a dead rank still fails the next heartbeat within
``heartbeat_s`` plus the time gloo takes to see a closed socket.

An exception in the engine (a dead rank, a failed collective) ends the
thread: every waiting request gets :class:`EngineDead`, ``alive`` turns
False (``/health`` answers 503) and new requests get 503.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from tpguide.serving.metrics import ServerMetrics


class EngineDead(Exception):
    """The engine loop has ended; the message says why."""


@dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    last_time: Optional[float] = None
    num_tokens: int = 0
    prompt_counted: bool = False
    prompt_tokens: int = 0
    reasons: List[str] = field(default_factory=list)


class EngineLoop:
    """Runs ``engine.step()`` in one thread; see the module docstring.

    Parameters
    ----------
    engine : tpguide.engine.Engine
        The driver's engine (rank 0).
    metrics : ServerMetrics
    max_num_seqs : int
        Batch slots, to split in-flight requests into running and waiting.
    heartbeat_s : float
        Longest idle wait before a heartbeat; must be well below the
        collective timeout.
    """

    def __init__(self, engine, metrics: ServerMetrics, max_num_seqs: int, heartbeat_s: float = 5.0) -> None:
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self.engine, self.metrics = engine, metrics
        self.max_num_seqs, self.heartbeat_s = max_num_seqs, heartbeat_s
        self._inbox: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._subs: Dict[str, _Subscriber] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: Optional[str] = None
        self.stopped = threading.Event()
        self.num_heartbeats = 0

    # ---------------------------------------------------------------- asyncio side
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._subs)

    def submit(self, requests: Sequence[Any]) -> asyncio.Queue:
        """Queue ``requests`` for the engine; their outputs arrive on the returned queue.

        Raises
        ------
        EngineDead
            The loop has ended.
        """
        if not self.alive:
            raise EngineDead(self.error or "the engine loop is not running")
        aloop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        now = time.perf_counter()
        with self._lock:
            for req in requests:
                self._subs[req.request_id] = _Subscriber(aloop, q, now)
        self._inbox.put(("add", list(requests)))
        return q

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (client gone); their slots are freed within one step."""
        if request_ids:
            self._inbox.put(("abort", list(request_ids)))

    def stop(self, timeout: float = 8.0) -> None:
        """Abort everything, send the stop plan to every rank, end the thread."""
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        try:
            while True:
                if not self._drain(block=not self.engine.has_unfinished_requests()):
                    break
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
            self._abort_all()
            self.engine.shutdown()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request and /health
            self.error = f"engine loop failed: {type(exc).__name__}: {exc}"
            traceback.print_exc()
            self._fail_all(self.error)
        finally:
            self.stopped.set()

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; False on ``stop``.  Idle: wait up to ``heartbeat_s``, then heartbeat."""
        try:
            cmd = self._inbox.get(timeout=self.heartbeat_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            if block:
                self.engine.keepalive()
                self.num_heartbeats += 1
            return True
        while True:
            kind, arg = cmd
            if kind == "stop":
                return False
            if kind == "add":
                for req in arg:
                    self.engine.add_request(req)
            else:
                for rid in arg:
                    with self._lock:
                        known = rid in self._subs
                    if known:
                        self.engine.abort_request(rid)
            self._update_gauges()
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _abort_all(self) -> None:
        with self._lock:
            ids = list(self._subs)
        for rid in ids:
            self.engine.abort_request(rid)
        while self.engine.has_unfinished_requests():
            self._dispatch(self.engine.step())

    def _update_gauges(self) -> None:
        n = self.num_in_flight
        self.metrics.running.set(min(n, self.max_num_seqs))
        self.metrics.waiting.set(max(0, n - self.max_num_seqs))
        self.metrics.observe_kv_cache(self.engine.kv_cache_stats())

    def _dispatch(self, outputs: Sequence[Any]) -> None:
        now = time.perf_counter()
        for out in outputs:
            with self._lock:
                sub = self._subs.get(out.request_id)
                if sub is not None and out.finished:
                    del self._subs[out.request_id]
            if sub is None:
                continue
            self._record(sub, out, now)
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, out)
        self._update_gauges()

    def _record(self, sub: _Subscriber, out, now: float) -> None:
        m, new = self.metrics, len(out.new_token_ids)
        if not sub.prompt_counted and out.num_prompt_tokens:
            m.prompt_tokens.inc(out.num_prompt_tokens)
            sub.prompt_counted = True
        if new:
            m.generation_tokens.inc(new)
            if sub.last_time is None:
                m.ttft.observe(now - sub.arrival)
            else:
                for _ in range(new):
                    m.itl.observe((now - sub.last_time) / new)
            sub.last_time = now
        if out.finished:
            m.e2e.observe(now - sub.arrival)
            if out.finish_reason == "error":
                m.failed.labels(error_kind="generation" if out.token_ids else "invalid_request").inc()
            else:
                m.finished.labels(finished_reason=out.finish_reason).inc()

    def _fail_all(self, message: str) -> None:
        with self._lock:
            subs, self._subs = list(self._subs.values()), {}
        for sub in subs:
            try:
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, EngineDead(message))
            except RuntimeError:  # the event loop is closed
                pass

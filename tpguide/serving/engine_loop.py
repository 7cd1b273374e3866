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

A fault in one request's own work (admitting it, its matcher, appending its
tokens, building its output) fails that request alone, with a 500 naming
the exception (:mod:`tpguide.engine.request_faults`); the loop steps on.
Any other exception in the engine (a dead rank, a failed collective, a
fault of the step itself) ends the thread: every waiting request gets
:class:`EngineDead`, ``alive`` turns False (``/health`` answers 503), new
requests get 503, and ``launch/serve.py`` exits non-zero within a second
(:func:`tpguide.serving.server.exit_when_engine_dies`), so that a
supervisor restarts it.

Data parallel (docs/architecture.md §1 "Data parallel"): the front end runs
one loop per replica (a remote one steps a
:class:`~tpguide.serving.remote_engine.RemoteEngine`), each with its
``replica`` number for the per-replica metrics; when a loop dies, each of
its requests that has had no output yet is handed to :attr:`EngineLoop.resubmit`
(the router retries it once on a live replica) instead of failing.
"""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

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
    request: Any = None  # data parallel: an untouched copy, to retry on another replica
    cost: int = 0  # estimated tokens, prompt included (tpguide.engine.data_parallel.request_cost)
    prompt_cost: int = 0  # the prompt's part of cost
    delivered: bool = False  # some output reached the client's queue
    streamed: bool = True  # the client sees every output (else only the final one)
    retried: bool = False


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
    replica : int, optional
        Data parallel: this loop's replica (labels its metrics); None: the only engine.
    replica_name : str
        How errors name the replica, e.g. ``"replica 1 (global ranks 2-3)"``.
    """

    def __init__(self, engine, metrics: ServerMetrics, max_num_seqs: int, heartbeat_s: float = 5.0,
                 replica: Optional[int] = None, replica_name: str = "") -> None:
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self.engine, self.metrics = engine, metrics
        self.max_num_seqs, self.heartbeat_s = max_num_seqs, heartbeat_s
        self.replica, self.replica_name = replica, replica_name
        self._kv_last = (0, 0, 0)  # this engine's (prefix queries, hits, preemptions) at the last update
        #: ``resubmit(subscriber, dead_loop) -> bool``: place a request of a dead loop elsewhere (True if placed)
        self.resubmit: Optional[Callable[[_Subscriber, "EngineLoop"], bool]] = None
        self._inbox: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._subs: Dict[str, _Subscriber] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: Optional[str] = None
        self.stopped = threading.Event()
        self.num_heartbeats = 0

    # ---------------------------------------------------------------- asyncio side
    def start(self) -> None:
        self._update_gauges()  # an idle server reports its empty batch and free KV blocks from the start
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._subs)

    def submit(self, requests: Sequence[Any], stream: bool = True) -> asyncio.Queue:
        """Queue ``requests`` for the engine; their outputs arrive on the returned queue.

        ``stream=False``: the client sees only final outputs, so a request of
        a dead replica can be retried even after partial outputs (data parallel).

        Raises
        ------
        EngineDead
            The loop has ended.
        """
        if not self.alive:
            raise EngineDead(self.error or "the engine loop is not running")
        from tpguide.engine.data_parallel import request_cost

        aloop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        now = time.perf_counter()
        with self._lock:
            for req in requests:
                self._subs[req.request_id] = _Subscriber(
                    aloop, q, now, request=copy.deepcopy(req) if self.replica is not None else None,
                    cost=request_cost(req), prompt_cost=request_cost(req) - req.sampling_params.max_tokens,
                    streamed=stream)
        self._inbox.put(("add", list(requests)))
        return q

    def adopt(self, sub: _Subscriber) -> None:
        """Take over ``sub``'s request from a dead loop (its queue, timings and all); runs it once more.

        Raises
        ------
        EngineDead
            This loop has ended too.
        """
        if not self.alive:
            raise EngineDead(self.error or "the engine loop is not running")
        sub.retried = True
        sub.num_tokens, sub.prompt_counted, sub.last_time = 0, False, None  # counted afresh on this replica
        with self._lock:
            self._subs[sub.request.request_id] = sub
        self._inbox.put(("add", [sub.request]))

    def outstanding_tokens(self) -> int:
        """Estimated tokens still to compute for this loop's requests (prompts not yet reported included)."""
        with self._lock:
            return sum(max(0, sub.cost - sub.num_tokens - (sub.prompt_cost if sub.prompt_counted else 0))
                       for sub in self._subs.values())

    def health(self) -> Dict[str, Any]:
        """``/health``'s body: ``{"status": "ok", "heartbeats"}`` or ``{"status": "dead", "error"}``."""
        if self.alive:
            return {"status": "ok", "heartbeats": self.num_heartbeats}
        return {"status": "dead", "error": self.error}

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (client gone); their slots are freed within one step."""
        if request_ids:
            self._inbox.put(("abort", list(request_ids)))

    def stop(self, timeout: float = 8.0) -> None:
        """Abort everything, send the stop plan to every rank, end the thread."""
        self.request_stop()
        self._thread.join(timeout)

    def request_stop(self) -> None:
        """Ask the thread to stop (as :meth:`stop`) without waiting for it."""
        self._inbox.put(("stop", None))

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the thread to end."""
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
            where = f" of {self.replica_name}" if self.replica_name else ""
            self.error = f"engine loop{where} failed: {type(exc).__name__}: {exc}"
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
                    try:
                        self.engine.add_request(req)  # the intake fails a bad request itself; this is the backstop
                    except Exception as exc:  # noqa: BLE001 - this request's fault: it fails alone
                        traceback.print_exc()
                        self._fail_one(req, f"server error while adding the request: {type(exc).__name__}: {exc}")
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

    def _fail_one(self, req, message: str) -> None:
        """Answer one request with a server fault (500) and forget it; the loop goes on."""
        from tpguide.engine.request import RequestOutput

        with self._lock:
            sub = self._subs.pop(req.request_id, None)
        if sub is not None:
            out = RequestOutput(request_id=req.request_id, index=req.index, finish_reason="error", error=message,
                                server_fault=True)
            self._record(sub, out, time.perf_counter())
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, out)

    def _abort_all(self) -> None:
        with self._lock:
            ids = list(self._subs)
        for rid in ids:
            self.engine.abort_request(rid)
        while self.engine.has_unfinished_requests():
            self._dispatch(self.engine.step())

    def running_and_waiting(self) -> tuple:
        """(requests in the batch, requests waiting for a slot) of this loop."""
        n = self.num_in_flight
        return min(n, self.max_num_seqs), max(0, n - self.max_num_seqs)

    def _update_gauges(self) -> None:
        running, waiting = self.running_and_waiting()
        if self.replica is None:
            self.metrics.running.set(running)
            self.metrics.waiting.set(waiting)
        else:  # the totals are the router's functions over every replica
            self.metrics.replica_running.labels(replica=str(self.replica)).set(running)
            self.metrics.replica_waiting.labels(replica=str(self.replica)).set(waiting)
        kv_cache_stats = getattr(self.engine, "kv_cache_stats", None)  # a remote replica's proxy has none (yet)
        if kv_cache_stats is not None:
            self._kv_last = self.metrics.observe_kv_cache(kv_cache_stats(), self._kv_last, self.replica)

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
            sub.delivered = True
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, out)
        self._update_gauges()
        self.metrics.record_speculation(self.engine.speculation_stats())

    def _record(self, sub: _Subscriber, out, now: float) -> None:
        m, new = self.metrics, len(out.new_token_ids)
        label = None if self.replica is None else str(self.replica)
        if not sub.prompt_counted and out.num_prompt_tokens:
            m.prompt_tokens.inc(out.num_prompt_tokens)
            if label is not None:
                m.replica_prompt_tokens.labels(replica=label).inc(out.num_prompt_tokens)
            sub.prompt_counted = True
        sub.num_tokens += new
        if new:
            m.generation_tokens.inc(new)
            if label is not None:
                m.replica_generation_tokens.labels(replica=label).inc(new)
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
            if (self.resubmit is not None and sub.request is not None and not (sub.delivered and sub.streamed)
                    and not sub.retried and self.resubmit(sub, self)):
                continue  # the client has seen no output: retried once on a live replica
            try:
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, EngineDead(message))
            except RuntimeError:  # the event loop is closed
                pass

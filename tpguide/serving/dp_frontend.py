"""The data-parallel front end: every replica's engine loop behind the one interface the app uses.

docs/architecture.md §1 "Data parallel".  On global rank 0 the app talks to
a :class:`ReplicaRouter` exactly as to a single
:class:`~tpguide.serving.engine_loop.EngineLoop` (``submit``, ``abort``,
``alive``, ``health``, ``start``, ``stop``).  The router holds one loop per
replica (replica 0: the local engine; replica d >= 1: a
:class:`~tpguide.serving.remote_engine.RemoteEngine` over its channel) and:

* sends each HTTP request (all its choices) to the live replica with the
  fewest outstanding tokens (``max_tokens`` still to generate plus prompts
  not yet processed, :meth:`EngineLoop.outstanding_tokens`; ties: the lowest
  replica);
* when a replica's loop dies, retries each of its requests whose client
  has seen no output yet (not streamed, or no chunk sent) once on a live replica; the others end with the loop's error,
  which names the replica; the other replicas keep serving;
* reports each replica in ``/health`` (``ok`` / ``degraded`` while some
  replica lives, 503 ``dead`` when none does) and sums the running / waiting
  gauges over the replicas (``/metrics`` also has them per replica).
"""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List, Optional, Sequence

from tpguide.serving.engine_loop import EngineDead, EngineLoop
from tpguide.serving.metrics import ServerMetrics


class ReplicaRouter:
    """The replicas' engine loops as one loop (see the module docstring).

    Parameters
    ----------
    loops : sequence of EngineLoop
        ``loops[d]`` steps replica ``d`` (built with ``replica=d``).
    metrics : ServerMetrics
        Shared by the loops; the router owns the total running / waiting gauges.
    """

    def __init__(self, loops: Sequence[EngineLoop], metrics: ServerMetrics) -> None:
        if not loops:
            raise ValueError("a router needs at least one replica loop")
        self.loops = list(loops)
        for d, loop in enumerate(self.loops):
            loop.resubmit = self._resubmit
            metrics.replica_up.labels(replica=str(d)).set_function(lambda loop=loop: float(loop.alive))
        metrics.running.set_function(lambda: sum(loop.running_and_waiting()[0] for loop in self.loops))
        metrics.waiting.set_function(lambda: sum(loop.running_and_waiting()[1] for loop in self.loops))
        self.num_retried = 0

    # ---------------------------------------------------------------- the EngineLoop interface
    def start(self) -> None:
        for loop in self.loops:
            loop.start()

    def request_stop(self) -> None:
        """Ask every replica's loop to stop (abort, stop plans) without waiting."""
        for loop in self.loops:
            loop.request_stop()

    def stop(self, timeout: float = 12.0) -> None:
        """Stop every replica at once (abort, stop plans), then wait for each loop."""
        self.request_stop()
        for loop in self.loops:
            loop.join(timeout)

    @property
    def alive(self) -> bool:
        return any(loop.alive for loop in self.loops)

    @property
    def error(self) -> Optional[str]:
        """The first failed replica's error (None while every replica runs)."""
        return next((loop.error for loop in self.loops if loop.error), None)

    @property
    def stopped(self):
        return self.loops[0].stopped

    @property
    def num_heartbeats(self) -> int:
        return sum(loop.num_heartbeats for loop in self.loops)

    @property
    def num_in_flight(self) -> int:
        return sum(loop.num_in_flight for loop in self.loops)

    def submit(self, requests: Sequence[Any], stream: bool = True) -> asyncio.Queue:
        """Queue ``requests`` (one HTTP request's choices) on the least loaded live replica.

        Raises
        ------
        EngineDead
            No replica is alive (the message gives each one's error).
        """
        loop = self._least_loaded(exclude=None)
        if loop is None:
            raise EngineDead("no replica is alive: " + "; ".join(str(lp.error) for lp in self.loops))
        return loop.submit(requests, stream)

    def abort(self, request_ids: Sequence[str]) -> None:
        for loop in self.loops:
            loop.abort(request_ids)  # a loop ignores ids it does not hold

    def health(self) -> Dict[str, Any]:
        """``/health``'s body: overall status, heartbeats, and one entry per replica."""
        replicas: List[Dict[str, Any]] = []
        for d, loop in enumerate(self.loops):
            running, waiting = loop.running_and_waiting()
            entry = {"replica": d, "name": loop.replica_name, "status": "ok" if loop.alive else "dead",
                     "running": running, "waiting": waiting}
            if loop.error:
                entry["error"] = loop.error
            replicas.append(entry)
        alive = sum(e["status"] == "ok" for e in replicas)
        status = "ok" if alive == len(replicas) else ("degraded" if alive else "dead")
        body: Dict[str, Any] = {"status": status, "heartbeats": self.num_heartbeats, "replicas": replicas}
        if not alive:
            body["error"] = self.error
        return body

    # ---------------------------------------------------------------- placement
    def _least_loaded(self, exclude: Optional[EngineLoop]) -> Optional[EngineLoop]:
        live = [(loop.outstanding_tokens(), d, loop) for d, loop in enumerate(self.loops)
                if loop.alive and loop is not exclude]
        return min(live, key=lambda t: t[:2])[2] if live else None

    def _resubmit(self, sub, dead: EngineLoop) -> bool:
        """A dead loop's request without output: once more on the least loaded live replica."""
        loop = self._least_loaded(exclude=dead)
        if loop is None:
            return False
        try:
            loop.adopt(sub)
        except EngineDead:
            return False
        self.num_retried += 1
        return True

"""Offline data parallelism: the front end splits a request list over the replicas and gathers the outputs.

docs/architecture.md §1 "Data parallel".  Global rank 0 (the front end and
replica 0's driver) assigns each request to the replica with the fewest
assigned tokens (:func:`assign_to_replicas`), sends every remote driver its
share over its control channel (:mod:`tpguide.dist.replica_channel`), runs
its own share on replica 0, and collects the remote outputs in one thread
per channel as they finish (``on_output`` streams them all to
``OUT.partial``).  A remote driver (:func:`follow_front_end`) receives its
share, runs it with :meth:`Engine.generate` and sends each final output
back.  A request's tokens do not depend on its replica or its batch (the
model is TP- and batch-invariant, §6), so the outputs equal a one-group run.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional

from tpguide.dist.replica_channel import ChannelClosed, ReplicaChannel
from tpguide.engine.request import Request, RequestOutput


class ReplicaFailed(RuntimeError):
    """A replica died or became unreachable; the message names it and what was lost."""


def request_cost(request: Request) -> int:
    """Estimated tokens a request will cost its replica: ``max_tokens`` + prompt characters / 4 (>= 0)."""
    text = request.prompt or "".join(str(m.get("content", "")) for m in (request.messages or []))
    return (0 if request.is_finished else request.sampling_params.max_tokens) + len(text) // 4


def assign_to_replicas(requests: List[Request], dp_size: int) -> List[List[Request]]:
    """Split ``requests`` into ``dp_size`` shares, each request to the least loaded share so far.

    Greedy in input order on :func:`request_cost` (ties: the lowest replica),
    so the split is a pure function of the requests.  Each share keeps input order.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    shares: List[List[Request]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for req in requests:
        d = min(range(dp_size), key=lambda k: (load[k], k))
        shares[d].append(req)
        load[d] += request_cost(req)
    return shares


def generate_on_replicas(engine, channels: Dict[int, ReplicaChannel], requests: List[Request],
                         progress: bool = False,
                         on_output: Optional[Callable[[RequestOutput], None]] = None) -> List[RequestOutput]:
    """Run ``requests`` on every replica (global rank 0); the final outputs in input order.

    Parameters
    ----------
    engine : Engine
        Replica 0's engine (this rank is its driver).
    channels : dict of int to ReplicaChannel
        One per remote replica, keyed by ``dp_rank`` (``1 .. dp_size - 1``).
    on_output : callable, optional
        Called (under a lock, from any thread) with each final output as it arrives.

    Raises
    ------
    ReplicaFailed
        A remote replica failed before sending all its outputs (its finished
        ones were passed to ``on_output``); names the replica.
    """
    shares = assign_to_replicas(requests, 1 + len(channels))
    lock = threading.Lock()
    final: Dict[int, RequestOutput] = {}
    failures: Dict[int, str] = {}

    def deliver(out: RequestOutput) -> None:
        with lock:
            final[out.index] = out
            if on_output is not None:
                on_output(out)

    def collect(d: int, channel: ReplicaChannel) -> None:
        try:
            while True:
                kind, payload = channel.get(timeout=None)
                if kind == "output":
                    deliver(payload)
                elif kind == "done":
                    break
        except ChannelClosed as exc:
            failures[d] = str(exc)
        finally:
            channel.close()

    for d, channel in channels.items():
        channel.send("requests", shares[d])
    threads = [threading.Thread(target=collect, args=(d, ch), name=f"collect-{d}", daemon=True)
               for d, ch in channels.items()]
    for t in threads:
        t.start()
    engine.generate(shares[0], progress=progress, on_output=deliver)
    for t in threads:
        t.join()
    if failures:
        lost = sum(1 for r in requests if r.index not in final)
        raise ReplicaFailed(f"{'; '.join(failures[d] for d in sorted(failures))}; {lost} request(s) did not "
                            f"finish (the finished ones are in OUT.partial: rerun with --resume)")
    return [final[r.index] for r in requests]


def follow_front_end(engine, channel: ReplicaChannel) -> int:
    """A remote driver offline: receive this replica's share, run it, send each final output back.

    Returns the number of requests run.  Raises :class:`ChannelClosed`
    when the front end is gone (the caller's failure policy ends the rank).
    """
    kind, requests = channel.get(timeout=None)
    if kind != "requests":
        raise RuntimeError(f"expected the front end's 'requests' message, got {kind!r}")
    now = time.perf_counter()  # arrival times are per process
    for req in requests:
        req.arrival_time = now
    engine.generate(requests, on_output=lambda out: channel.send("output", out))
    channel.send("done", len(requests))
    channel.close()
    return len(requests)

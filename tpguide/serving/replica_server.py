"""A remote replica's driver while serving: requests from the front end in, outputs back.

docs/architecture.md §1 "Data parallel".  The driver of replica d >= 1 runs
:func:`serve_replica` in its main thread, the only thread that calls its
engine (and so issues its TP group's collectives, unchanged per step):
between steps it takes the front end's messages from the control channel's
inbox (never blocking while requests run), steps the engine, and queues the
changed outputs for the channel's sender thread.  Idle, it waits for a
message at most ``heartbeat_s`` between heartbeats to its own ranks.
Messages: see :mod:`tpguide.serving.remote_engine`.

Failures: the front end gone (:class:`ChannelClosed`) sends STOP to this
replica's ranks and re-raises (the rank exits 1: every rank exits when the
front end dies); a failure of this replica's own step is reported as
``("failed", error)`` before it is re-raised.  A signal (``leaving`` set)
first checks the TP group with a heartbeat, then asks the front end to end
the job (``("leave", reason)``); the front end answers ``stop``.
"""

from __future__ import annotations

import threading
import time
from typing import Set

from tpguide.dist.replica_channel import ChannelClosed, ReplicaChannel


def serve_replica(engine, channel: ReplicaChannel, heartbeat_s: float, leaving: threading.Event) -> None:
    """Serve the front end's requests on this replica until ``stop`` (see the module docstring).

    Raises
    ------
    ChannelClosed
        The front end is unreachable (this replica's ranks got STOP first).
    Exception
        This replica's engine failed (reported to the front end first).
    """
    try:
        _serve(engine, channel, heartbeat_s, leaving)
    except ChannelClosed:
        engine.shutdown()  # STOP: this replica's other ranks exit
        raise
    except Exception as exc:
        try:
            channel.send("failed", f"{type(exc).__name__}: {exc}")
            channel.close(timeout_s=2.0)
        except ChannelClosed:
            pass
        raise


def _serve(engine, channel: ReplicaChannel, heartbeat_s: float, leaving: threading.Event) -> None:
    running: Set[str] = set()
    last_collective, asked_to_leave = time.monotonic(), False
    while True:
        if leaving.is_set() and not asked_to_leave:
            engine.keepalive()  # a signal after a rank of this replica died must not end the job: fail here
            channel.send("leave", "its ranks got a signal")
            asked_to_leave = True
        idle = not engine.has_unfinished_requests()
        msg = channel.get(timeout=0.5 if idle else 0)
        while msg is not None:
            kind, payload = msg
            if kind == "add":
                now = time.perf_counter()  # arrival times are per process
                for req in payload:
                    req.arrival_time = now
                    running.add(req.request_id)
                    engine.add_request(req)
            elif kind == "abort":
                for rid in payload:
                    engine.abort_request(rid)
            elif kind == "stop":
                _stop(engine, channel, running)
                return
            msg = channel.get(timeout=0)
        if engine.has_unfinished_requests():
            _send_outputs(channel, engine.step(), running)
            last_collective = time.monotonic()
        elif time.monotonic() - last_collective >= heartbeat_s:
            engine.keepalive()
            last_collective = time.monotonic()


def _send_outputs(channel: ReplicaChannel, outputs, running: Set[str]) -> None:
    for out in outputs:
        if out.finished:
            running.discard(out.request_id)
    if outputs:
        channel.send("outputs", outputs)


def _stop(engine, channel: ReplicaChannel, running: Set[str]) -> None:
    for rid in list(running):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        _send_outputs(channel, engine.step(), running)
    engine.shutdown()
    channel.send("stopped")
    channel.close(timeout_s=5.0)

"""The engine API of a remote replica, on the front end: what an :class:`EngineLoop` steps for replica d >= 1.

docs/architecture.md §1 "Data parallel".  The front end (global rank 0)
runs one :class:`~tpguide.serving.engine_loop.EngineLoop` per replica; for a
remote one the loop's engine is a :class:`RemoteEngine`, which forwards
``add_request`` / ``abort_request`` over the replica's control channel
(:mod:`tpguide.dist.replica_channel`) and whose ``step()`` returns the
outputs the replica's driver has sent since (waiting at most ``poll_s``).
The driver's side is :func:`tpguide.serving.replica_server.serve_replica`.

Messages, front end -> driver: ``("add", [Request])``, ``("abort", [id])``,
``("stop", None)``; driver -> front end: ``("outputs", [RequestOutput])``,
``("leave", reason)`` (the driver's ranks got SIGTERM: end the job),
``("failed", error)`` (its TP group failed), ``("stopped", None)``.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Set

from tpguide.dist.replica_channel import ChannelClosed, ReplicaChannel


class ReplicaLost(Exception):
    """A remote replica failed or became unreachable; the message names it."""


class RemoteEngine:
    """The :class:`~tpguide.engine.Engine` driver API over a replica's channel (front end only).

    Parameters
    ----------
    channel : ReplicaChannel
        The front end's end of the replica's control channel.
    on_leave : callable, optional
        ``on_leave(reason)`` when the replica asks to end the job (its ranks got a signal).
    poll_s : float
        Longest wait of :meth:`step` for outputs, seconds.
    """

    def __init__(self, channel: ReplicaChannel, on_leave: Optional[Callable[[str], None]] = None,
                 poll_s: float = 0.01) -> None:
        self.channel, self.on_leave, self.poll_s = channel, on_leave, poll_s
        self._unfinished: Set[str] = set()

    def add_request(self, request) -> None:
        self._unfinished.add(request.request_id)
        self._send("add", [request])

    def abort_request(self, request_id: str) -> None:
        if request_id in self._unfinished:
            self._send("abort", [request_id])

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def speculation_stats(self) -> None:
        """None: a remote replica's speculation counters stay on its node."""
        return None

    def step(self) -> List:
        """The outputs received since the last call (waits up to ``poll_s`` for the first).

        Raises
        ------
        ReplicaLost
            The replica reported a failure, or its channel failed.
        """
        outputs = self._receive(self.poll_s)
        for out in outputs:
            if out.finished:
                self._unfinished.discard(out.request_id)
        return outputs

    def keepalive(self) -> None:
        """Idle: notice a failed or leaving replica (the channel sends its own heartbeats)."""
        self._receive(0)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Send ``stop``, wait up to ``timeout_s`` for ``stopped``, close the channel."""
        import time

        self._send("stop")
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                msg = self.channel.get(timeout=0.1)
                if msg is not None and msg[0] == "stopped":
                    break
        except ChannelClosed:
            pass
        self.channel.close(timeout_s=2.0)

    def _send(self, kind: str, payload=None) -> None:
        try:
            self.channel.send(kind, payload)
        except ChannelClosed as exc:
            raise ReplicaLost(str(exc)) from None

    def _receive(self, timeout: float) -> List:
        outputs: List = []
        try:
            msg = self.channel.get(timeout=timeout)
            while msg is not None:
                kind, payload = msg
                if kind == "outputs":
                    outputs.extend(payload)
                elif kind == "failed":
                    raise ReplicaLost(f"{self.channel.name} failed: {payload}")
                elif kind == "leave" and self.on_leave is not None:
                    self.on_leave(f"{self.channel.name}: {payload}")
                msg = self.channel.get(timeout=0)
        except ChannelClosed as exc:
            raise ReplicaLost(str(exc)) from None
        return outputs

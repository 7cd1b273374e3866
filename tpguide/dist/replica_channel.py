"""The control channel: pickled messages between the front end (global rank 0) and one replica's driver.

docs/architecture.md §1 "Data parallel".  Each remote replica ``d >= 1`` is
linked to global rank 0 by two 2-rank gloo groups ``{0, d * T}`` (gloo even
on GPUs: the messages are pickled Python objects), one per direction.  On
each end one sender thread owns the outgoing group and one receiver thread
the incoming one, so no group is ever used by two threads, and the step
loops never block on the channel: they put messages in an outbox and poll
an inbox between steps, so a replica's TP group keeps its per-step
collectives unchanged.

Liveness: a sender idle for ``heartbeat_s`` sends a heartbeat, so the
receiver's blocking ``recv`` never reaches the collective timeout while the
peer lives.  A dead peer (closed socket) fails the pending ``recv`` at once,
a stuck one after the collective timeout; either way :attr:`ReplicaChannel.error`
is set and :meth:`ReplicaChannel.get` / :meth:`ReplicaChannel.send` raise
:class:`ChannelClosed` naming the peer.  Closing is a handshake: each side
sends ``bye`` as its last message and its receiver ends on the peer's
``bye``, so no operation is left pending on either side.
"""

from __future__ import annotations

import datetime
import queue
import threading
from typing import Any, Dict, Optional, Tuple

import torch.distributed as dist

from tpguide.dist.group import TPGroup
from tpguide.dist.replicas import describe_replica

HEARTBEAT = "heartbeat"
BYE = "bye"
_FAILED = ("__failed__", None)

Message = Tuple[str, Any]


class ChannelClosed(Exception):
    """The peer closed the channel or the link failed; the message names the peer and the cause."""


class ReplicaChannel:
    """One end of a control channel (see the module docstring).

    Parameters
    ----------
    send_group, recv_group : torch.distributed.ProcessGroup
        The two 2-rank gloo groups: this end sends on the first, receives on the second.
    peer : int
        The peer's rank inside both groups (0 or 1).
    name : str
        How errors name the peer, e.g. ``"replica 1 (global ranks 2-3)"``.
    heartbeat_s : float
        Longest time between two messages sent; well below the collective timeout.
    """

    def __init__(self, send_group, recv_group, peer: int, name: str, heartbeat_s: float) -> None:
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self.name, self.heartbeat_s = name, heartbeat_s
        self._send_group, self._recv_group, self._peer = send_group, recv_group, peer
        self._outbox: "queue.SimpleQueue[Message]" = queue.SimpleQueue()
        self._inbox: "queue.SimpleQueue[Message]" = queue.SimpleQueue()
        self.error: Optional[str] = None
        self._closing = False
        self._sender = threading.Thread(target=self._send_loop, name=f"send-{name}", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name=f"recv-{name}", daemon=True)
        self._sender.start()
        self._receiver.start()

    # ---------------------------------------------------------------- API
    def send(self, kind: str, payload: Any = None) -> None:
        """Queue ``(kind, payload)`` for the peer (returns at once).

        Raises
        ------
        ChannelClosed
            The link has failed, or :meth:`close` was called.
        """
        if self.error is not None:
            raise ChannelClosed(self.error)
        if self._closing:
            raise ChannelClosed(f"the channel to {self.name} is closed")
        self._outbox.put((kind, payload))

    def get(self, timeout: Optional[float]) -> Optional[Message]:
        """The next message from the peer, or None after ``timeout`` seconds (None: wait for one).

        Raises
        ------
        ChannelClosed
            The link failed or the peer said ``bye`` (after every message
            that came before has been returned).
        """
        try:
            msg = self._inbox.get(timeout=timeout) if timeout is None or timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None
        if msg is _FAILED or msg[0] == BYE:
            self._inbox.put(msg)  # every later get raises too
            raise ChannelClosed(self.error if msg is _FAILED else f"{self.name} closed the channel")
        return msg

    def close(self, timeout_s: float = 10.0) -> None:
        """Send ``bye`` and wait up to ``timeout_s`` for the peer's ``bye`` (the handshake); idempotent."""
        if not self._closing:
            self._closing = True
            self._outbox.put((BYE, None))
        self._sender.join(timeout_s)
        self._receiver.join(timeout_s)

    @property
    def alive(self) -> bool:
        """False once the link has failed."""
        return self.error is None

    # ---------------------------------------------------------------- threads
    def _fail(self, what: str, exc: BaseException) -> None:
        if self.error is None:
            first = (str(exc).strip().splitlines() or [""])[0]
            self.error = f"{self.name} is unreachable ({what} failed: {type(exc).__name__}: {first})"
            self._inbox.put(_FAILED)

    def _send_loop(self) -> None:
        while True:
            try:
                msg = self._outbox.get(timeout=self.heartbeat_s)
            except queue.Empty:
                msg = (HEARTBEAT, None)
            try:
                dist.send_object_list([msg], group_dst=self._peer, group=self._send_group)
            except Exception as exc:  # noqa: BLE001 - a dead or stuck peer; reported through get/send
                self._fail("send", exc)
                return
            if msg[0] == BYE:
                return

    def _recv_loop(self) -> None:
        while True:
            box = [None]
            try:
                dist.recv_object_list(box, group_src=self._peer, group=self._recv_group)
            except Exception as exc:  # noqa: BLE001 - a dead or stuck peer; reported through get/send
                self._fail("receive", exc)
                return
            if box[0][0] == HEARTBEAT:
                continue
            self._inbox.put(box[0])
            if box[0][0] == BYE:
                return


def open_replica_channels(group: TPGroup, heartbeat_s: float, timeout_s: float) -> Dict[int, ReplicaChannel]:
    """Create the control groups (collective: call on every rank) and this rank's channel ends.

    Returns
    -------
    dict of int to ReplicaChannel
        Keyed by the peer's ``dp_rank``: on global rank 0 one channel per
        remote replica ``1 .. dp_size - 1``; on a remote driver ``{0: channel}``
        to the front end; empty on other ranks and when ``dp_size == 1``.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    channels: Dict[int, ReplicaChannel] = {}
    for d in range(1, group.dp_size):
        ranks = [0, d * group.tp_size]
        down = dist.new_group(ranks, timeout=timeout, backend="gloo")  # front end -> driver d
        up = dist.new_group(ranks, timeout=timeout, backend="gloo")  # driver d -> front end
        if group.rank == 0:
            channels[d] = ReplicaChannel(down, up, 1, describe_replica(d, group.tp_size), heartbeat_s)
        elif group.rank == ranks[1]:
            channels[0] = ReplicaChannel(up, down, 0, "the front end (global rank 0)", heartbeat_s)
    return channels

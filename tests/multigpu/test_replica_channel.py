"""The control channel between the front end and a replica's driver, on real gloo ranks (dp 2 x tp 1 and dp 2 x tp 2).

* messages arrive in order both ways, heartbeats keep an idle link alive past
  the collective timeout, and the ``bye`` handshake ends both threads;
* the TP groups of a dp 2 x tp 2 world are the replicas' (a broadcast inside
  replica 1 reaches only replica 1, from its driver);
* a peer that dies makes the survivor's ``get`` raise :class:`ChannelClosed`
  naming it, within seconds, not a hang.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from tpguide.dist import group as C
from tpguide.dist.spawn import run_on_ranks


def _echo(group):
    from tpguide.dist.replica_channel import open_replica_channels

    channels = open_replica_channels(group, heartbeat_s=0.5, timeout_s=3.0)
    # the broadcast of each TP group starts at its own driver (global rank dp_rank * tp_size)
    seen = C.broadcast_object(("from", group.rank), group)
    if group.rank == 0:
        ch = channels[1]
        for i in range(3):
            ch.send("ping", i)
        time.sleep(4.0)  # idle longer than the collective timeout: heartbeats keep the link up
        got = [ch.get(timeout=10) for _ in range(3)]
        ch.send("done")
        ch.close()
        return {"seen": seen, "got": got, "alive": ch.alive, "threads": ch._sender.is_alive() or ch._receiver.is_alive()}
    if group.is_driver:
        ch = channels[0]
        for _ in range(3):
            kind, i = ch.get(timeout=10)
            ch.send("pong", i * 10)
        assert ch.get(timeout=10) == ("done", None)
        ch.close()
        return {"seen": seen, "threads": ch._sender.is_alive() or ch._receiver.is_alive()}
    return {"seen": seen}


def test_messages_heartbeats_and_close_dp2_tp2():
    res = run_on_ranks(_echo, 4, data_parallel_size=2, timeout_s=120)
    assert [r["seen"] for r in res] == [("from", 0), ("from", 0), ("from", 2), ("from", 2)]
    assert res[0]["got"] == [("pong", 0), ("pong", 10), ("pong", 20)] and res[0]["alive"]
    assert not res[0]["threads"] and not res[2]["threads"]


def _peer_dies(group):
    from tpguide.dist.replica_channel import ChannelClosed, open_replica_channels

    channels = open_replica_channels(group, heartbeat_s=0.5, timeout_s=30.0)
    if group.rank == 1:
        channels[0].send("hello")
        time.sleep(0.5)
        threading.Timer(0.5, os._exit, (0,)).start()  # like a killed process: no bye, after reporting
        return None
    ch = channels[1]
    assert ch.get(timeout=10) == ("hello", None)
    start = time.monotonic()
    with pytest.raises(ChannelClosed) as err:
        while True:
            ch.get(timeout=1)
    with pytest.raises(ChannelClosed):
        ch.send("late")
    return str(err.value), time.monotonic() - start


def test_a_dead_peer_fails_the_channel_naming_it():
    message, after_s = run_on_ranks(_peer_dies, 2, data_parallel_size=2, timeout_s=60)[0]
    assert "replica 1 (global rank 1) is unreachable" in message
    assert after_s < 15, f"noticed after {after_s:.1f} s (collective timeout 30 s)"

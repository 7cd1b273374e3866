"""The data-parallel router in one process, over fake engines: placement, retry once, health, gauges.

The fakes (``tests/fake_engine.py``) emit one token per step; a dying one
raises in its ``step`` as a :class:`~tpguide.serving.remote_engine.RemoteEngine`
does when its replica is lost.
"""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine

from tpguide.engine.request_io import request_from_dict
from tpguide.serving.dp_frontend import ReplicaRouter
from tpguide.serving.engine_loop import EngineDead, EngineLoop
from tpguide.serving.metrics import ServerMetrics


def _router(*engines):
    metrics = ServerMetrics("m")
    loops = [EngineLoop(e, metrics, 2, 0.05, replica=d, replica_name=f"replica {d}") for d, e in enumerate(engines)]
    router = ReplicaRouter(loops, metrics)
    router.start()
    return router, metrics


def _req(i, max_tokens=3):
    return request_from_dict({"id": f"r{i}", "prompt": "hello", "max_tokens": max_tokens}, i, 16)


async def _finals(q, n):
    out = []
    while len(out) < n:
        item = await asyncio.wait_for(q.get(), 10)
        if isinstance(item, EngineDead) or item.finished:
            out.append(item)
    return out


def test_least_outstanding_tokens_and_gauges():
    import threading

    gate = threading.Event()
    router, metrics = _router(FakeEngine(gate=gate), FakeEngine(gate=gate))

    async def run():
        q_big = router.submit([_req(0, max_tokens=50)])
        assert router.loops[0].outstanding_tokens() == 50 + len("hello") // 4
        q_a = router.submit([_req(1)])  # replica 1 (replica 0 holds 51 tokens)
        q_b = router.submit([_req(2)])  # replica 1 again (3 + 3 < 51)
        assert [lp.num_in_flight for lp in router.loops] == [1, 2]
        gate.set()
        return await _finals(q_big, 1), await _finals(q_a, 1), await _finals(q_b, 1)

    big, a, b = asyncio.run(run())
    assert big[0].finish_reason == a[0].finish_reason == "length"
    assert router.loops[1].engine.steps >= 3 and "r1" not in router.loops[0].engine.reqs
    text = metrics.render()[0].decode()
    assert 'tpguide:replica_generation_tokens_total{replica="1"} 6.0' in text
    assert 'tpguide:replica_up{replica="0"} 1.0' in text
    router.stop()


def test_a_dead_replica_retries_unseen_requests_once_and_fails_streamed_ones():
    import threading

    gate = threading.Event()
    router, _ = _router(FakeEngine(gate=gate), FakeEngine(die_after_steps=1))

    async def run():
        q_busy = router.submit([_req(9, max_tokens=60)])  # replica 0 (tie: the lowest), held by the gate
        q_stream = router.submit([_req(0, max_tokens=4)], stream=True)  # replica 1: fewer outstanding tokens
        q_plain = router.submit([_req(1, max_tokens=4)], stream=False)  # replica 1
        assert [lp.num_in_flight for lp in router.loops] == [1, 2]
        (streamed,) = await _finals(q_stream, 1)  # replica 1 dies at its second step
        gate.set()
        return streamed, (await _finals(q_plain, 1))[0], await _finals(q_busy, 1)

    streamed, plain, _busy = asyncio.run(run())
    assert isinstance(streamed, EngineDead) and "replica 1" in str(streamed) and "replica lost" in str(streamed)
    assert plain.finish_reason == "length" and plain.token_ids == [0, 1, 2, 3] and router.num_retried == 1
    health = router.health()
    assert health["status"] == "degraded"
    assert [r["status"] for r in health["replicas"]] == ["ok", "dead"] and "replica lost" in health["replicas"][1]["error"]
    assert router.alive and router.error.startswith("engine loop of replica 1 failed")
    router.stop()


def test_no_live_replica_is_engine_dead():
    router, _ = _router(FakeEngine(die_after_steps=0))

    async def run():
        q = router.submit([_req(0)], stream=False)
        (item,) = await _finals(q, 1)  # no other replica to retry on
        assert isinstance(item, EngineDead)
        with pytest.raises(EngineDead, match="no replica is alive"):
            router.submit([_req(1)])

    asyncio.run(run())
    assert router.health()["status"] == "dead"
    router.stop()

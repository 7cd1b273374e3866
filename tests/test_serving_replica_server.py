"""A remote replica's serve loop in one process, over a fake channel and a fake engine.

``add`` runs requests and sends their outputs, ``abort`` and ``stop`` end
them (``stopped`` after the stop plan); the front end gone sends STOP to the
replica's ranks and re-raises; an engine failure is reported as ``failed``
first; a signal checks the group, then asks the front end to end the job.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
from fake_engine import FakeEngine

from tpguide.dist.replica_channel import ChannelClosed
from tpguide.engine.request_io import request_from_dict
from tpguide.serving.replica_server import serve_replica


class FakeChannel:
    name = "the front end (global rank 0)"

    def __init__(self, *messages, then_close=False):
        self.inbox, self.sent, self.closed, self.then_close = queue.SimpleQueue(), [], False, then_close
        for m in messages:
            self.inbox.put(m)

    def send(self, kind, payload=None):
        self.sent.append((kind, payload))

    def get(self, timeout):
        try:
            return self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
        except queue.Empty:
            if self.then_close:
                raise ChannelClosed(f"{self.name} is unreachable (receive failed)") from None
            return None

    def close(self, timeout_s=10.0):
        self.closed = True


class Engine(FakeEngine):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.shutdowns = self.keepalives = 0

    def shutdown(self):
        self.shutdowns += 1

    def keepalive(self):
        self.keepalives += 1


def _req(i, n=3):
    return request_from_dict({"id": f"r{i}", "prompt": "hi", "max_tokens": n}, i, 16)


def test_requests_run_and_stop_answers_stopped():
    ch = FakeChannel(("add", [_req(0), _req(1, n=50)]), ("abort", ["r1"]))
    engine = Engine()
    done = threading.Event()
    t = threading.Thread(target=lambda: (serve_replica(engine, ch, 1.0, threading.Event()), done.set()))
    t.start()
    outputs, deadline = [], time.monotonic() + 10
    while not any(o.request_id == "r0" and o.finished for o in outputs) and time.monotonic() < deadline:
        time.sleep(0.01)
        outputs = [o for kind, batch in list(ch.sent) if kind == "outputs" for o in batch]
    ch.inbox.put(("stop", None))
    t.join(10)
    assert done.is_set() and engine.shutdowns == 1 and ch.closed
    assert ch.sent[-1] == ("stopped", None)
    finals = {o.request_id: o.token_ids for kind, batch in ch.sent if kind == "outputs" for o in batch if o.finished}
    assert finals["r0"] == [0, 1, 2] and "r1" not in engine.reqs


def test_front_end_gone_stops_the_replica_and_raises():
    ch, engine = FakeChannel(then_close=True), Engine()
    with pytest.raises(ChannelClosed, match="global rank 0"):
        serve_replica(engine, ch, 1.0, threading.Event())
    assert engine.shutdowns == 1


def test_an_engine_failure_is_reported_first():
    ch, engine = FakeChannel(("add", [_req(0, n=5)])), Engine(die_after_steps=1)
    with pytest.raises(RuntimeError, match="replica lost"):
        serve_replica(engine, ch, 1.0, threading.Event())
    assert ("failed", "RuntimeError: replica lost") in ch.sent and ch.closed


def test_a_signal_checks_the_group_then_asks_to_end_the_job():
    leaving = threading.Event()
    leaving.set()
    ch, engine = FakeChannel(("stop", None)), Engine()
    serve_replica(engine, ch, 1.0, leaving)
    assert engine.keepalives == 1 and ch.sent[0] == ("leave", "its ranks got a signal")
    assert ch.sent[-1] == ("stopped", None)

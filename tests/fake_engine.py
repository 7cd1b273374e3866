"""A fake of the engine's driver API (tests of the serving loops): one token per step, optionally dying.

``FakeEngine(die_after_steps=N)`` raises ``RuntimeError("replica lost")`` in
its step N + 1; ``gate`` (a ``threading.Event``) holds every step until set.
"""

from __future__ import annotations

from tpguide.engine.request import RequestOutput


class FakeEngine:
    def __init__(self, die_after_steps=None, gate=None):
        self.reqs, self.steps, self.die_after, self.gate = {}, 0, die_after_steps, gate

    def add_request(self, req):
        self.reqs[req.request_id] = [req, 0]

    def abort_request(self, rid):
        self.reqs.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        if self.gate is not None:
            self.gate.wait(5)
        self.steps += 1
        if self.die_after is not None and self.steps > self.die_after:
            raise RuntimeError("replica lost")
        outs = []
        for rid, entry in list(self.reqs.items()):
            req, n = entry
            entry[1] = n + 1
            done = entry[1] >= req.sampling_params.max_tokens
            outs.append(RequestOutput(rid, req.index, new_token_ids=[n], token_ids=list(range(n + 1)),
                                      finish_reason="length" if done else None, num_prompt_tokens=2))
            if done:
                del self.reqs[rid]
        return outs

    def keepalive(self):
        pass

    def speculation_stats(self):
        return None

    def shutdown(self):
        pass

"""The runner's check of its CUDA fast path against the plain eager step (docs/gpu.md "The fast path checks itself").

A stand-in for a bucket's CUDA graph (the eager step on the persistent
buffers, on CPU) that changes one logit by one ulp, or whose capture fails,
must turn the fast path off for the run: every output equals the plain
run's, and the runner says why.  An unchanged stand-in is kept, and each
kind of step is checked at most :data:`CHECKED_STEPS` times.
"""

import json
from collections import Counter

import pytest
import torch
from test_runner_static_inputs import REQUESTS as STATIC_REQUESTS

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine, step_capacity
from tpguide.engine.request_io import parse_request_lines
from tpguide.worker.cuda_graphs import PaddedEager, forward_logits, graph_buckets
from tpguide.worker.fast_path_check import CHECKED_STEPS, GraphCaptureError, bit_difference
from tpguide.worker.runner import StepRunner

REQUESTS = [  # a guided row (test_runner_static_inputs.py's schema), a sampled row, a greedy row
    {**STATIC_REQUESTS[0], "max_tokens": 16},
    {"id": "sampled", "prompt": "Once upon a time there was a", "max_tokens": 10, "temperature": 0.8,
     "top_p": 0.9, "seed": 3},
    {"id": "greedy", "prompt": "The sea is", "max_tokens": 12},
]
CONFIG = EngineConfig(max_num_seqs=3, max_num_batched_tokens=48, max_model_len=128)


class StandInGraphs(PaddedEager):
    """A "graph" per bucket: the eager step on the buffers, unpadded (CPU has no graphs).

    ``perturb_replay=n``: the ``n``-th replay of a bucket adds one ulp to its
    logit ``[0, 0]``; ``capture_fails``: the first replay raises as a failed capture.
    """

    def __init__(self, runner, perturb_replay=None, capture_fails=False):
        super().__init__(runner.model, runner.buffers, graph_buckets(runner.buffers.capacity.max_tokens))
        self.perturb_replay, self.capture_fails = perturb_replay, capture_fails
        self.replays = Counter()

    def run(self, plan, bucket):
        if self.capture_fails:
            raise GraphCaptureError(f"capturing the CUDA graph of bucket {bucket} tokens failed: a test")
        self.replays[bucket] += 1
        inputs = self.buffers.stage(plan)
        logits = forward_logits(self.model, inputs)  # [R, V_local]
        if self.replays[bucket] == self.perturb_replay:
            logits[0, 0] = torch.nextafter(logits[0, 0], torch.tensor(float("inf")))
        return inputs, logits


def _run(model_path, fast=True, **graphs):
    engine = build_engine(TPGroup(), model_path, CONFIG)
    stand_in = None
    if fast:
        engine.runner = StepRunner(engine.model, engine.group, capacity=step_capacity(CONFIG), static_inputs=True)
        stand_in = engine.runner.graphs = StandInGraphs(engine.runner, **graphs)
    requests = parse_request_lines([json.dumps(r) for r in REQUESTS], 64)
    outputs = [o.to_json() for o in engine.generate(requests)]
    engine.shutdown()
    return outputs, engine.runner, stand_in


@pytest.fixture(scope="module")
def plain(tiny_model_path):
    return _run(tiny_model_path, fast=False)[0]


def _same(got, want):
    for a, b in zip(got, want, strict=True):
        assert a["finish_reason"] == b["finish_reason"] != "error", a
        assert a["token_ids"] == b["token_ids"], a["id"]
        assert json.dumps(a.get("logprobs")) == json.dumps(b.get("logprobs")), a["id"]


def test_an_identical_fast_path_is_kept_and_each_kind_checked_at_most_twice(tiny_model_path, plain):
    got, runner, stand_in = _run(tiny_model_path)
    _same(got, plain)
    assert runner.fast_path_off_reason == "" and runner.static_inputs and runner.graphs is stand_in
    checked = runner.fast_path_check.checked
    assert checked and max(checked.values()) == CHECKED_STEPS, checked  # decode steps repeat their bucket
    graph_checks = sum(n for (kind, _), n in checked.items() if kind == "graph")
    assert sum(stand_in.replays.values()) > graph_checks  # later replays run unchecked


@pytest.mark.parametrize("nth", [1, 2])
def test_a_differing_graph_turns_the_fast_path_off_and_the_plain_outputs_stay(tiny_model_path, plain, nth, capfd):
    got, runner, stand_in = _run(tiny_model_path, perturb_replay=nth)
    _same(got, plain)
    reason = runner.fast_path_off_reason
    assert "the CUDA graph of bucket" in reason and "1 of" in reason and "first at row 0 column 0" in reason, reason
    assert not runner.static_inputs and runner.graphs is None and runner.buffers is None
    assert "WARNING: CUDA fast path" in capfd.readouterr().err


def test_a_failed_capture_falls_back_to_the_plain_step(tiny_model_path, plain, capfd):
    got, runner, _ = _run(tiny_model_path, capture_fails=True)
    _same(got, plain)
    assert runner.fast_path_off_reason.startswith("capturing the CUDA graph of bucket"), runner.fast_path_off_reason
    assert not runner.static_inputs
    assert "a test" in capfd.readouterr().err


def test_bit_difference_names_the_first_differing_logit():
    a = torch.randn(3, 5)
    assert bit_difference(a, a.clone()) is None
    b = a.clone()
    b[2, 1] = torch.nextafter(b[2, 1], torch.tensor(float("inf")))
    b[2, 4] = -b[2, 4]
    assert bit_difference(b, a).startswith("2 of 15 logits differ, first at row 2 column 1")
    nan = torch.full((1, 2), float("nan"))
    assert bit_difference(nan, nan.clone()) is None  # the same bits
    assert bit_difference(torch.zeros(1, 2), torch.zeros(1, 2) * -1) is not None  # -0.0 is other bits
    assert "shape" in bit_difference(a, a[:2])

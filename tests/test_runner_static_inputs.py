"""The runner's persistent-buffer path (CUDA's) gives the CPU path's tokens and logprobs, run on CPU (docs/gpu.md)."""

import json

import pytest

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine, step_capacity
from tpguide.engine.request_io import parse_request_lines
from tpguide.worker.runner import StepRunner
from tpguide.worker.step_inputs import StepCapacity

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"]}
REQUESTS = [
    {"id": "guided", "prompt": "Answer in JSON:", "structured_output": {"json": SCHEMA}, "max_tokens": 20,
     "logprobs": 2},
    {"id": "sampled", "prompt": "Once upon a time there was a", "max_tokens": 12, "temperature": 0.8,
     "top_p": 0.9, "seed": 3, "presence_penalty": 0.5},
    {"id": "prompt-logprobs", "prompt": "The sea is", "max_tokens": 6, "prompt_logprobs": 1},
    {"id": "regex", "prompt": "code:", "structured_output": {"regex": r"[a-c]{2,4}-\d"}, "max_tokens": 10},
]
CONFIG = EngineConfig(max_num_seqs=3, max_num_batched_tokens=48, max_model_len=128)


def _run(model_path, capacity=None):
    engine = build_engine(TPGroup(), model_path, CONFIG)
    if capacity is not None:  # the CUDA path's runner, on CPU
        engine.runner = StepRunner(engine.model, engine.group, capacity=capacity, static_inputs=True)
    requests = parse_request_lines([json.dumps(r) for r in REQUESTS], 64)
    outputs = [o.to_json() for o in engine.generate(requests)]
    engine.shutdown()
    return outputs, engine.runner


@pytest.fixture(scope="module")
def plain(tiny_model_path):
    return _run(tiny_model_path)[0]


@pytest.mark.parametrize("capacity", [step_capacity(CONFIG), StepCapacity(8, 1, 2, CONFIG.block_size)],
                         ids=["engine-limits", "grown"])
def test_static_inputs_give_the_plain_outputs(tiny_model_path, plain, capacity):
    got, runner = _run(tiny_model_path, capacity)
    assert runner.buffers is not None and runner.graphs is None  # CPU: no graphs
    assert runner.fast_path_off_reason == "" and runner.fast_path_check.checked  # checked, and kept
    if capacity.max_tokens < CONFIG.max_num_batched_tokens:
        assert runner.buffers.capacity.max_tokens > capacity.max_tokens  # grew for the prefill steps
    for a, b in zip(got, plain, strict=True):
        assert a["finish_reason"] == b["finish_reason"] != "error", a
        assert a["token_ids"] == b["token_ids"], a["id"]
        assert json.dumps(a.get("logprobs")) == json.dumps(b.get("logprobs")), a["id"]
        assert json.dumps(a.get("prompt_logprobs")) == json.dumps(b.get("prompt_logprobs")), a["id"]

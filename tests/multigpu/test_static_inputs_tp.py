"""On real gloo ranks: the runner's persistent-buffer path (CUDA's) at tp 2 gives the plain tp-1 tokens (docs/gpu.md).

Covers what only tp > 1 runs on that path: the token_mask broadcast into
the bitmask buffers, the word-slice scatter from the driver's staged
slices, and the sampler's exchange over the staged sampling views.
"""

import json

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.dist.spawn import run_on_ranks
from tpguide.engine import EngineConfig, build_engine, generate_on_group, step_capacity
from tpguide.engine.request_io import parse_request_lines
from tpguide.worker.runner import StepRunner

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"]}
REQUESTS = [
    {"id": "schema", "prompt": "Answer in JSON:", "structured_output": {"json": SCHEMA}, "max_tokens": 16,
     "logprobs": 1},
    {"id": "regex", "prompt": "code:", "structured_output": {"regex": r"[a-c]{2,4}-\d"}, "max_tokens": 10},
    {"id": "free-topp", "prompt": "The sky", "max_tokens": 8, "temperature": 0.7, "top_p": 0.8, "seed": 9},
]
CONFIG = EngineConfig(max_num_seqs=3, max_num_batched_tokens=32, max_model_len=128)


def _generate_static(group, model_path):
    engine = build_engine(group, model_path, CONFIG)
    engine.runner = StepRunner(engine.model, group, capacity=step_capacity(CONFIG), static_inputs=True)
    outputs = None
    if group.is_driver:
        requests = parse_request_lines([json.dumps(r) for r in REQUESTS], 64)
        outputs = [o.to_json() for o in engine.generate(requests)]
        engine.shutdown()
    else:
        engine.run_worker()
    return C.broadcast_object(outputs, group)


def test_static_inputs_at_tp2_equal_plain_tp1(tiny_model_path):
    want = generate_on_group(TPGroup(), tiny_model_path, REQUESTS, CONFIG)
    for got in run_on_ranks(_generate_static, 2, tiny_model_path):
        assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
        assert [o["finish_reason"] for o in got] == [o["finish_reason"] for o in want]
        assert json.dumps(got[0]["logprobs"]) == json.dumps(want[0]["logprobs"])

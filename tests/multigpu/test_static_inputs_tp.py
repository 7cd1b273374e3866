"""On real gloo ranks: the runner's persistent-buffer path (CUDA's) at tp 2 gives the plain tp-1 tokens (docs/gpu.md).

Covers what only tp > 1 runs on that path: the token_mask broadcast into
the bitmask buffers, the word-slice scatter from the driver's staged
slices, and the sampler's exchange over the staged sampling views.
"""

import json

import torch

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


def _generate_static(group, model_path, graphs=None):
    """REQUESTS on the persistent-buffer runner (``graphs(model, buffers)``: its stand-in graphs); (outputs, runner)."""
    engine = build_engine(group, model_path, CONFIG)
    runner = engine.runner = StepRunner(engine.model, group, capacity=step_capacity(CONFIG), static_inputs=True)
    if graphs is not None:
        runner.graphs = graphs(engine.model, runner.buffers)
    outputs = None
    if group.is_driver:
        requests = parse_request_lines([json.dumps(r) for r in REQUESTS], 64)
        outputs = [o.to_json() for o in engine.generate(requests)]
        engine.shutdown()
    else:
        engine.run_worker()
    return C.broadcast_object(outputs, group), runner


def _generate_plain_outputs(group, model_path):
    return _generate_static(group, model_path)[0]


def test_static_inputs_at_tp2_equal_plain_tp1(tiny_model_path):
    want = generate_on_group(TPGroup(), tiny_model_path, REQUESTS, CONFIG)
    for got in run_on_ranks(_generate_plain_outputs, 2, tiny_model_path):
        assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
        assert [o["finish_reason"] for o in got] == [o["finish_reason"] for o in want]
        assert json.dumps(got[0]["logprobs"]) == json.dumps(want[0]["logprobs"])


def _generate_one_rank_differs(group, model_path):
    """The fast path at tp 2 with rank 1's first graph replay one ulp off: both ranks must fall back together."""
    from tpguide.worker.cuda_graphs import PaddedEager, forward_logits, graph_buckets

    class OffOnRank1(PaddedEager):
        def run(self, plan, bucket):
            inputs = self.buffers.stage(plan)
            logits = forward_logits(self.model, inputs)
            if group.tp_rank == 1:
                logits[0, 0] = torch.nextafter(logits[0, 0], torch.tensor(float("inf")))
            return inputs, logits

    outputs, runner = _generate_static(
        group, model_path, lambda model, buffers: OffOnRank1(model, buffers, graph_buckets(buffers.capacity.max_tokens)))
    return outputs, runner.fast_path_off_reason, runner.static_inputs


def test_a_difference_on_one_rank_turns_the_fast_path_off_on_every_rank(tiny_model_path):
    want = generate_on_group(TPGroup(), tiny_model_path, REQUESTS, CONFIG)
    for got, reason, static in run_on_ranks(_generate_one_rank_differs, 2, tiny_model_path):
        assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
        assert json.dumps(got[0]["logprobs"]) == json.dumps(want[0]["logprobs"])
        assert reason.startswith("the CUDA graph of bucket") and "(rank 1: " in reason and not static, reason

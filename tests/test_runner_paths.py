"""The runner's plain step and its CUDA fast path share one penalty and one bitmask application (docs/gpu.md).

A step with presence / frequency / repetition penalties, a logit bias, sampled
and greedy rows, a verify window and a guided bitmask with an unguided row
runs on CPU through three runners over one model:

* the plain step (the plan's own tensors);
* the fast path's eager step over the persistent buffers;
* the fast path's graph branch, with a stand-in for the bucket's graph (the
  eager forward over the buffers: CPU has no CUDA graphs).

Each must give the same logits bit for bit after the penalties and after
the bitmask, and the same ``StepResult``.  And the worker package calls
the penalty and the bitmask kernels at one place each (the plain and fast
paths once carried a copy each).  The fast runners' own check
against the plain step is off (``check_steps=0``), so a fast output is
the fast path's.  The penalties and the mask must change the logits, so
that a path which skipped either would differ.
"""

from __future__ import annotations

import ast
import tempfile
from pathlib import Path

import pytest
import torch
from step_plans import step_plan

from tpguide.dist import TPGroup
from tpguide.engine.request import SamplingParams
from tpguide.model.loader import load_model
from tpguide.model.random_checkpoint import tiny_hf_config, write_random_model
from tpguide.sampling.penalties import build_logit_penalties
from tpguide.sampling.sampler import SamplingMetadata
from tpguide.worker.cuda_graphs import PaddedEager, forward_logits, graph_buckets
from tpguide.worker.forward import eager_forward, plain_inputs
from tpguide.worker.protocol import BitmaskSlices, StepPlan
from tpguide.worker.runner import StepRunner
from tpguide.worker.step_inputs import StepCapacity

VOCAB, BLOCK_SIZE = 300, 8
PARAMS = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.3), SamplingParams(repetition_penalty=1.3),
          SamplingParams(), SamplingParams(logit_bias=((5, 2.5), (17, -1.0))), SamplingParams(presence_penalty=-0.4)]


class GraphStandIn(PaddedEager):
    """A "graph" per bucket: the eager forward over the persistent buffers, unpadded, counted."""

    replays = 0

    def run(self, plan, bucket):
        self.replays += 1
        inputs = self.buffers.stage(plan)
        return inputs, forward_logits(self.model, inputs)  # [R, V_local] fp32


def _with_penalties(plan: StepPlan, history) -> StepPlan:
    """``plan`` with the penalties of :data:`PARAMS` (row ``r``: ``PARAMS[r]``) over ``history``'s tokens."""
    rows = [(PARAMS[r % len(PARAMS)], history[:3], history[3:5 + r]) for r in range(plan.selected_token_indices.numel())]
    s = plan.sampling
    sampling = SamplingMetadata(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seeds=s.seeds,
                                sample_positions=s.sample_positions, num_logprobs=s.num_logprobs,
                                penalties=build_logit_penalties(rows))
    return StepPlan(plan.input_ids, plan.block_tables, plan.query_lens, plan.context_lens,
                    plan.selected_token_indices, sampling, guided=plan.guided)


def _bitmask(num_rows: int, bitmask_size: int, seed: int) -> BitmaskSlices:
    """Random words at tp 1 (each row keeps about half its tokens), row 1 unguided."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**31, 2**31 - 1, (num_rows, bitmask_size), generator=g, dtype=torch.int64)
    token_mask = torch.ones(num_rows, dtype=torch.int32)
    token_mask[1] = 0
    return BitmaskSlices(token_mask, [words.to(torch.int32)])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.fixture(scope="module")
def model():
    d = write_random_model(Path(tempfile.mkdtemp()), tiny_hf_config("LlamaForCausalLM", VOCAB), seed=7)
    m = load_model(d, TPGroup())
    m.allocate_kv_cache(16, BLOCK_SIZE, max_model_len=64)
    return m


def test_plain_and_fast_paths_apply_penalties_and_bitmask_alike(model):
    group = TPGroup()
    cap = StepCapacity(max_tokens=24, max_seqs=4, max_blocks_per_seq=4, block_size=BLOCK_SIZE)
    plain = StepRunner(model, group)
    eager = StepRunner(model, group, capacity=cap, static_inputs=True, check_steps=0)
    graph = StepRunner(model, group, capacity=cap, static_inputs=True, check_steps=0)
    graph.graphs = stand_in = GraphStandIn(model, graph.buffers, graph_buckets(cap.max_tokens))
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 4, 11))
    ta, tb, tc = [5, 1], [9], [2, 12]
    steps = [  # a prefill of three sequences, then decodes with a verify window of 3 rows; both penalised
        [(ta, 0, a[:7], 1), (tb, 0, b[:3], 1), (tc, 0, c[:8], 1)],
        [(ta, 7, [a[7]], 1), (tb, 3, [b[3]], 1), (tc, 8, c[8:], 3)],
    ]
    for i, seqs in enumerate(steps):
        plan = _with_penalties(step_plan(seqs, guided=i == 1, step=i), a + b)
        assert plan.sampling.penalties is not None
        bitmask = _bitmask(plan.selected_token_indices.numel(), model.vocab_shard.bitmask_size, i) if plan.guided else None
        got = {}
        for name, runner in (("plain", plain), ("eager", eager), ("graph", graph)):
            forward = runner.execute_model(plan)
            penalised = forward.logits.clone()
            result = runner.sample_tokens(plan, forward, bitmask)
            got[name] = (penalised, forward.logits.clone(), result)
        unpenalised = eager_forward(model, plain_inputs(plan, group.device, BLOCK_SIZE), plan, group).logits
        want_pen, want_masked, want = got["plain"]
        assert not torch.equal(_bits(unpenalised), _bits(want_pen)), "the penalties changed nothing"
        for name in ("eager", "graph"):
            pen, masked, result = got[name]
            assert torch.equal(_bits(pen), _bits(want_pen)), (i, name, "penalised logits")
            assert torch.equal(_bits(masked), _bits(want_masked)), (i, name, "masked logits")
            assert result.token_ids == want.token_ids and result.bad_rows == want.bad_rows, (i, name)
            for field in ("logprobs", "top_logprob_ids", "top_logprobs"):
                assert torch.equal(getattr(result, field), getattr(want, field)), (i, name, field)
        if plan.guided:  # guided rows lost tokens to the mask, the unguided row 1 kept all of its logits
            newly_masked = torch.isinf(want_masked) & ~torch.isinf(want_pen)
            assert newly_masked[bitmask.token_mask.bool()].any(dim=-1).all()
            assert torch.equal(_bits(want_masked[1]), _bits(want_pen[1]))
    assert eager.fast_path is not None and eager.graphs is None and eager.fast_path_off_reason == ""
    assert graph.fast_path is not None and stand_in.replays == len(steps) and graph.fast_path_off_reason == ""


def test_the_worker_applies_penalties_and_the_bitmask_at_one_place_each():
    """One call of ``apply_penalties_inplace`` and of ``apply_token_bitmask_inplace`` in tpguide/worker."""
    calls = {"apply_penalties_inplace": [], "apply_token_bitmask_inplace": []}
    for path in sorted((Path(__file__).resolve().parents[1] / "tpguide" / "worker").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name in calls:
                    calls[name].append(f"{path.name}:{node.lineno}")
    assert {k: len(v) for k, v in calls.items()} == {k: 1 for k in calls}, calls

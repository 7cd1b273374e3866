"""A step padded to its CUDA-graph bucket gives the unpadded step's tokens and logprobs bit for bit (docs/gpu.md).

The runner's CUDA path on a tiny random Llama (bf16): each step runs through
the persistent buffers unpadded (an eager step) and padded to its bucket
(position -1 / slot -1 padding tokens, padded sample rows), with the same
plans, guided rows and sampling.  On CPU the model's CUDA code path is
forced with its Triton kernels interpreted (``TRITON_INTERPRET=1``, in a
child process as in ``tests/triton_interpreted.py``) and the padded step runs
eagerly (:class:`~tpguide.worker.cuda_graphs.PaddedEager`); on a GPU the
padded step replays a captured graph (:class:`~tpguide.worker.cuda_graphs.CudaGraphs`).

Run directly with ``TRITON_INTERPRET=1 python tests/test_cuda_graph_padding.py``.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import pytest
import torch
from step_plans import step_plan
from triton_interpreted import check_in_child, run_cases

pytest.importorskip("triton")

VOCAB, BLOCK_SIZE = 300, 8


def _bitmask(num_rows, bitmask_size, seed):
    """The driver's BitmaskSlices at tp 1: random words (every row has allowed tokens), row 1 unguided."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**31, 2**31 - 1, (num_rows, bitmask_size), generator=g, dtype=torch.int64)
    token_mask = torch.ones(num_rows, dtype=torch.int32)
    token_mask[1:2] = 0
    from tpguide.worker.protocol import BitmaskSlices

    return BitmaskSlices(token_mask, [words.to(torch.int32)])


def case_padded_equals_unpadded(device):
    from tpguide.dist import TPGroup
    from tpguide.kernels.triton_path import forced_triton_path
    from tpguide.model.loader import load_model
    from tpguide.model.random_checkpoint import tiny_hf_config, write_random_model
    from tpguide.worker.cuda_graphs import PaddedEager, graph_buckets
    from tpguide.worker.runner import StepRunner
    from tpguide.worker.step_inputs import StepCapacity

    d = write_random_model(Path(tempfile.mkdtemp()), tiny_hf_config("LlamaForCausalLM", VOCAB), seed=5)
    g = torch.Generator().manual_seed(2)
    a, b, c = (torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 12))
    group = TPGroup(device=torch.device(device))
    model = load_model(d, group, dtype=torch.bfloat16)
    model.allocate_kv_cache(16, BLOCK_SIZE, max_model_len=64)
    cap = StepCapacity(max_tokens=24, max_seqs=4, max_blocks_per_seq=4, block_size=BLOCK_SIZE)
    eager = StepRunner(model, group, capacity=cap, static_inputs=True)
    padded = StepRunner(model, group, capacity=cap, static_inputs=True, cuda_graphs=device == "cuda")
    if device != "cuda":
        padded.graphs = PaddedEager(model, padded.buffers, graph_buckets(cap.max_tokens))
    ta, tb, tc = [5, 1], [9], [2, 12]
    steps = [  # prefill (7 + 3 + 5 tokens: bucket 16), then decodes and a verify window of 3 rows
        [(ta, 0, a, 1), (tb, 0, b, 1), (tc, 0, c[:5], 1)],
        [(ta, 7, [a[0]], 1), (tb, 3, [b[1]], 1), (tc, 5, c[5:8], 3)],  # 5 tokens: bucket 8
        [(tc, 8, c[8:], 1), (tb, 4, [b[2]], 1)],  # 5 tokens again, one more request fewer
        [(ta, 8, [a[1]], 1)],  # 1 token: bucket 1, nothing padded
    ]
    forced = forced_triton_path() if device == "cpu" else contextlib.nullcontext()
    with forced:
        for i, seqs in enumerate(steps):
            plan = step_plan(seqs, guided=i % 2 == 1, step=i)
            source = _bitmask(plan.selected_token_indices.numel(), model.vocab_shard.bitmask_size, i)
            want = eager.execute(plan, source if plan.guided else None)
            got = padded.execute(plan, source if plan.guided else None)  # rewrites the same KV bits
            assert padded.graphs.bucket_for(plan.input_ids.numel()) is not None
            assert got.token_ids == want.token_ids and not any(want.bad_rows), (i, got.token_ids, want.token_ids)
            for name in ("logprobs", "top_logprob_ids", "top_logprobs"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (i, name)
    # each runner's first steps were checked against the plain step, and none differed (fast_path_check.py)
    assert eager.fast_path_off_reason == padded.fast_path_off_reason == "", padded.fast_path_off_reason
    assert dict(padded.fast_path_check.checked) == {("graph", 16): 1, ("graph", 8): 2, ("graph", 1): 1}
    if device == "cuda":
        assert sorted(padded.graphs.graphs) == [1, 8, 16], sorted(padded.graphs.graphs)


CASES = {"padded-equals-unpadded": case_padded_equals_unpadded}


def test_padded_step_interpreted_on_cpu():
    pytest.importorskip("tpguide.kernels.triton_path")
    check_in_child(__file__, list(CASES), timeout_s=900)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replay_on_cuda():
    case_padded_equals_unpadded("cuda")


if __name__ == "__main__":
    run_cases(CASES)

"""The sampler's per-row Triton reductions (the CUDA path) against torch, and the sampler on that path row by row.

On CPU the kernels run under ``TRITON_INTERPRET=1`` in a child process
(``tests/triton_interpreted.py``); with a GPU the cases also run compiled.
Checks: ``logsumexp_rows`` / ``cumsum_rows`` against torch; bit for bit, a
row alone equals the row among others, and trailing ``-inf`` / ``0`` columns
(a longer candidate list) leave the bits unchanged; the whole sampler on the
CUDA code path (top-k, top-p, both, greedy, with logprobs, tp 1 and 2) gives
a row alone the token and logprob it gets in a batch, and the CPU path's tokens.

Run directly with ``TRITON_INTERPRET=1 python tests/test_kernels_row_reductions.py [NAME...]``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from sharding import shard_logits
from triton_interpreted import check_in_child, run_cases

pytest.importorskip("triton")


def _rows(rows, k, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g, dtype=torch.float64) * 4).to(dtype)
    x[torch.rand(rows, k, generator=g) < 0.2] = float("-inf")
    x[1] = float("-inf")  # an all -inf row
    return x.to(device)


def _reductions(dtype, k):
    def case(device):
        from tpguide.kernels.row_reductions_triton import cumsum_rows, logsumexp_rows
        x = _rows(7, k, dtype, device, seed=k)
        lse = logsumexp_rows(x)
        torch.testing.assert_close(lse.cpu(), torch.logsumexp(x.cpu(), dim=-1), rtol=1e-12 if dtype == torch.float64
                                   else 1e-6, atol=0)
        probs = torch.where(x > float("-inf"), torch.exp(x - 5.0), 0.0)
        cum = cumsum_rows(probs)
        torch.testing.assert_close(cum.cpu(), probs.cpu().cumsum(dim=-1), rtol=1e-12 if dtype == torch.float64
                                   else 1e-5, atol=1e-12)
        for rows in ([3], [0, 6], [5, 2, 4]):  # alone or among others: the same bits
            assert torch.equal(logsumexp_rows(x[rows]), lse[rows])
            assert torch.equal(cumsum_rows(probs[rows]), cum[rows])
        longer = torch.cat([x, torch.full_like(x[:, :150], float("-inf"))], dim=1)  # a longer candidate list
        assert torch.equal(logsumexp_rows(longer), lse)
        assert torch.equal(cumsum_rows(torch.cat([probs, torch.zeros_like(probs[:, :150])], dim=1))[:, :k], cum)
        assert torch.equal(logsumexp_rows(x[:, ::2]), logsumexp_rows(x[:, ::2].contiguous()))  # strided rows
    return case


def _meta(row_ids, params, num_logprobs=0):
    """Sampling metadata of the rows ``row_ids`` of ``params``; a row's seed and position follow the row, not its place."""
    from tpguide.sampling.sampler import SamplingMetadata
    ids = torch.tensor(row_ids, dtype=torch.int64)
    return SamplingMetadata(temperature=torch.tensor([params["temperature"][r] for r in row_ids]),
                            top_k=torch.tensor([params["top_k"][r] for r in row_ids], dtype=torch.int32),
                            top_p=torch.tensor([params["top_p"][r] for r in row_ids]),
                            seeds=ids * 7919 + 3, sample_positions=ids + 11, num_logprobs=num_logprobs)


def _sampler_alone_vs_batched(device):
    from tpguide.kernels.triton_path import forced_triton_path
    from tpguide.sampling.sampler import sample_by_hand
    vocab, rows = 700, 6
    g = torch.Generator().manual_seed(2)
    full = torch.randn(rows, vocab, generator=g) * 2
    full[torch.rand(rows, vocab, generator=g) < 0.3] = float("-inf")
    full[:, 0] = 0.0
    params = dict(temperature=[0.8, 1.0, 0.0, 1.3, 0.7, 1.0], top_k=[0, 20, 0, 300, 0, 5],
                  top_p=[0.9, 0.8, 1.0, 0.95, 1.0, 1.0])
    def run(row_ids, tp):
        meta = _meta(row_ids, params, num_logprobs=3)
        shards, vocab_shards = shard_logits(full[row_ids], tp)
        return sample_by_hand([s.to(device) for s in shards], meta.to(device), vocab_shards)

    for tp in (1, 2):
        with forced_triton_path() if device == "cpu" else contextlib.nullcontext():
            batched = run(list(range(rows)), tp)
            for r in range(rows):
                alone = run([r], tp)
                assert torch.equal(alone.token_ids[0], batched.token_ids[r]), (tp, r)
                assert torch.equal(alone.logprobs[0], batched.logprobs[r]), (tp, r)
                assert torch.equal(alone.top_logprobs[0], batched.top_logprobs[r]), (tp, r)
        cpu_path = run(list(range(rows)), tp)  # torch's reductions: the same tokens
        assert torch.equal(cpu_path.token_ids.cpu(), batched.token_ids.cpu())
        assert torch.equal(cpu_path.logprobs.cpu(), batched.logprobs.cpu())


def _errors(device):
    from tpguide.kernels.row_reductions_triton import cumsum_rows, logsumexp_rows
    with pytest.raises(ValueError, match="float32/float64"):
        logsumexp_rows(torch.zeros(2, 3, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rows, K"):
        cumsum_rows(torch.zeros(3, device=device))
    assert logsumexp_rows(torch.zeros(0, 4, device=device)).shape == (0,)


CASES = {
    "reductions-f64-one-chunk": _reductions(torch.float64, 50),
    "reductions-f64-three-chunks": _reductions(torch.float64, 300),
    "reductions-f32": _reductions(torch.float32, 129),
    "sampler-alone-vs-batched": _sampler_alone_vs_batched,
    "errors": _errors,
}


def test_row_reductions_interpreted_on_cpu():
    check_in_child(__file__, list(CASES))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_row_reductions_cuda(name):
    CASES[name]("cuda")


if __name__ == "__main__":
    run_cases(CASES)

"""The plain-torch oracle against a per-token Python loop, and the dispatcher's checks."""

from __future__ import annotations

import os

import pytest
import torch
from test_kernels_cases import check_d2t_shards, check_shards, make_bitmask, make_d2t

from tpguide.kernels import BACKENDS, apply_token_bitmask_inplace


def loop_oracle(logits, bitmask, token_mask=None, d2t=None, draft_vocab_start_index=0):
    """The contract written as a loop over tokens (tiny sizes only)."""
    out = logits.clone()
    num_bits = 32 * bitmask.shape[1]
    for r in range(logits.shape[0]):
        if token_mask is not None and int(token_mask[r]) == 0:
            continue
        for j in range(logits.shape[1]):
            pos = j if d2t is None else draft_vocab_start_index + j + int(d2t[j])
            allowed = 0 <= pos < num_bits and (int(bitmask[r, pos // 32]) >> (pos % 32)) & 1
            if not allowed:
                out[r, j] = float("-inf")
    return out


@pytest.mark.parametrize("width,num_words", [(70, 3), (64, 2), (70, 2), (33, 4), (1, 1), (40, 0)])
@pytest.mark.parametrize("use_token_mask", [False, True])
def test_reference_matches_loop(width, num_words, use_token_mask):
    bitmask = make_bitmask(4, num_words, seed=width)
    logits = torch.randn(4, width)
    token_mask = torch.tensor([1, 0, 1, 1], dtype=torch.int32) if use_token_mask else None
    expected = loop_oracle(logits, bitmask, token_mask)
    apply_token_bitmask_inplace(logits, bitmask, token_mask=token_mask, backend="reference")
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("draft_vocab_start_index", [0, 48])
def test_reference_d2t_matches_loop(draft_vocab_start_index):
    d2t_full = make_d2t(96, 32 * 5 + 7)
    d2t = d2t_full[draft_vocab_start_index:draft_vocab_start_index + 48].contiguous()
    bitmask = make_bitmask(3, 6, seed=9)
    logits = torch.randn(3, 48)
    expected = loop_oracle(logits, bitmask, d2t=d2t, draft_vocab_start_index=draft_vocab_start_index)
    apply_token_bitmask_inplace(logits, bitmask, d2t=d2t, draft_vocab_start_index=draft_vocab_start_index,
                                backend="reference")
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("tp_size", [2, 3, 4])
def test_reference_shards_compose(tp_size):
    check_shards("reference", 49157, tp_size, torch.float32, "cpu")


def test_reference_d2t_shards_compose():
    check_d2t_shards("reference", 600, 3, torch.float32, "cpu")


def test_shard_local_draft_ids_would_be_wrong():
    """Rank > 0 of a draft shard: indexing with shard-local ids (the pitfall of docs/architecture.md §3)
    gives a different mask than the global id; rank 0 cannot tell them apart."""
    d2t_full = make_d2t(600, 32 * 70 + 13)
    bitmask = make_bitmask(2, 71, seed=3)
    logits = torch.randn(2, 300)
    for tp_rank, start in ((0, 0), (1, 300)):
        d2t = d2t_full[start:start + 300].contiguous()
        right, naive = logits.clone(), logits.clone()
        apply_token_bitmask_inplace(right, bitmask, d2t=d2t, draft_vocab_start_index=start)
        apply_token_bitmask_inplace(naive, bitmask, d2t=d2t, draft_vocab_start_index=0)
        assert torch.equal(right, loop_oracle(logits, bitmask, d2t=d2t, draft_vocab_start_index=start))
        assert torch.equal(right, naive) == (tp_rank == 0)


def test_columns_past_the_words_are_disallowed_and_padding_bits_ignored():
    bitmask = torch.full((1, 2), -1, dtype=torch.int32)  # 64 allowed bits, padding included
    logits = torch.zeros(1, 70)
    apply_token_bitmask_inplace(logits, bitmask)
    assert torch.isinf(logits[0, 64:]).all() and (logits[0, :64] == 0).all()
    narrow = torch.zeros(1, 40)  # bits 40..63 are padding: set, never read
    apply_token_bitmask_inplace(narrow, bitmask)
    assert (narrow == 0).all()


@pytest.mark.parametrize("backend", ["auto", "cpu", "torch", "reference"])  # triton: CUDA tensors only
@pytest.mark.parametrize("empty", ["rows", "columns"])
def test_empty_inputs_are_no_ops(backend, empty):
    """An empty view (no rows, or no columns) of a real logits tensor: nothing around it is written."""
    base = torch.arange(40, dtype=torch.float32).reshape(4, 10)
    before = base.clone()
    logits, rows = (base[2:2], 0) if empty == "rows" else (base[:, 3:3], 4)
    bitmask = torch.zeros(rows, 1, dtype=torch.int32)  # every token disallowed
    assert apply_token_bitmask_inplace(logits, bitmask, backend=backend) is None
    assert logits.numel() == 0
    assert torch.equal(base, before)
    assert torch.equal(bitmask, torch.zeros(rows, 1, dtype=torch.int32))


def _args(**overrides):
    args = dict(logits=torch.zeros(3, 64), bitmask=torch.zeros(3, 2, dtype=torch.int32))
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides,error,match", [
    (dict(logits=torch.zeros(3, 64, dtype=torch.float64)), TypeError, "torch.float64"),
    (dict(logits=torch.zeros(3, 64).numpy()), TypeError, "ndarray"),
    (dict(logits=torch.zeros(64)), ValueError, r"logits must be 2-D, got shape \(64,\)"),
    (dict(bitmask=torch.zeros(3, 2, dtype=torch.int64)), TypeError, "torch.int64"),
    (dict(bitmask=torch.zeros(4, 2, dtype=torch.int32)), ValueError, "bitmask has 4 rows but logits has 3"),
    (dict(vocab_start_index=48), ValueError, "vocab_start_index=48 is not a multiple of 32"),
    (dict(vocab_start_index=-32), ValueError, "non-negative int, got -32"),
    (dict(token_mask=torch.ones(3, dtype=torch.bool)), TypeError, "token_mask.dtype"),
    (dict(token_mask=torch.ones(2, dtype=torch.int32)), ValueError, "token_mask has 2 entries but logits has 3"),
    (dict(d2t=torch.zeros(63, dtype=torch.int32)), ValueError, "d2t has 63 entries but logits has width 64"),
    (dict(d2t=torch.zeros(64, dtype=torch.int64)), TypeError, "d2t.dtype"),
    (dict(d2t=torch.zeros(64, dtype=torch.int32), vocab_start_index=32), ValueError, "must be 0 with d2t"),
    (dict(draft_vocab_start_index=64), ValueError, "draft_vocab_start_index=64 needs d2t"),
    (dict(backend="cuda"), ValueError, r"backend must be one of .*'cuda'"),
])
def test_bad_arguments_raise_naming_the_values(overrides, error, match):
    args = _args(**overrides)
    with pytest.raises(error, match=match):
        apply_token_bitmask_inplace(args.pop("logits"), args.pop("bitmask"), **args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mismatch_raises():
    with pytest.raises(ValueError, match="bitmask is on cpu but logits is on cuda"):
        apply_token_bitmask_inplace(torch.zeros(1, 32, device="cuda"), torch.zeros(1, 1, dtype=torch.int32))


def test_backends_listed():
    assert BACKENDS == ("auto", "cpu", "torch", "triton", "reference")


def test_triton_backend_refuses_cpu_tensors_without_interpreter():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the Triton interpreter is active in this process")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        apply_token_bitmask_inplace(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int32), backend="triton")

"""The vectorised torch backend against the reference, bit for bit (CPU, and CUDA if present)."""

from __future__ import annotations

import pytest
import torch
from test_kernels_cases import (
    DTYPES,
    ODD_VOCABS,
    check_against_reference,
    check_d2t_shards,
    check_shards,
    devices,
)

import tpguide.kernels.apply_token_bitmask_torch as torch_backend


@pytest.fixture(params=["auto", "dense", "sparse"])
def strategy(request, monkeypatch):
    """Run under the automatic choice, or force one strategy via the sparse threshold."""
    if request.param == "dense":
        monkeypatch.setattr(torch_backend, "SPARSE_MAX_FRACTION", -1.0)
    elif request.param == "sparse":
        monkeypatch.setattr(torch_backend, "SPARSE_MAX_FRACTION", 2.0)
    return request.param


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", ODD_VOCABS)
@pytest.mark.parametrize("strided", [False, True])
def test_odd_vocab_matches_reference(strategy, device, dtype, vocab, strided):
    check_against_reference("torch", num_rows=5, width=vocab, num_words=-(-vocab // 32), dtype=dtype,
                            device=device, strided=strided, pad_ones_from=vocab)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("width,num_words", [(100, 3), (100, 5), (64, 2), (31, 1), (1000, 0)])
def test_width_and_word_count_mismatch(strategy, device, width, num_words):
    check_against_reference("torch", num_rows=4, width=width, num_words=num_words, dtype=torch.float32,
                            device=device, strided=True)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_token_mask_leaves_rows_untouched(strategy, device, dtype):
    check_against_reference("torch", num_rows=7, width=32011, num_words=1001, dtype=dtype, device=device,
                            strided=True, token_mask=True)


@pytest.mark.parametrize("device", devices())
def test_many_rows_cross_chunks(strategy, device):
    """More rows than one dense or sparse chunk holds."""
    rows = torch_backend.CHUNK_ELEMENTS // 5 + 3
    check_against_reference("torch", num_rows=rows, width=160, num_words=5, dtype=torch.bfloat16,
                            device=device, strided=False)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("org_vocab_size", [32001, 49157])
@pytest.mark.parametrize("tp_size", [2, 3, 4])
def test_tp_shards_compose(strategy, device, org_vocab_size, tp_size):
    check_shards("torch", org_vocab_size, tp_size, torch.float16, device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp_size", [1, 2, 3])
def test_d2t_shards_compose(device, dtype, tp_size):
    check_d2t_shards("torch", 600, tp_size, dtype, device, token_mask=tp_size == 2)


@pytest.mark.parametrize("device", devices())
def test_nan_logits_become_ninf_when_disallowed(strategy, device):
    logits = torch.full((2, 64), float("nan"), device=device)
    bitmask = torch.tensor([[0x0000FFFF, -1], [0, 0]], dtype=torch.int32, device=device)
    torch_backend.apply_token_bitmask_inplace_torch(logits, bitmask)
    assert torch.isneginf(logits[0, 16:32]).all() and torch.isnan(logits[0, :16]).all()
    assert torch.isnan(logits[0, 32:]).all() and torch.isneginf(logits[1]).all()

"""Shared builders for the ``tests/test_kernels_*`` modules (no tests of its own).

Each case builds logits inside a larger "guard" tensor (so column slices and
row strides are real, and a write outside the view is caught), a bitmask whose
rows cover every word kind (all ones, all zeros, mixed) and compares a
backend, bit for bit, with the plain-torch reference.
"""

from __future__ import annotations

import torch

from tpguide.kernels import apply_token_bitmask_inplace
from tpguide.model.vocab_shard import VocabShard, get_bitmask_size

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ODD_VOCABS = (32001, 32011, 49157)
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def devices() -> list[str]:
    """``["cpu"]``, plus ``"cuda"`` when a GPU is visible."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_bitmask(num_rows: int, num_words: int, seed: int = 0, pad_ones_from: int | None = None,
                 device: str = "cpu", strided: bool = False) -> torch.Tensor:
    """``[num_rows, num_words]`` int32: row 0 all ones, row 1 all zeros, other rows
    mix all-ones, all-zeros and random words.  Bits from position
    ``pad_ones_from`` on are set (padding bits that must never count).  With
    ``strided`` the result is a view with row stride ``num_words + 3``."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31 - 1, (num_rows, num_words), dtype=torch.int32, generator=g)
    kind = torch.randint(0, 3, (num_rows, num_words), generator=g)
    words = torch.where(kind == 0, -1, torch.where(kind == 1, 0, words)).int()
    if num_rows > 0:
        words[0] = -1
    if num_rows > 1:
        words[1] = 0
    if pad_ones_from is not None and pad_ones_from < 32 * num_words:
        first_word, first_bit = divmod(pad_ones_from, 32)
        high = (~((1 << first_bit) - 1)) & 0xFFFFFFFF
        words[:, first_word] |= high - (1 << 32) if high >= 1 << 31 else high
        words[:, first_word + 1:] = -1
    if strided:
        wide = torch.full((num_rows, num_words + 3), 0x5A5A5A5A, dtype=torch.int32)
        wide[:, 1:num_words + 1] = words
        return wide.to(device)[:, 1:num_words + 1]
    return words.to(device)


def make_logits(num_rows: int, width: int, dtype: torch.dtype, seed: int = 1, device: str = "cpu",
                strided: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(guard, logits)``: ``logits`` is ``[num_rows, width]``; with ``strided`` it is the
    column slice ``guard[1:-1, 5:5+width]`` of a larger tensor, else ``guard`` itself."""
    g = torch.Generator().manual_seed(seed)
    if not strided:
        guard = torch.randn(num_rows, width, generator=g).to(device, dtype)
        return guard, guard
    guard = torch.randn(num_rows + 2, width + 11, generator=g).to(device, dtype)
    return guard, guard[1:num_rows + 1, 5:5 + width]


def bits_of(x: torch.Tensor) -> torch.Tensor:
    """Integer view of a float tensor, for bit-exact comparison (-inf, NaN included)."""
    return x.view(_INT_VIEW[x.dtype])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if not torch.equal(bits_of(actual).cpu(), bits_of(expected).cpu()):
        diff = (bits_of(actual).cpu() != bits_of(expected).cpu()).nonzero()[:5].tolist()
        raise AssertionError(f"{len((bits_of(actual).cpu() != bits_of(expected).cpu()).nonzero())} "
                             f"elements differ, first at {diff}")


def check_against_reference(backend: str, *, num_rows: int, width: int, num_words: int, dtype: torch.dtype,
                            device: str, strided: bool = False, token_mask: bool = False,
                            pad_ones_from: int | None = None, seed: int = 0, **kwargs) -> None:
    """Apply ``backend`` and the reference to the same inputs; the guard tensors must match bit for bit."""
    bitmask = make_bitmask(num_rows, num_words, seed, pad_ones_from, device, strided)
    mask = None
    if token_mask:
        mask = (torch.arange(num_rows) % 3 != 1).int().to(device)
    guard, logits = make_logits(num_rows, width, dtype, seed + 1, device, strided)
    expected_guard = guard.clone()
    expected = expected_guard[1:num_rows + 1, 5:5 + width] if strided else expected_guard
    apply_token_bitmask_inplace(expected, bitmask, token_mask=mask, backend="reference", **kwargs)
    apply_token_bitmask_inplace(logits, bitmask, token_mask=mask, backend=backend, **kwargs)
    assert_bits_equal(guard, expected_guard)


def check_shards(backend: str, org_vocab_size: int, tp_size: int, dtype: torch.dtype, device: str,
                 num_rows: int = 3) -> None:
    """Applying each rank's word slice to its logits column slice == full apply, then slice."""
    full = VocabShard.create(org_vocab_size, 0, tp_size)
    width = full.padded_vocab_size
    bitmask = make_bitmask(num_rows, get_bitmask_size(width), seed=tp_size, pad_ones_from=org_vocab_size,
                           device=device)
    _, logits = make_logits(num_rows, width, dtype, seed=tp_size, device=device)
    expected = logits.clone()
    apply_token_bitmask_inplace(expected, bitmask, backend="reference")
    sharded = logits.clone()
    for tp_rank in range(tp_size):
        shard = VocabShard.create(org_vocab_size, tp_rank, tp_size)
        apply_token_bitmask_inplace(
            sharded[:, shard.vocab_start_index:shard.vocab_end_index],  # strided column slice
            bitmask[:, shard.word_start:shard.word_end],  # strided word slice
            vocab_start_index=shard.vocab_start_index,
            backend=backend,
        )
    assert_bits_equal(sharded, expected)


def make_d2t(draft_vocab_size: int, target_vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Full ``[draft_vocab_size]`` int32 offsets mapping draft ids onto sorted target ids
    spread over the whole target vocabulary (the last ones beyond it: out of range)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randperm(target_vocab_size, generator=g)[:draft_vocab_size].sort().values
    target[-2:] = torch.tensor([target_vocab_size + 5, target_vocab_size + 40])  # past the bitmask
    return (target - torch.arange(draft_vocab_size)).int()


def check_d2t_shards(backend: str, draft_vocab_size: int, tp_size: int, dtype: torch.dtype, device: str,
                     num_rows: int = 3, token_mask: bool = False) -> None:
    """Draft shards of every rank with the full bitmask row == unsharded draft apply, sliced."""
    target_vocab_size = 32 * 70 + 13
    d2t = make_d2t(draft_vocab_size, target_vocab_size).to(device)
    bitmask = make_bitmask(num_rows, get_bitmask_size(target_vocab_size), seed=3, device=device)
    mask = (torch.arange(num_rows) % 2 == 0).int().to(device) if token_mask else None
    _, logits = make_logits(num_rows, draft_vocab_size, dtype, seed=4, device=device)
    expected = logits.clone()
    apply_token_bitmask_inplace(expected, bitmask, d2t=d2t, token_mask=mask, backend="reference")
    sharded = logits.clone()
    per_rank = draft_vocab_size // tp_size
    for tp_rank in range(tp_size):
        start, end = tp_rank * per_rank, (tp_rank + 1) * per_rank
        apply_token_bitmask_inplace(sharded[:, start:end], bitmask, d2t=d2t[start:end].contiguous(),
                                    draft_vocab_start_index=start, token_mask=mask, backend=backend)
    assert_bits_equal(sharded, expected)

"""Bitmask helpers against a bool-mask oracle, with odd vocab sizes."""

import pytest
import torch

from tpguide.guided.bitmask import (
    allocate_token_bitmask,
    find_dead_end_rows,
    row_is_dead_end,
    split_bitmask,
    token_ids_to_bitmask_row,
    unpack_bitmask,
)
from tpguide.model.vocab_shard import VocabShard, get_bitmask_size


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [rows, vocab] -> int32 [rows, ceil(vocab/32)] (oracle packing)."""
    rows, vocab = allowed.shape
    words = get_bitmask_size(vocab)
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    packed = (padded.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def test_allocate_all_allowed():
    bitmask = allocate_token_bitmask(3, 32011)
    assert bitmask.shape == (3, 1001) and bitmask.dtype == torch.int32
    assert (bitmask == -1).all()
    assert allocate_token_bitmask(0, 64).shape == (0, 2)


@pytest.mark.parametrize("vocab_size", [32001, 32011, 49157, 64])
def test_pack_unpack_roundtrip(vocab_size):
    allowed = torch.rand(4, vocab_size, generator=torch.Generator().manual_seed(0)) < 0.3
    assert torch.equal(unpack_bitmask(pack(allowed), vocab_size), allowed)


def test_token_ids_to_bitmask_row():
    row = token_ids_to_bitmask_row([0, 31, 32, 49156], 49157)
    allowed = unpack_bitmask(row, 49157)
    assert allowed.nonzero().flatten().tolist() == [0, 31, 32, 49156]
    with pytest.raises(ValueError, match="49157"):
        token_ids_to_bitmask_row([49157], 49157)


def test_dead_end_on_full_rows():
    shard = VocabShard.create(49157, 0, 2)  # padded 49280
    padded = shard.padded_vocab_size
    vocab = get_bitmask_size(padded) * 32
    allowed = torch.zeros(4, vocab, dtype=torch.bool)
    # row 0: allowed only on the last rank's slice -> alive (rank 0's slice is empty)
    allowed[0, padded - 1] = True
    # row 1: nothing allowed -> dead
    # row 2: token 0 -> alive
    allowed[2, 0] = True
    # row 3: nothing allowed, unguided -> not dead
    bitmask = pack(allowed)
    assert (split_bitmask(bitmask, 2)[0][0] == 0).all()
    token_mask = torch.tensor([1, 1, 1, 0], dtype=torch.int32)
    assert find_dead_end_rows(bitmask, padded, token_mask).tolist() == [False, True, False, False]
    assert find_dead_end_rows(bitmask, padded).tolist() == [False, True, False, True]


def test_bits_beyond_padded_vocab_do_not_count():
    padded = 49157  # 32 * 1536 + 5: the last word holds 5 real tokens
    bitmask = torch.zeros(2, get_bitmask_size(padded), dtype=torch.int32)
    bitmask[0, -1] = -(1 << 31) | (1 << 5)  # tokens 49183 and 49157, both >= padded
    bitmask[1, -1] = 1 << 4  # token 49156 = padded - 1
    assert find_dead_end_rows(bitmask, padded).tolist() == [True, False]
    # Stricter check with org_vocab_size: a row allowing only padded ids is dead.
    assert find_dead_end_rows(bitmask, 49156).tolist() == [True, True]


@pytest.mark.parametrize("padded", [49157, 49156, 49152, 32011, 64])
def test_row_is_dead_end_matches_the_rows_check(padded):
    """The fill's one-row check (numpy view) against find_dead_end_rows and the bool oracle."""
    words = get_bitmask_size(padded)
    bitmask = torch.zeros(7, words, dtype=torch.int32)
    bitmask[1, 0] = 1  # token 0
    bitmask[2, -1] = -(1 << 31)  # only the last word's top bit
    bitmask[3, -1] = 1 << 4  # token 32 * (words - 1) + 4
    bitmask[4, words // 2] = -1
    bitmask[5] = -1
    last = 1 << ((padded - 1) % 32)
    bitmask[6, -1] = last - (1 << 32) if last >= 1 << 31 else last  # token padded - 1
    oracle = [not unpack_bitmask(bitmask[r], words * 32)[:padded].any() for r in range(7)]
    rows = find_dead_end_rows(bitmask, padded).tolist()
    assert rows == oracle and oracle[0] and not oracle[1]
    assert [row_is_dead_end(bitmask.numpy(), r, padded) for r in range(7)] == oracle


def test_dead_end_input_errors():
    with pytest.raises(ValueError, match="int32"):
        find_dead_end_rows(torch.zeros(2, 4, dtype=torch.int64), 128)
    with pytest.raises(ValueError, match="needs 5"):
        find_dead_end_rows(torch.zeros(2, 4, dtype=torch.int32), 129)
    with pytest.raises(ValueError, match=r"\(2,\)"):
        find_dead_end_rows(torch.zeros(2, 4, dtype=torch.int32), 128, torch.ones(3, dtype=torch.int32))


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4])
def test_split_reassembles_and_lines_up_with_shards(tp_size):
    shards = [VocabShard.create(49157, r, tp_size) for r in range(tp_size)]
    padded = shards[0].padded_vocab_size
    allowed = torch.rand(5, padded, generator=torch.Generator().manual_seed(tp_size)) < 0.5
    bitmask = pack(allowed)
    slices = split_bitmask(bitmask, tp_size)
    assert all(s.is_contiguous() and s.shape == (5, bitmask.shape[1] // tp_size) for s in slices)
    assert torch.equal(torch.cat(slices, dim=1), bitmask)
    for shard, piece in zip(shards, slices):
        local = unpack_bitmask(piece, shard.num_embeddings_per_partition)
        assert torch.equal(local, allowed[:, shard.vocab_start_index : shard.vocab_end_index])


def test_split_guard():
    with pytest.raises(ValueError, match="bitmask_size=5 is not divisible by tp_size=2"):
        split_bitmask(torch.zeros(1, 5, dtype=torch.int32), 2)

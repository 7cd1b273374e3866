"""The paged KV cache: a mixed batch over shuffled blocks gives the dense per-slot cache's logits bit for bit."""

import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.model.attention import AttentionMetadata
from tpguide.model.loader import load_model
from tpguide.model.random_checkpoint import write_random_checkpoint

VOCAB = 512
BLOCK = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("paged"), vocab_size=VOCAB, seed=3)


def _run(model, steps, tables=None):
    """Run ``steps`` (lists of (seq, context_len, ids)); dense slots = seq, paged: ``tables[seq]``."""
    out = []
    for seqs in steps:
        q, c = [len(t) for _, _, t in seqs], [ctx for _, ctx, _ in seqs]
        if tables is None:
            meta = AttentionMetadata.from_lists([s for s, _, _ in seqs], q, c)
        else:
            meta = AttentionMetadata.from_block_tables([tables[s] for s, _, _ in seqs], q, c, block_size=BLOCK)
        ids = torch.tensor([t for _, _, toks in seqs for t in toks])
        out.append(model.compute_logits(model(ids, meta.token_positions, meta)))
    return out


@pytest.mark.parametrize("tp_invariant", [True, False], ids=["fixed-order", "sdpa"])
def test_paged_equals_dense(ckpt, tp_invariant):
    model = load_model(ckpt, TPGroup(), tp_invariant=tp_invariant)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, VOCAB, (11,), generator=g).tolist(), torch.randint(0, VOCAB, (6,), generator=g).tolist()
    steps = [[(0, 0, a[:7]), (1, 0, b)],  # a chunked, b whole
             [(1, 6, [5]), (0, 7, a[7:])],  # b decodes, a's second chunk crosses blocks
             [(0, 11, [9]), (1, 7, [3])]]
    model.allocate_kv_cache(2, 32)
    dense = _run(model, steps)
    model.allocate_kv_cache(9, BLOCK, 32)
    tables = {0: [7, 2, 5], 1: [0, 8]}  # shuffled, not contiguous; block 1, 3, 4, 6 unused
    paged = _run(model, steps, tables)
    for d, p in zip(dense, paged):
        assert torch.equal(d, p)


def test_block_table_too_short_is_refused():
    with pytest.raises(ValueError, match="cannot hold 9 positions"):
        AttentionMetadata.from_block_tables([[0, 1]], [9], [0], block_size=4)
    with pytest.raises(ValueError, match="non-empty block table"):
        AttentionMetadata.from_block_tables([[]], [1], [0])

"""A tp-2 gloo job with each weight held once (packed only) and a prefill's unit partials gathered in chunks.

Each rank's logits shard equals its slice of the tp-1 logits of the model that
keeps the checkpoint layout and gathers in one piece, bit for bit; each rank
holds its shard's weight bytes once.
"""

import torch

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_on_ranks
from tpguide.model.attention import AttentionMetadata
from tpguide.model.loader import load_model

IDS = [1, 200, 49151, 31, 32, 7, 900, 12, 5000, 33, 64, 2, 40000, 9, 8, 3, 77]
#: Small enough that a 17-row prefill's o_proj and down_proj partials go in chunks of a few rows.
CHUNK_BYTES = 20_000


def _prefill_logits(group: TPGroup, model_dir: str, held_once: bool):
    """Logits shard of two prompts (10 + 7 tokens) and, with ``held_once``, the weight bytes before / after start-up."""
    from tpguide.model import parallel_linear
    from tpguide.model.held_weights import resident_weight_bytes
    from tpguide.model.invariant_reduce import prepack_weights

    model = load_model(model_dir, group, torch.bfloat16)
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    chunks = None
    if held_once:
        prepack_weights(model)
        parallel_linear.PARTIALS_CHUNK_BYTES = CHUNK_BYTES
        chunks = model.model.layers[0].self_attn.o_proj.partials_chunk_rows(len(IDS))
    model.allocate_kv_cache(2, 16)
    meta = AttentionMetadata.from_lists([0, 1], [10, 7], [0, 0])
    logits = model.compute_logits(model(torch.tensor(IDS), meta.token_positions, meta)[[9, 16]])
    start = model.vocab_shard.vocab_start_index
    return logits.numpy(), start, before, resident_weight_bytes(model), chunks


def test_tp2_packed_only_and_chunked_gathers_equal_tp1(tiny_model_path):
    want, _, _, _, _ = _prefill_logits(TPGroup(), tiny_model_path, held_once=False)
    for shard, start, before, resident, chunk_rows in run_on_ranks(_prefill_logits, 2, tiny_model_path, True):
        assert chunk_rows < len(IDS)  # the gathers did go in chunks
        assert before <= resident <= 1.01 * before  # this rank's shard, once
        assert torch.equal(torch.from_numpy(shard), torch.from_numpy(want)[:, start:start + shard.shape[1]])

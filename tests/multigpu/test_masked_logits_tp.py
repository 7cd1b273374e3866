"""Real gloo ranks: each rank's *masked* logits shard equals its slice of the unsharded masked logits.

The driver builds a real xgrammar bitmask (a JSON-schema matcher part-way
through an object), checks the guard, scatters word slices, and every rank
applies its own slice to its own logits shard; then vocab-parallel greedy
sampling must pick the same token as tp 1.
"""

import pytest
import torch
from guided_testing import json_prefix_bitmask

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.dist.spawn import run_on_ranks
from tpguide.guided import split_bitmask
from tpguide.kernels import apply_token_bitmask_inplace
from tpguide.model.attention import AttentionMetadata
from tpguide.model.loader import load_model
from tpguide.sampling.sampler import SamplingMetadata
from tpguide.worker.group_sampling import sample

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
PREFIXES = ['{"name": "Al', '{"name": "Al", "n": 1', '{']  # three rows, three grammar states


def _masked_step(group: TPGroup, model_dir: str):
    model = load_model(model_dir, group)
    shard = model.vocab_shard
    model.allocate_kv_cache(len(PREFIXES), 64)
    prompts = [[1, 2, 3 + i, 40 + i] for i in range(len(PREFIXES))]
    meta = AttentionMetadata.from_lists(list(range(len(prompts))), [len(p) for p in prompts], [0] * len(prompts))
    hidden = model(torch.tensor(sum(prompts, [])), meta.token_positions, meta)
    last = meta.query_start_loc[1:] - 1
    logits = model.compute_logits(hidden[last])  # [R, V_pad / tp]
    chunks = None
    if group.is_driver:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        bitmask = json_prefix_bitmask(tok, shard.padded_vocab_size, SCHEMA, PREFIXES)
        chunks = split_bitmask(bitmask, group.tp_size)
    local = torch.empty((len(PREFIXES), shard.bitmask_size // group.tp_size), dtype=torch.int32)
    C.scatter_tensor(local, chunks, group)
    apply_token_bitmask_inplace(logits, local, token_mask=torch.ones(len(PREFIXES), dtype=torch.int32),
                                vocab_start_index=shard.vocab_start_index)
    n = len(PREFIXES)
    meta_s = SamplingMetadata(temperature=torch.zeros(n), top_k=torch.zeros(n, dtype=torch.int32),
                              top_p=torch.ones(n), seeds=torch.zeros(n, dtype=torch.int64),
                              sample_positions=torch.full((n,), 4, dtype=torch.int64))
    out = sample(logits, meta_s, shard, group)
    return logits, (shard.vocab_start_index, shard.vocab_end_index), out.token_ids


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return _masked_step(TPGroup(), tiny_model_path)


@pytest.mark.parametrize("tp_size", [2, 3, 4])
def test_masked_shards_equal_unsharded_masked_slices(reference, tiny_model_path, tp_size):
    ref_logits, _, ref_tokens = reference
    assert torch.isinf(ref_logits).any() and torch.isfinite(ref_logits).any()
    for logits, (start, end), tokens in run_on_ranks(_masked_step, tp_size, tiny_model_path):
        expected = ref_logits[:, start:end] if end <= ref_logits.shape[1] else None
        if expected is None:  # padded tail beyond tp 1's padding: must be all -inf
            expected = torch.full_like(logits, float("-inf"))
            width = max(0, ref_logits.shape[1] - start)
            expected[:, :width] = ref_logits[:, start:start + width]
        assert torch.equal(torch.isinf(logits), torch.isinf(expected))
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
        assert tokens.tolist() == ref_tokens.tolist()

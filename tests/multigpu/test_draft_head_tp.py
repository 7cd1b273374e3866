"""Draft head on real gloo ranks: masked draft logits at tp 2 and 3 equal the unsharded ones.

The draft vocabulary is scattered over the whole target vocabulary (the byte
ids plus random ids, an odd size so tp 2 and 3 pad it), so a shard at rank > 0
maps to target ids everywhere: masking it needs the full bitmask row and the
global draft id (docs/architecture.md §3).  The driver builds real xgrammar rows for
three grammar states and broadcasts them whole.
"""

import random
from pathlib import Path

import pytest
import torch
from guided_testing import json_prefix_bitmask

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.dist.spawn import run_on_ranks
from tpguide.guided import unpack_bitmask
from tpguide.model.attention import AttentionMetadata
from tpguide.model.loader import load_model
from tpguide.speculative.draft_head import (
    DraftHead,
    DraftLMHead,
    apply_draft_bitmask_inplace,
    build_d2t,
    draft_greedy,
    select_draft_vocab,
)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
PREFIXES = ['{"name": "Al', '{"name": "Al", "n": 1', '{']
TARGET_IDS = sorted(set(range(300)) | set(random.Random(0).sample(range(300, 49152), 701)))  # 1001 ids


def _bitmask(tok, padded_vocab_size):
    return json_prefix_bitmask(tok, padded_vocab_size, SCHEMA, PREFIXES)


def masked_draft_step(group: TPGroup, model_dir: str):
    """Every rank: (full masked draft logits [R, Dv], greedy target ids [R], full bitmask)."""
    model = load_model(model_dir, group)
    cfg = model.config
    head = DraftLMHead(TARGET_IDS, cfg.hidden_size, cfg.org_vocab_size, group)
    from safetensors import safe_open

    (path,) = Path(model_dir).glob("*.safetensors")
    with safe_open(str(path), framework="pt") as f:
        name = "lm_head.weight" if "lm_head.weight" in f.keys() else "model.embed_tokens.weight"
        head.load_target_lm_head(f.get_slice(name))
    drafter = DraftHead(model, 1, head)
    model.allocate_kv_cache(len(PREFIXES), 64)
    prompts = [[1, 2, 3 + i, 40 + i] for i in range(len(PREFIXES))]
    meta = AttentionMetadata.from_lists(list(range(len(prompts))), [len(p) for p in prompts], [0] * len(prompts))
    hidden = drafter(torch.tensor(sum(prompts, [])), meta.token_positions, meta)
    draft_logits = head.compute_draft_logits(hidden[meta.query_start_loc[1:] - 1])  # [R, Dv_pad / tp]
    bitmask = None
    if group.is_driver:
        from transformers import AutoTokenizer

        bitmask = _bitmask(AutoTokenizer.from_pretrained(model_dir), model.vocab_shard.padded_vocab_size)
    shape = (len(PREFIXES), model.vocab_shard.bitmask_size)
    bitmask = C.broadcast_tensor(bitmask if bitmask is not None else torch.empty(shape, dtype=torch.int32), group)
    apply_draft_bitmask_inplace(draft_logits, bitmask, head)
    target = draft_greedy(draft_logits, head)
    full = torch.cat(list(C.all_gather_stacked(draft_logits, group)), dim=-1)[:, : len(TARGET_IDS)]
    return full, target, bitmask, model.vocab_shard.padded_vocab_size


@pytest.fixture(scope="module")
def unsharded(tiny_model_path):
    return masked_draft_step(TPGroup(), tiny_model_path)


def test_unsharded_masked_draft_logits_match_the_bool_mask_oracle(unsharded):
    full, target, bitmask, padded = unsharded
    allowed = unpack_bitmask(bitmask, padded)[:, TARGET_IDS]  # [R, Dv] bool
    assert torch.equal(torch.isneginf(full), ~allowed)
    assert allowed.any(dim=1).all() and (~allowed).any(dim=1).all()  # every row is really masked
    best = full.argmax(dim=-1)
    assert target.tolist() == [TARGET_IDS[g] for g in best.tolist()]
    d2t = build_d2t(TARGET_IDS)
    assert [g + int(d2t[g]) for g in best.tolist()] == target.tolist()


@pytest.mark.parametrize("tp_size", [2, 3])
def test_sharded_masked_draft_logits_equal_unsharded(unsharded, tiny_model_path, tp_size):
    full1, target1, _, _ = unsharded
    for full, target, _, _ in run_on_ranks(masked_draft_step, tp_size, tiny_model_path):
        assert torch.equal(torch.isneginf(full), torch.isneginf(full1))
        finite = torch.isfinite(full1)
        torch.testing.assert_close(full[finite], full1[finite], rtol=1e-5, atol=1e-5)
        assert target.tolist() == target1.tolist()


def test_select_draft_vocab_keeps_first_ids_and_stop_tokens():
    ids = select_draft_vocab(49152, 6, always=[2, 40000])
    assert ids == [0, 1, 2, 3, 4, 40000]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        select_draft_vocab(10, 11)

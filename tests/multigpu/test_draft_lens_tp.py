"""Draft lens on real gloo ranks: the SPMD calibration at tp 2, and a lensed draft head sharded == unsharded.

The lens fitted from tp-2 hidden states may differ from tp 1's by fp noise
(all-reduce order), so the sharded/unsharded comparison passes one explicit
lens to both.
"""

import torch

from tpguide.cache import cache_root
from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.dist.spawn import run_on_ranks
from tpguide.model.attention import AttentionMetadata
from tpguide.model.loader import load_model
from tpguide.speculative import draft_lens
from tpguide.speculative.draft_head import DraftHead, build_draft_head, draft_greedy
from tpguide.speculative.draft_lens_calibration import collect_residuals

PROMPTS = [[1, 2, 3, 40, 41], [7, 8, 9], [500, 600, 700, 800]]


def fit_on_group(group: TPGroup, model_dir: str, cached: bool):
    """Every rank: the lens and the cache files afterwards; ``cached``: the calibration forward must not run."""
    if cached:
        def no_forward(*args):
            raise AssertionError(f"rank {group.tp_rank} ran the calibration forward although the lens is cached")

        draft_lens.collect_residuals = no_forward
    tokenizer = None
    if group.is_driver:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lens = draft_lens.load_or_fit_lens(load_model(model_dir, group), model_dir, 1, tokenizer)
    return lens, sorted(p.name for p in (cache_root() / "draft_lens").iterdir())


def lensed_draft_step(group: TPGroup, model_dir: str, lens: torch.Tensor):
    """Every rank: full draft logits [R, Dv], greedy target ids [R], and (tp 1) the lens formula on residuals."""
    model = load_model(model_dir, group)
    head = DraftHead(model, 1, build_draft_head(model, model_dir, 1, 1001).lm_head, lens)
    model.allocate_kv_cache(len(PROMPTS), 16)
    meta = AttentionMetadata.from_lists(list(range(len(PROMPTS))), [len(p) for p in PROMPTS], [0] * len(PROMPTS))
    hidden = head(torch.tensor(sum(PROMPTS, [])), meta.token_positions, meta)  # [T, H]
    last = hidden[meta.query_start_loc[1:] - 1]
    logits = head.lm_head.compute_draft_logits(last)
    full = torch.cat(list(C.all_gather_stacked(logits, group)), dim=-1)[:, :1001]
    h_layer, _ = collect_residuals(model, 1, PROMPTS)  # same tokens and positions, layer-1 residuals
    expected = model.model.norm(h_layer @ lens[:-1] + lens[-1])[meta.query_start_loc[1:] - 1]
    return full, draft_greedy(logits, head.lm_head), last, expected


def test_tp2_loads_the_cached_lens_then_fits_the_same_one(tiny_model_path, lens_cache):
    lens1, files1 = fit_on_group(TPGroup(), tiny_model_path, False)
    assert len(files1) == 1
    for lens, files in run_on_ranks(fit_on_group, 2, tiny_model_path, True):
        assert torch.equal(lens, lens1) and files == files1
    (lens_cache / files1[0]).unlink()
    fitted = run_on_ranks(fit_on_group, 2, tiny_model_path, False)  # every rank runs the calibration forward
    assert torch.equal(fitted[0][0], fitted[1][0])  # fitted on rank 0, broadcast
    assert fitted[0][1] == files1  # one file, same key, no temporary left
    torch.testing.assert_close(fitted[0][0], lens1, rtol=1e-4, atol=1e-4)  # tp 2 residuals: fp noise only


def test_lensed_draft_logits_at_tp2_equal_unsharded(tiny_model_path):
    g = torch.Generator().manual_seed(0)
    lens = torch.cat([torch.eye(144) + 0.2 * torch.randn(144, 144, generator=g), torch.randn(1, 144, generator=g)])
    full1, target1, last1, expected1 = lensed_draft_step(TPGroup(), tiny_model_path, lens)
    torch.testing.assert_close(last1, expected1, rtol=1e-5, atol=1e-5)  # layers < L -> [x, 1] @ lens -> norm
    for full, target, last, _ in run_on_ranks(lensed_draft_step, 2, tiny_model_path, lens):
        torch.testing.assert_close(last, last1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(full, full1, rtol=1e-5, atol=1e-5)
        assert target.tolist() == target1.tolist()

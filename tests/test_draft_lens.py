"""Draft lens: the closed-form fit, the calibration documents, the on-disk cache (tp 1)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine
from tpguide.model.loader import load_model
from tpguide.speculative import draft_lens
from tpguide.speculative.draft_head import build_draft_head
from tpguide.speculative.draft_lens import fit_tuned_lens, lens_cache_key, load_or_fit_lens
from tpguide.speculative.draft_lens_calibration import calibration_text, calibration_token_ids, parse_documents


def test_fit_recovers_a_known_affine_map():
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(8, 8, generator=g), torch.randn(8, generator=g)  # not symmetric
    x = torch.randn(200, 8, generator=g) + 3.0  # off-centre, so a wrong bias shows
    lens = fit_tuned_lens(x, x @ weight + bias, ridge=0.0)
    assert lens.dtype == torch.float32 and lens.shape == (9, 8)
    torch.testing.assert_close(lens[:-1], weight, rtol=0, atol=1e-5)
    torch.testing.assert_close(lens[-1], bias, rtol=0, atol=1e-5)


def test_a_huge_ridge_shrinks_the_weight_but_not_the_bias():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(300, 6, generator=g), torch.randn(300, 6, generator=g) + 5.0
    lens = fit_tuned_lens(x, y, ridge=1e9)
    assert lens[:-1].abs().max() < 1e-6
    torch.testing.assert_close(lens[-1], y.mean(dim=0), rtol=0, atol=1e-5)


def test_fit_rejects_mismatched_shapes_and_negative_ridge():
    with pytest.raises(ValueError, match="h_layer and h_final"):
        fit_tuned_lens(torch.zeros(4, 3), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="ridge"):
        fit_tuned_lens(torch.zeros(4, 3), torch.zeros(4, 3), ridge=-1.0)


def test_documents_split_on_separator_and_chats_become_turns():
    text = "header\n~~~\nplain {\"a\": 1}\nuser: not a turn here\n~~~\nuser: Hi?\nassistant: {\n  \"x\": 1\n}\nuser: Bye\n"
    assert parse_documents(text) == [
        'plain {"a": 1}\nuser: not a turn here',
        [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": '{\n  "x": 1\n}'},
         {"role": "user", "content": "Bye"}],
    ]


def test_builtin_text_has_thousands_of_tokens_and_chat_turns(tokenizer):
    seqs = calibration_token_ids(tokenizer, calibration_text())
    assert sum(map(len, seqs)) > 3000
    chats = [tokenizer.decode(s) for s in seqs if "<|im_start|>assistant" in tokenizer.decode(s)]
    assert len(chats) >= 5 and all(c.startswith("<|im_start|>system") for c in chats)


def test_second_build_loads_the_cached_lens(tiny_model_path, lens_cache, monkeypatch):
    model = load_model(tiny_model_path, TPGroup())
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    first = build_draft_head(model, tiny_model_path, 1, 1001, lens=True, tokenizer=tok).lens
    (cached,) = lens_cache.glob("*.safetensors")
    assert first.shape == (145, 144)

    def no_forward(*args):
        raise AssertionError("the calibration forward ran although the lens is cached")

    with monkeypatch.context() as m:
        m.setattr(draft_lens, "collect_residuals", no_forward)
        assert torch.equal(load_or_fit_lens(model, tiny_model_path, 1, tok), first)
    cached.write_bytes(b"damaged")
    assert torch.equal(load_or_fit_lens(model, tiny_model_path, 1, tok), first)  # refitted, rewritten
    assert cached.stat().st_size > 1000


def test_key_depends_on_layers_ridge_and_calibration_tokens(tiny_model_path):
    key = lens_cache_key(tiny_model_path, 1, [[1, 2, 3]], 0.03, torch.float32)
    assert key == lens_cache_key(tiny_model_path, 1, [[1, 2, 3]], 0.03, torch.float32)
    others = [lens_cache_key(tiny_model_path, 2, [[1, 2, 3]], 0.03, torch.float32),
              lens_cache_key(tiny_model_path, 1, [[1, 2, 3]], 0.1, torch.float32),
              lens_cache_key(tiny_model_path, 1, [[1, 2, 4]], 0.03, torch.float32),
              lens_cache_key(tiny_model_path, 1, [[1, 2, 3]], 0.03, torch.bfloat16)]
    assert len({key, *others}) == 5


def test_key_tells_checkpoints_of_the_same_shapes_apart(tiny_model_path, default_model_path, tmp_path):
    from tpguide.model.random_checkpoint import write_random_checkpoint

    other = Path(write_random_checkpoint(tmp_path, tokenizer_dir=default_model_path, seed=2))  # tiny, other weights
    tiny = Path(tiny_model_path)
    assert (other / "config.json").read_bytes() == (tiny / "config.json").read_bytes()
    assert (other / "model.safetensors").stat().st_size == (tiny / "model.safetensors").stat().st_size
    assert lens_cache_key(str(other), 1, [[1]], 0.03, torch.float32) != \
        lens_cache_key(tiny_model_path, 1, [[1]], 0.03, torch.float32)


def test_no_lens_when_the_drafter_runs_every_layer(tiny_model_path, lens_cache):
    model = load_model(tiny_model_path, TPGroup())
    head = build_draft_head(model, tiny_model_path, 2, 1001, lens=True)  # no tokenizer needed: nothing is fitted
    assert head.lens is None and not lens_cache.exists()
    with pytest.raises(ValueError, match="lens must be float32"):
        type(head)(model, 2, head.lm_head, torch.zeros(145, 144))


@pytest.mark.parametrize("draft_lens", [True, False])
def test_build_engine_fits_the_lens_before_the_engine_allocates_its_kv_cache(tiny_model_path, lens_cache, draft_lens):
    config = EngineConfig(max_num_seqs=2, max_model_len=64, speculative_method="draft-head", num_speculative_tokens=2,
                          draft_num_layers=1, draft_vocab_size=1001, draft_lens=draft_lens)
    engine = build_engine(TPGroup(), tiny_model_path, config)
    assert (engine.draft_head.lens is not None) == draft_lens
    blocks, block_size = engine.model.model.layers[0].self_attn.attn.k_cache.shape[:2]  # the engine's paged pool,
    assert block_size == config.block_size and blocks * block_size >= 2 * 64  # not the calibration's cache


def test_the_driver_needs_a_tokenizer(tiny_model_path, lens_cache):
    model = load_model(tiny_model_path, TPGroup())
    with pytest.raises(ValueError, match="needs the tokenizer"):
        load_or_fit_lens(model, tiny_model_path, 1)

"""tpguide's tp-1 model against transformers' LlamaForCausalLM on tiny random checkpoints."""

import json

import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.model.attention import AttentionMetadata
from tpguide.model.config import ModelConfig
from tpguide.model.loader import load_model
from tpguide.model.random_checkpoint import write_random_checkpoint

VOCAB = 32011  # odd: padded to 32064 at tp 1
ATOL = 1e-4


@pytest.fixture(scope="module", params=[(True, False), (False, True)], ids=["tied", "untied-bias"])
def ckpt(request, tmp_path_factory):
    tie, bias = request.param
    d = write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), vocab_size=VOCAB, tie_word_embeddings=tie,
                                attention_bias=bias, seed=1)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    model = load_model(d, TPGroup())
    return d, hf, model


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [L, V]


def step(model, seqs):
    """Run one step. ``seqs``: list of (slot, context_len, new_ids). Returns logits per sequence."""
    meta = AttentionMetadata.from_lists([s for s, _, _ in seqs], [len(t) for _, _, t in seqs],
                                        [c for _, c, _ in seqs])
    input_ids = torch.tensor([t for _, _, ids in seqs for t in ids])
    hidden = model(input_ids, meta.token_positions, meta)
    logits = model.compute_logits(hidden)[:, :VOCAB]
    bounds = meta.query_start_loc.tolist()
    return [logits[bounds[i]:bounds[i + 1]] for i in range(len(seqs))]


def prompt(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_matches_transformers(ckpt):
    _, hf, model = ckpt
    ids = prompt(13, 0)
    model.allocate_kv_cache(2, 64)
    (got,) = step(model, [(1, 0, ids)])
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_decode_steps_with_kv_cache(ckpt):
    _, hf, model = ckpt
    ids = prompt(6, 1)
    model.allocate_kv_cache(1, 32)
    (logits,) = step(model, [(0, 0, ids)])
    for _ in range(5):
        nxt = int(logits[-1].argmax())
        (logits,) = step(model, [(0, len(ids), [nxt])])
        ids.append(nxt)
        torch.testing.assert_close(logits[-1], hf_logits(hf, ids)[-1], atol=ATOL, rtol=0)


def test_mixed_batch_with_chunked_prefill(ckpt):
    _, hf, model = ckpt
    a, b, c = prompt(7, 2), prompt(10, 3), prompt(11, 4)
    model.allocate_kv_cache(4, 32)
    # Step 1: b's first 9 tokens and c's first chunk (5 tokens).
    got_b, got_c = step(model, [(2, 0, b[:9]), (0, 0, c[:5])])
    torch.testing.assert_close(got_b, hf_logits(hf, b[:9]), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_c, hf_logits(hf, c[:5]), atol=ATOL, rtol=0)
    # Step 2: a whole prompt, b one decode token, c the second chunk on its cached prefix.
    got_a, got_b, got_c = step(model, [(3, 0, a), (2, 9, b[9:]), (0, 5, c[5:])])
    torch.testing.assert_close(got_a, hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, hf_logits(hf, b)[9:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got_c, hf_logits(hf, c)[5:], atol=ATOL, rtol=0)


def test_padded_and_untokenizable_ids_are_neg_inf(ckpt):
    d, _, model = ckpt
    model.allocate_kv_cache(1, 8)
    meta = AttentionMetadata.from_lists([0], [3], [0])
    hidden = model(torch.tensor([1, 2, 3]), meta.token_positions, meta)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    assert logits.shape == (3, model.vocab_shard.padded_vocab_size) == (3, 32064)
    assert torch.isfinite(logits[:, :VOCAB]).all() and torch.isneginf(logits[:, VOCAB:]).all()
    small = load_model(d, TPGroup(), tokenizer_vocab_size=32000)
    small.allocate_kv_cache(1, 8)
    logits = small.compute_logits(small(torch.tensor([1, 2, 3]), meta.token_positions, meta))
    assert torch.isfinite(logits[:, :32000]).all() and torch.isneginf(logits[:, 32000:]).all()


def test_checkpoint_shape_mismatch_names_tensor_and_shapes(tmp_path):
    d = write_random_checkpoint(tmp_path, vocab_size=1000, seed=0)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96  # checkpoint has 192
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.(down|gate|up)_proj\.weight.*\[.*192.*\].*\[.*96.*\]"):
        load_model(d, TPGroup())


def test_missing_directory_and_no_safetensors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope", TPGroup())
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(tmp_path, TPGroup())


def _config(**kw):
    base = dict(architecture="LlamaForCausalLM", hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                max_position_embeddings=2048, org_vocab_size=49152)
    base.update(kw)
    return ModelConfig(**base)


def test_check_tp_size_lists_valid_sizes():
    cfg = _config()
    assert cfg.valid_tp_sizes() == [1, 2, 3, 4, 6, 8, 12, 16]
    for tp in (1, 2, 3, 4):
        cfg.check_tp_size(tp)
    with pytest.raises(ValueError, match=r"intermediate_size=1536 is not divisible by tp_size=5.*\[1, 2, 3, 4, 6, 8, 12, 16\]"):
        cfg.check_tp_size(5)
    with pytest.raises(ValueError, match=r"valid tp sizes.*\[1, 2, 4, 8, 16\]"):
        _config(intermediate_size=1024).check_tp_size(3)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="hidden_act must be one of .*got .gelu."):
        _config(hidden_act="gelu")
    with pytest.raises(ValueError, match="num_attention_heads=9 is not a multiple of num_key_value_heads=4"):
        _config(num_key_value_heads=4)
    with pytest.raises(ValueError, match="architecture"):
        _config(architecture="GPT2LMHeadModel")


def test_config_from_hf_reads_eos_and_rope(ckpt):
    d = ckpt[0]
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.org_vocab_size == VOCAB and cfg.head_dim == 16 and cfg.num_key_value_heads == 3
    inv_freq, scale = cfg.rope_inv_freq()
    assert inv_freq.shape == (8,) and scale == 1.0
    from transformers import AutoConfig

    assert cfg == ModelConfig.from_hf(AutoConfig.from_pretrained(d))  # json fast path == transformers path


def test_llama3_rope_uses_transformers_init():
    from transformers import LlamaConfig

    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=1,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64})
    cfg = ModelConfig.from_hf(hf)
    inv_freq, _ = cfg.rope_inv_freq()
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert inv_freq.shape == plain.shape and not torch.allclose(inv_freq, plain)


def test_attention_metadata_validation():
    meta = AttentionMetadata.from_lists([3, 0], [2, 1], [0, 4])
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert meta.token_positions.tolist() == [0, 1, 4]
    assert meta.seq_lens.tolist() == [2, 5] and meta.max_seq_len == 5
    with pytest.raises(ValueError, match="distinct"):
        AttentionMetadata.from_lists([1, 1], [1, 1], [0, 0])
    with pytest.raises(ValueError, match="query_lens"):
        AttentionMetadata.from_lists([1], [0], [0])


@pytest.mark.parametrize("slots", [[1, 2, 3], [3, 0, 2]])  # cache views / gathered slots
def test_decode_only_batch_matches_transformers(ckpt, slots):
    _, hf, model = ckpt
    seqs = [prompt(4 + i, 10 + i) for i in range(3)]
    model.allocate_kv_cache(4, 32)
    firsts = step(model, [(s, 0, ids) for s, ids in zip(slots, seqs)])
    nxt = [int(lg[-1].argmax()) for lg in firsts]
    got = step(model, [(s, len(ids), [t]) for s, ids, t in zip(slots, seqs, nxt)])
    for g, ids, t in zip(got, seqs, nxt):
        torch.testing.assert_close(g[-1], hf_logits(hf, ids + [t])[-1], atol=ATOL, rtol=0)

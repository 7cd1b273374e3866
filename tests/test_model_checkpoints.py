"""Checkpoints as users have them: sharded safetensors, bf16 at its own dtype, a GGUF of a non-embedded family.

Also the reader (:mod:`tpguide.model.safetensors_reader`) against safetensors'
own ``get_slice``, and the one-line errors for unsupported configs.
"""

import json

import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.model.attention import AttentionMetadata
from tpguide.model.config import ModelConfig
from tpguide.model.loader import load_model
from tpguide.model.random_checkpoint import tiny_hf_config, write_random_model
from tpguide.model.safetensors_reader import checkpoint_dtype, checkpoint_files, iter_checkpoint

VOCAB = 1000


def _logits(model, ids):
    model.allocate_kv_cache(1, 64)
    meta = AttentionMetadata.from_lists([0], [len(ids)], [0])
    return model.compute_logits(model(torch.tensor(ids), meta.token_positions, meta))


def test_sharded_index_directory_loads_like_one_file(tmp_path):
    config = tiny_hf_config("Qwen3ForCausalLM", VOCAB)
    one = write_random_model(tmp_path / "one", config, seed=4)
    sharded = write_random_model(tmp_path / "sharded", config, seed=4, max_shard_size="60KB")
    files = checkpoint_files(sharded)
    assert (sharded / "model.safetensors.index.json").is_file() and len(files) > 3
    ids = list(range(3, 23))
    torch.testing.assert_close(_logits(load_model(sharded, TPGroup()), ids), _logits(load_model(one, TPGroup()), ids),
                               atol=0, rtol=0)


def test_index_naming_a_missing_file_is_an_error(tmp_path):
    d = write_random_model(tmp_path, tiny_hf_config("LlamaForCausalLM", VOCAB), max_shard_size="60KB")
    next(d.glob("model-0000*.safetensors")).unlink()
    with pytest.raises(ValueError, match="names missing files"):
        load_model(d, TPGroup())


def test_bf16_checkpoint_loads_at_its_dtype_bit_exact(tmp_path):
    d = write_random_model(tmp_path, tiny_hf_config("Gemma2ForCausalLM", VOCAB), dtype=torch.bfloat16)
    assert checkpoint_dtype(d) == torch.bfloat16
    model = load_model(d, TPGroup(), dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    from safetensors.torch import load_file

    full = load_file(str(d / "model.safetensors"))
    assert params["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(params["model.embed_tokens.weight"][:VOCAB], full["model.embed_tokens.weight"])
    assert torch.equal(params["model.layers.1.mlp.down_proj.weight"], full["model.layers.1.mlp.down_proj.weight"])
    assert torch.isfinite(_logits(model, list(range(5, 20)))[:, :VOCAB]).all()


def test_reader_slices_equal_safetensors_get_slice(tmp_path):
    from safetensors import safe_open

    d = write_random_model(tmp_path, tiny_hf_config("Phi3ForCausalLM", VOCAB), dtype=torch.float16)
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        for _, name, sl in iter_checkpoint(d):
            ref = f.get_slice(name)
            assert sl.get_shape() == list(ref.get_shape()) and sl.get_dtype() == torch.float16
            shape = sl.get_shape()
            index = (slice(1, shape[0] - 1),) + tuple(slice(1, n - 2) for n in shape[1:])
            assert torch.equal(sl[index], ref[index]), name


def _config_dir(tmp_path, name, config):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


MOE = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 64,
       "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB}
DYNAMIC_ROPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": VOCAB,
                "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}


def test_moe_unknown_rope_and_unknown_family_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match=r"Qwen2MoeForCausalLM is a mixture-of-experts model \(num_experts=8.*"
                                         r"supported architectures: LlamaForCausalLM.*Gemma3ForConditionalGeneration \(text only\)$") as moe:
        ModelConfig.from_pretrained(_config_dir(tmp_path, "moe", MOE))
    with pytest.raises(ValueError, match=r"rope_type 'dynamic' is not supported; supported: .*longrope") as rope:
        ModelConfig.from_pretrained(_config_dir(tmp_path, "rope", DYNAMIC_ROPE))
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(ValueError, match=r"architecture 'GPT2LMHeadModel'; supported architectures") as other:
        ModelConfig.from_pretrained(_config_dir(tmp_path, "gpt2", gpt2))
    for exc in (moe, rope, other):
        assert "\n" not in str(exc.value)


def test_unknown_layer_type_is_refused():
    hf = tiny_hf_config("Qwen3ForCausalLM", VOCAB)
    hf.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not supported; supported"):
        ModelConfig.from_hf(hf)


def test_startup_error_lists_valid_tp_sizes():
    cfg = ModelConfig.from_hf(tiny_hf_config("Gemma3ForCausalLM", VOCAB, intermediate_size=100))
    with pytest.raises(ValueError, match=r"intermediate_size=100 is not divisible by tp_size=3.*\[1, 2, 4, 5, 10\]"):
        cfg.check_tp_size(3)


def test_qwen2_window_off_reads_the_same_without_transformers(tmp_path):
    """A plain Qwen2 config.json (read with json alone) with ``use_sliding_window: false`` has no window."""
    from transformers import AutoConfig

    d = write_random_model(tmp_path, tiny_hf_config("Qwen2ForCausalLM", VOCAB, use_sliding_window=False,
                                                   sliding_window=4096))
    raw = json.loads((d / "config.json").read_text())
    raw.pop("layer_types", None)  # released Qwen2 configs have none
    raw["sliding_window"] = 4096
    (d / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_pretrained(d)
    assert type(cfg.hf_config).__name__ == "SimpleNamespace"  # the json fast path
    assert cfg.layer_types == () and cfg.sliding_window is None
    assert cfg == ModelConfig.from_hf(AutoConfig.from_pretrained(d))


def _bytes_read(fn):
    def rchar():
        return int(next(line for line in open("/proc/self/io") if line.startswith("rchar:")).split()[1])

    before = rchar()
    fn()
    return rchar() - before


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Phi3ForCausalLM"])
def test_each_rank_reads_only_its_slices(arch, tmp_path):
    """Bytes read (``/proc/self/io``) by the two ranks of tp 2 add up to one tp-1 load; each reads about half."""
    d = write_random_model(tmp_path, tiny_hf_config(arch, VOCAB * 4), seed=2)
    config = ModelConfig.from_pretrained(d)  # config.json and imports outside the measurement
    whole = _bytes_read(lambda: load_model(d, TPGroup()))
    # loading talks to no other rank, so a stand-in process group is enough
    ranks = [_bytes_read(lambda r=r: load_model(d, TPGroup(tp_rank=r, tp_size=2, process_group=object())))
             for r in range(2)]
    assert config.num_key_value_heads % 2 == 0  # no zero heads: the halves are exact
    assert abs(sum(ranks) - whole) < 0.02 * whole, (ranks, whole)
    assert all(r < 0.52 * whole for r in ranks), (ranks, whole)

"""``--model FILE.gguf`` for a family other than the embedded Llama: a Qwen3 GGUF written with the ``gguf`` package.

The file gets a tiny random Qwen3 (tensor names from ``gguf``'s own name map)
and SmolLM2's tokenizer metadata copied from the embedded GGUF.  tpguide
converts it once into the cache and generates from it; the tokens equal
transformers' ``generate`` on the same GGUF read by transformers' loader.
"""

import numpy as np
import pytest
import torch

from tpguide.engine import EngineConfig, generate_on_group
from tpguide.model.model_source import gguf_cache_dir, resolve_model_dir

gguf = pytest.importorskip("gguf")

NUM_LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 2, 64, 2, 1, 128, 96  # Qwen3 GGUFs carry no head_dim: 128


def write_qwen3_gguf(path, tokenizer_gguf, seed=0):
    """A random-weight Qwen3 GGUF (fp32 tensors) with the tokenizer of ``tokenizer_gguf``."""
    reader = gguf.GGUFReader(str(tokenizer_gguf))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(NUM_LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1000000.0)
    writer.add_vocab_size(vocab)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    g = torch.Generator().manual_seed(seed)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, NUM_LAYERS)
    shapes = {"model.embed_tokens.weight": (vocab, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (vocab, HIDDEN)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                       p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                       p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,),
                       p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
                       p + "mlp.down_proj.weight": (HIDDEN, FFN)})
    for hf_name, shape in shapes.items():
        values = (1.0 + 0.2 * torch.randn(shape, generator=g)) if len(shape) == 1 else 0.15 * torch.randn(shape, generator=g)
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight",)), values.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.slow  # transformers converts the 49k-token GGUF tokenizer (about a minute)
def test_qwen3_gguf_runs_through_model_flag(tmp_path, monkeypatch, default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tpguide.dist import TPGroup
    from tpguide.model.default_model import find_default_gguf

    monkeypatch.setenv("TPGUIDE_CACHE", str(tmp_path / "cache"))
    path = write_qwen3_gguf(tmp_path / "tiny-qwen3.gguf", find_default_gguf())
    prompt = "Write the name of a river"
    outputs = generate_on_group(TPGroup(), str(path), [{"prompt": prompt, "max_tokens": 8, "ignore_eos": True}],
                                EngineConfig(max_num_seqs=1, max_model_len=64))
    model_dir = resolve_model_dir(str(path))
    assert model_dir == gguf_cache_dir(path.absolute()) and (model_dir / "model.safetensors").is_file()
    assert '"Qwen3ForCausalLM"' in (model_dir / "config.json").read_text()

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)  # the converted one; reading the GGUF again costs a minute
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert outputs[0]["token_ids"] == want


def test_missing_gguf_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"GGUF file .*nope\.gguf.* does not exist"):
        resolve_model_dir(str(tmp_path / "nope.gguf"))

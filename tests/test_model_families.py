"""Families at tp 1 in process: chunked prefill and mixed batches equal one-shot prefill.

The engine splits prompts into chunks and batches decodes with prefills;
sliding-window masks (built from each sequence's context length), Gemma's
soft-capped attention and Phi-3's longrope (one factor set per cache) must
give the same logits either way.  transformers equality itself is in
``tests/multigpu/test_architectures_tp.py``.
"""

import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.model.attention import AttentionMetadata
from tpguide.model.loader import load_model
from tpguide.model.random_checkpoint import tiny_hf_config, write_random_model

VOCAB = 500


def _step(model, seqs):
    """``seqs``: (slot, context_len, new ids); returns fp32 logits ``[T, V]``."""
    meta = AttentionMetadata.from_lists([s for s, _, _ in seqs], [len(t) for _, _, t in seqs],
                                        [c for _, c, _ in seqs])
    ids = torch.tensor([t for _, _, toks in seqs for t in toks])
    return model.compute_logits(model(ids, meta.token_positions, meta))[:, :VOCAB]


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"])
def test_chunked_and_mixed_batches_equal_one_shot(arch, tmp_path):
    d = write_random_model(tmp_path, tiny_hf_config(arch, VOCAB), seed=7)
    model = load_model(d, TPGroup())
    model.allocate_kv_cache(3, 64)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, VOCAB, (21,), generator=g).tolist(), torch.randint(0, VOCAB, (5,), generator=g).tolist()
    one_shot = _step(model, [(0, 0, a)])  # [21, V]; rows 12.. see past the window of 8
    # slot 1: a in chunks of 7, batched with b (prefill) and then b's decode (padded query rows)
    first = _step(model, [(1, 0, a[:7]), (2, 0, b[:4])])
    second = _step(model, [(2, 4, b[4:]), (1, 7, a[7:14])])
    third = _step(model, [(1, 14, a[14:20]), (2, 5, [a[0]])])
    last = _step(model, [(2, 6, [a[1]]), (1, 20, a[20:])])
    chunked = torch.cat([first[:7], second[1:], third[:6], last[1:]])
    torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=1e-5)
    alone = _step(model, [(0, 0, b)])
    torch.testing.assert_close(torch.cat([first[7:], second[:1]]), alone, atol=1e-5, rtol=1e-5)


def test_gemma3_multimodal_checkpoint_runs_its_language_model(tmp_path):
    """``Gemma3ForConditionalGeneration`` (as gemma-3-4b-it ships): text logits equal transformers', vision skipped."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = tiny_hf_config("Gemma3ForCausalLM", VOCAB)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    d = write_random_model(tmp_path, config, seed=3)
    assert '"Gemma3ForConditionalGeneration"' in (d / "config.json").read_text()
    hf = Gemma3ForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB - 3, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    model = load_model(d, TPGroup())
    assert model.config.architecture == "Gemma3ForCausalLM"
    assert model.config.text_decoder_of == "Gemma3ForConditionalGeneration"
    model.allocate_kv_cache(1, 32)
    torch.testing.assert_close(_step(model, [(0, 0, ids)]), want, atol=1e-4, rtol=0)

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

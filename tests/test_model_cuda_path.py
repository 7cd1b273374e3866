"""The model's CUDA code path (tp-invariant): a request's logits alone == among others, chunked, with padding rows.

The path runs here on CPU tensors, forced by
:func:`tpguide.kernels.triton_path.forced_triton_path` with its kernels
interpreted (``TRITON_INTERPRET=1``, in a child process as in
``tests/triton_interpreted.py``); with a GPU the same cases run on CUDA.
Per family (Llama bf16; Gemma 2 with soft-caps, sliding window and ``1 + w``
norms; Qwen 3 with q/k norms), on a tiny random checkpoint:

* bit for bit: request R's prefill rows and decode row alone equal its rows
  when R is prefilled in chunks beside other requests' prefills and decodes,
  at other blocks of the pool, with padding rows (position -1, slot -1) in
  the batch; padding rows leave the KV pool untouched;
* within rounding: the same logits as the CPU fixed-order path.

Run directly with ``TRITON_INTERPRET=1 python tests/test_model_cuda_path.py [NAME...]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch
from triton_interpreted import check_in_child, run_cases

pytest.importorskip("triton")

VOCAB, BLOCK_SIZE = 300, 8


def _padded_step(model, steps, num_padding, pad_at):
    """One forward of ``steps`` = [(block table, context_len, new ids)] with padding rows inserted at ``pad_at``.

    Returns fp32 logits ``[T, V]`` of the real rows, in order.
    """
    from tpguide.model.attention import AttentionMetadata

    device = model.group.device
    meta = AttentionMetadata.from_block_tables([t for t, _, _ in steps], [len(ids) for _, _, ids in steps],
                                               [c for _, c, _ in steps], device=device, block_size=BLOCK_SIZE)
    ids = torch.tensor([i for _, _, toks in steps for i in toks], device=device)
    real = torch.ones(len(ids) + num_padding, dtype=torch.bool)
    real[pad_at:pad_at + num_padding] = False
    real = real.to(device)

    def spread(x, fill):  # the real rows' values, ``fill`` on the padding rows
        out = torch.full((len(real),), fill, dtype=x.dtype, device=device)
        out[real] = x
        return out

    meta = dataclasses.replace(meta, token_seq_index=spread(meta.token_seq_index, 0),
                               token_query_index=spread(meta.token_query_index, 0),
                               token_positions=spread(meta.token_positions, -1))
    hidden = model(spread(ids, 0), meta.token_positions, meta)
    return model.compute_logits(hidden)[real][:, :VOCAB]


def _family_case(arch, dtype, tol):
    def case(device):
        from tpguide.dist import TPGroup
        from tpguide.kernels.triton_path import forced_triton_path
        from tpguide.model.loader import load_model
        from tpguide.model.random_checkpoint import tiny_hf_config, write_random_model

        d = write_random_model(Path(tempfile.mkdtemp()), tiny_hf_config(arch, VOCAB), seed=5)
        g = torch.Generator().manual_seed(1)
        a, b, c = (torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (19, 9, 4))
        forced = forced_triton_path() if device == "cpu" else contextlib.nullcontext()
        model = load_model(d, TPGroup(device=torch.device(device)), dtype=dtype)
        model.allocate_kv_cache(24, BLOCK_SIZE, max_model_len=64)
        with forced:
            alone_prefill = _padded_step(model, [([0, 1, 2], 0, a)], 0, 0)
            alone_decode = _padded_step(model, [([0, 1, 2], 19, [a[3]])], 0, 0)
            r, bt, ct = [20, 7, 13], [3, 4], [5]  # R's blocks elsewhere in the pool
            first = _padded_step(model, [(bt, 0, b), (r, 0, a[:6]), (ct, 0, c[:3])], 3, 5)  # padding mid-batch
            k_before = [layer.self_attn.attn.k_cache.clone() for layer in model.model.layers]
            second = _padded_step(model, [(ct, 3, c[3:]), (r, 6, a[6:17]), (bt, 9, [b[0]])], 2, 13)
            for layer, before in zip(model.model.layers, k_before):  # only the 13 real tokens' slots changed
                changed = (layer.self_attn.attn.k_cache != before).flatten(2).any(-1).flatten().nonzero().flatten()
                assert changed.tolist() == sorted([43, 166, 167, *range(56, 64), 104, 33])
            third = _padded_step(model, [(r, 17, a[17:])], 5, 2)
            decode = _padded_step(model, [(bt, 10, [b[1]]), (r, 19, [a[3]]), (ct, 4, [c[0]])], 1, 3)
            assert torch.equal(torch.cat([first[9:15], second[1:12], third]), alone_prefill)
            assert torch.equal(decode[1:2], alone_decode)
        cpu = load_model(d, TPGroup(), dtype=dtype)  # the CPU fixed-order path, not forced
        cpu.allocate_kv_cache(24, BLOCK_SIZE, max_model_len=64)
        want = _padded_step(cpu, [([0, 1, 2], 0, a)], 0, 0)
        torch.testing.assert_close(alone_prefill.cpu(), want, atol=tol, rtol=tol)
    return case


CASES = {
    "llama-bf16": _family_case("LlamaForCausalLM", torch.bfloat16, 3e-2),
    "gemma2-f32": _family_case("Gemma2ForCausalLM", torch.float32, 1e-4),
    "qwen3-bf16": _family_case("Qwen3ForCausalLM", torch.bfloat16, 3e-2),
}


def test_cuda_code_path_interpreted_on_cpu():
    check_in_child(__file__, list(CASES), timeout_s=900)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_code_path_on_cuda(name):
    CASES[name]("cuda")


if __name__ == "__main__":
    run_cases(CASES)

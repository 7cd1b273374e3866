"""Every Triton kernel of a CUDA step, launched at the largest supported model sizes: no integer offset overflows.

Interpreted on CPU in a child process (``tests/triton_interpreted.py``) on
fake ``meta`` tensors (``tests/triton_offsets.py``): each signed integer
``+ - * <<`` inside the kernels is checked against its type's range, and
every load and store address against its tensor.  The shapes are those of
the largest dense checkpoints of the supported families at tp 1 (the widest
shards), ``MAX_NUM_BATCHED_TOKENS`` tokens in one step, and a KV pool of
``2**24`` blocks, more than any single GPU holds.  A wrapped ``u * stride_u``
(``sum_units_triton`` before the fix: 70B ``o_proj`` above 4,161 tokens) is
reported with its kernel and value; docs/gpu.md, "Offsets at real model sizes".

Run directly with ``TRITON_INTERPRET=1 python tests/test_kernels_int_ranges.py [NAME...]``.
"""

from __future__ import annotations

import math

import pytest
import torch
from triton_interpreted import check_in_child, run_cases

pytest.importorskip("triton")

#: (name, hidden, heads, KV heads, head dim, intermediate, vocab): Llama-3.1-405B has the widest hidden size, heads
#: and MLP; Gemma-3-27B the largest vocabulary (its config.json values).
SHAPES = {
    "llama3_405b": (16384, 128, 8, 128, 53248, 128256),
    "gemma3_27b": (5376, 32, 16, 128, 21504, 262208),
}
NUM_BLOCKS = 1 << 24
BLOCK_SIZE = 16
MAX_MODEL_LEN = 131072
DTYPE = torch.bfloat16


def _max_tokens() -> int:
    from tpguide.engine.config import MAX_NUM_BATCHED_TOKENS

    return MAX_NUM_BATCHED_TOKENS


def _launch_all(shape_name: str, kernels: str):
    def case(device):
        from triton_offsets import checked_launches

        from tpguide.kernels.triton_path import forced_triton_path

        hidden, heads, kv_heads, head_dim, inter, vocab = SHAPES[shape_name]
        tokens = _max_tokens()
        with checked_launches() as run, forced_triton_path():
            for launch in LAUNCHES[kernels]:
                launch(run, tokens, hidden, heads, kv_heads, head_dim, inter, vocab)
        assert not run.problems, "\n".join(run.problems)
        assert run.kernels, "no kernel ran"
        print(f"  {shape_name} {kernels}: {sorted(set(run.kernels))}", flush=True)
    return case


def _linear_layers(run, tokens, hidden, heads, kv_heads, head_dim, inter, vocab):
    """qkv_proj, gate_up_proj and the LM head (column-parallel), o_proj and down_proj's unit partials and sums."""
    from tpguide.kernels.matmul_fixed_tiling_triton import linear_fixed_tiling
    from tpguide.model.invariant_reduce import reduction_block_size, sum_units_fixed_order_cuda, unit_partials

    x = run.fake((tokens, hidden), DTYPE)
    for width in ((heads + 2 * kv_heads) * head_dim, 2 * inter, vocab):
        linear_fixed_tiling(x, run.fake((width, hidden), DTYPE), DTYPE)
    for units, width in ((heads, heads * head_dim), (inter // reduction_block_size(inter, 1), inter)):
        partials = unit_partials(run.fake((tokens, width), DTYPE), run.fake((hidden, width), DTYPE), units, None)
        assert partials.shape == (units, tokens, hidden)
        sum_units_fixed_order_cuda(partials, DTYPE)


def _elementwise(run, tokens, hidden, heads, kv_heads, head_dim, inter, vocab):
    """The residual add + RMSNorm and SiLU-and-multiply."""
    from tpguide.kernels.rms_norm_triton import rms_norm_triton
    from tpguide.kernels.silu_and_mul_triton import silu_and_mul_triton

    x = run.fake((tokens, hidden), DTYPE)
    rms_norm_triton(x, run.fake((hidden,), DTYPE), 1e-6, residual=run.fake((tokens, hidden), DTYPE))
    silu_and_mul_triton(run.fake((tokens, 2 * inter), DTYPE))


def _attention(run, tokens, hidden, heads, kv_heads, head_dim, inter, vocab):
    """RoPE (alone, and with the KV-cache write), the KV-cache write, paged attention over the largest pool."""
    from tpguide.kernels.kv_cache_write_triton import write_kv_cache_
    from tpguide.kernels.paged_attention_triton import paged_attention_fixed_order
    from tpguide.kernels.rotary_triton import rotary_and_cache_write_triton, rotary_triton

    q, k, v = (run.fake((tokens, h, head_dim), DTYPE) for h in (heads, kv_heads, kv_heads))
    cos, sin = (run.fake((tokens, 1, head_dim), DTYPE) for _ in range(2))
    k_cache, v_cache = (run.fake((NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim), DTYPE) for _ in range(2))
    last_slot = NUM_BLOCKS * BLOCK_SIZE - 1
    slots = run.fake((tokens,), torch.int64, fill=last_slot)  # every token written to the pool's last row
    rotary_triton(q, k, cos, sin)
    rotary_and_cache_write_triton(q, k, v, cos, sin, k_cache, v_cache, slots)
    write_kv_cache_(k, v, k_cache, v_cache, slots)
    max_seqs = 1024
    tables = run.fake((max_seqs, math.ceil(MAX_MODEL_LEN / BLOCK_SIZE)), torch.int32, fill=NUM_BLOCKS - 1)
    seq_index = run.fake((tokens,), torch.int32, fill=max_seqs - 1)
    # the last position of the longest sequence: one chunk of keys (its block id is the fill, the pool's last)
    positions = run.fake((tokens,), torch.int32, fill=MAX_MODEL_LEN - 1)
    paged_attention_fixed_order(q, k_cache, v_cache, tables, seq_index, positions, scale=head_dim ** -0.5,
                                sliding_window=16)


def _sampling(run, tokens, hidden, heads, kv_heads, head_dim, inter, vocab):
    """The bitmask on every row's logits, and the sampler's row reductions (logsumexp, cumulative sums)."""
    from tpguide.kernels.apply_token_bitmask_triton import apply_token_bitmask_inplace_triton
    from tpguide.kernels.row_reductions_triton import cumsum_rows, logsumexp_rows

    logits = run.fake((tokens, vocab), torch.float32)
    words = -(-vocab // 32)
    apply_token_bitmask_inplace_triton(logits, run.fake((tokens, words), torch.int32),
                                       token_mask=run.fake((tokens,), torch.int32, fill=1))
    apply_token_bitmask_inplace_triton(logits, run.fake((tokens, words), torch.int32, fill=0),
                                       d2t=run.fake((vocab,), torch.int32, fill=0))
    logsumexp_rows(logits)
    cumsum_rows(logits)


LAUNCHES = {
    "linear": [_linear_layers],
    "elementwise": [_elementwise],
    "attention": [_attention],
    "sampling": [_sampling],
}

CASES = {f"{shape}-{group}": _launch_all(shape, group) for shape in SHAPES for group in LAUNCHES}


def _wrapped_case(device):
    """The checker itself: a kernel computing ``u * stride_u`` in int32 at 3 units 2**31 - 1024 apart is caught."""
    import triton
    import triton.language as tl
    from triton_offsets import checked_launches

    @triton.jit
    def wrapping(p_ptr, out_ptr, U, stride_u):
        acc = tl.load(p_ptr)
        for u in range(1, U):
            acc += tl.load(p_ptr + u * stride_u)  # int32 * int32: the bug this test exists for
        tl.store(out_ptr, acc)

    with checked_launches() as run:
        stride = (1 << 31) - 1024
        p = run.fake((3, stride), torch.float32)
        wrapping[(1,)](p, run.fake((1,), torch.float32), 3, stride)
    assert any("multiply gives" in text and "int32" in text for text in run.problems), run.problems
    assert any("outside" in text for text in run.problems), run.problems


CASES["checker-catches-wrap"] = _wrapped_case


def test_checker_catches_a_wrapped_offset():
    check_in_child(__file__, ["checker-catches-wrap"])


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_step_kernels_have_no_int_overflow_at_real_sizes(shape):
    check_in_child(__file__, [f"{shape}-{group}" for group in LAUNCHES], timeout_s=600)


if __name__ == "__main__":
    run_cases(CASES)

"""The Triton backend against the reference, bit for bit.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` in a child process
(``tests/triton_interpreted.py``; Triton
reads the variable when the kernel is decorated, so it cannot be switched on
inside a pytest worker that may already hold the compiled kernel, and it must
not leak into CUDA tests).  With a GPU the same cases also run in process on
the real compiled kernel, plus a case whose element offsets pass 2**31.

Run the interpreted cases directly with
``TRITON_INTERPRET=1 python tests/test_kernels_triton.py``.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_cases import (
    assert_bits_equal,
    check_against_reference,
    check_d2t_shards,
    check_shards,
    make_bitmask,
)
from triton_interpreted import check_in_child, run_cases

pytest.importorskip("triton")
f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


def _odd(vocab, dtype, strided, token_mask=False, rows=3):
    return lambda device: check_against_reference(
        "triton", num_rows=rows, width=vocab, num_words=-(-vocab // 32), dtype=dtype, device=device,
        strided=strided, token_mask=token_mask, pad_ones_from=vocab)


def _words(width, num_words):
    return lambda device: check_against_reference(
        "triton", num_rows=4, width=width, num_words=num_words, dtype=f32, device=device, strided=True)


def _block_size(block_size):
    def case(device):
        from tpguide.kernels import apply_token_bitmask_inplace
        from tpguide.kernels.apply_token_bitmask_triton import apply_token_bitmask_inplace_triton
        bitmask = make_bitmask(3, 5, device=device, strided=True)
        logits = torch.randn(3, 150, device=device)
        expected = logits.clone()
        apply_token_bitmask_inplace(expected, bitmask, backend="reference")
        apply_token_bitmask_inplace_triton(logits, bitmask, block_size=block_size)
        assert_bits_equal(logits, expected)
    return case


CASES = {
    "odd-32001-f32-strided": _odd(32001, f32, True),
    "odd-32011-bf16": _odd(32011, bf16, False, rows=2),
    "odd-49157-f16-strided-token-mask": _odd(49157, f16, True, token_mask=True),
    "small-2053-bf16-token-mask": _odd(2053, bf16, True, token_mask=True, rows=7),
    "words-100x3": _words(100, 3),
    "words-100x5-past-width": _words(100, 5),
    "words-31x1": _words(31, 1),
    "words-1000x0-none": _words(1000, 0),
    "block-32": _block_size(32),
    "block-4096": _block_size(4096),
    **{f"tp{tp}-32001-f16": (lambda tp: lambda device: check_shards("triton", 32001, tp, f16, device, 2))(tp)
       for tp in (2, 3, 4)},
    **{f"d2t-tp{tp}-{str(dt)[6:]}": (lambda tp, dt: lambda device: check_d2t_shards(
        "triton", 600, tp, dt, device, token_mask=tp == 2))(tp, dt)
       for tp, dt in ((1, f32), (2, bf16), (3, f16), (4, f32))},
}


def test_triton_interpreted_on_cpu():
    check_in_child(__file__, list(CASES))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_triton_cuda(name):
    CASES[name]("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_cuda_64bit_offsets():
    """14200 rows x 151936 bf16: the last rows start past element 2**31."""
    from tpguide.kernels import apply_token_bitmask_inplace
    rows, vocab = 14200, 151936
    assert rows * vocab > 2**31
    if torch.cuda.get_device_properties(0).total_memory < 8 * 2**30:
        pytest.skip("needs 8 GiB of GPU memory")
    logits = torch.zeros(rows, vocab, dtype=bf16, device="cuda")
    bitmask = torch.full((rows, vocab // 32), -1, dtype=torch.int32, device="cuda")
    bitmask[-1, -1] = 0x7FFFFFFF  # only the last token of the last row is disallowed
    bitmask[-2, 0] = -2  # first token of the second to last row
    apply_token_bitmask_inplace(logits, bitmask, backend="triton")
    assert torch.isneginf(logits[-1, -1]) and torch.isneginf(logits[-2, 0])
    assert int(torch.isneginf(logits).sum()) == 2


if __name__ == "__main__":
    run_cases(CASES)

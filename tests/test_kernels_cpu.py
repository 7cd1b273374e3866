"""The C CPU backend against the reference, bit for bit; its compile cache and its fallback."""

from __future__ import annotations

import pytest
import torch
from test_kernels_cases import (
    DTYPES,
    ODD_VOCABS,
    assert_bits_equal,
    check_against_reference,
    check_d2t_shards,
    check_shards,
    make_bitmask,
)

import tpguide.kernels.apply_token_bitmask_cpu as cpu_backend
from tpguide.kernels import apply_token_bitmask_inplace, c_library
from tpguide.kernels.apply_token_bitmask import resolve_backend


@pytest.fixture(scope="module", autouse=True)
def needs_kernel():
    if cpu_backend.load_cpu_kernel() is None:
        pytest.skip(f"C kernel unavailable: {cpu_backend.cpu_kernel_error()}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", ODD_VOCABS)
@pytest.mark.parametrize("strided", [False, True])
def test_odd_vocab_matches_reference(dtype, vocab, strided):
    """Padding bits past the vocab are set: they must not count."""
    check_against_reference("cpu", num_rows=5, width=vocab, num_words=-(-vocab // 32), dtype=dtype,
                            device="cpu", strided=strided, pad_ones_from=vocab)


@pytest.mark.parametrize("width,num_words", [(100, 3), (100, 5), (64, 2), (31, 1), (1000, 0), (1, 1), (33, 40)])
def test_width_and_word_count_mismatch(width, num_words):
    check_against_reference("cpu", num_rows=4, width=width, num_words=num_words, dtype=torch.float32,
                            device="cpu", strided=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strided", [False, True])
def test_token_mask_leaves_rows_untouched(dtype, strided):
    check_against_reference("cpu", num_rows=7, width=32011, num_words=1001, dtype=dtype, device="cpu",
                            strided=strided, token_mask=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_word_pattern(dtype):
    """Runs of all-ones / all-zeros / mixed words of every length: both mixed-word paths."""
    g = torch.Generator().manual_seed(5)
    kind = torch.randint(0, 3, (64, 300), generator=g)
    kind[:, ::7] = 2  # mixed runs of length 1 between other kinds
    random = torch.randint(-(2**31), 2**31 - 1, kind.shape, dtype=torch.int32, generator=g)
    bitmask = torch.where(kind == 0, -1, torch.where(kind == 1, 0, random)).int()
    logits = torch.randn(64, 300 * 32 - 5, generator=g).to(dtype)
    expected = logits.clone()
    apply_token_bitmask_inplace(expected, bitmask, backend="reference")
    apply_token_bitmask_inplace(logits, bitmask, backend="cpu")
    assert_bits_equal(logits, expected)


@pytest.mark.parametrize("org_vocab_size", [32001, 49157])
@pytest.mark.parametrize("tp_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_tp_shards_compose(org_vocab_size, tp_size, dtype):
    check_shards("cpu", org_vocab_size, tp_size, dtype, "cpu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp_size", [1, 2, 3, 4])
def test_d2t_shards_compose(dtype, tp_size):
    """Rank 0 and ranks > 0 (draft_vocab_start_index > 0), target ids past the bitmask."""
    check_d2t_shards("cpu", 600, tp_size, dtype, "cpu", token_mask=tp_size == 2)


def test_d2t_strided_bitmask_and_negative_targets():
    bitmask = make_bitmask(3, 6, seed=2, strided=True)
    d2t = torch.tensor([-5, 0, 3, -1, 200, 1] * 8, dtype=torch.int32)[::2]  # strided [24]
    logits = torch.randn(3, 24)
    expected = logits.clone()
    apply_token_bitmask_inplace(expected, bitmask, d2t=d2t, draft_vocab_start_index=2, backend="reference")
    apply_token_bitmask_inplace(logits, bitmask, d2t=d2t, draft_vocab_start_index=2, backend="cpu")
    assert_bits_equal(logits, expected)


def test_d2t_targets_at_the_bitmask_edge():
    """Target id 32 * num_words (and -1) is disallowed even when the memory past the words is all ones."""
    wide = torch.full((2, 5), -1, dtype=torch.int32)
    bitmask = wide[:, :3]  # num_bits = 96; wide[:, 3] = -1 must never be read
    d2t = torch.tensor([96, 95, -1, 97, 0, 127], dtype=torch.int32) - torch.arange(6, dtype=torch.int32)
    logits = torch.zeros(2, 6)
    apply_token_bitmask_inplace(logits, bitmask, d2t=d2t, backend="cpu")
    expected = torch.tensor([float("-inf"), 0, float("-inf"), float("-inf"), 0, float("-inf")])
    assert torch.equal(logits, expected.expand(2, 6))


def test_transposed_bitmask_and_strided_token_mask():
    bitmask = make_bitmask(5, 4, seed=7).t().contiguous().t()  # column-major words
    token_mask = torch.tensor([1, 0, 1, 1, 0, 1, 1, 0, 1, 1], dtype=torch.int32)[::2]
    logits = torch.randn(5, 120)
    expected = logits.clone()
    apply_token_bitmask_inplace(expected, bitmask, token_mask=token_mask, backend="reference")
    apply_token_bitmask_inplace(logits, bitmask, token_mask=token_mask, backend="cpu")
    assert_bits_equal(logits, expected)


def test_non_contiguous_columns_fall_back_to_torch():
    guard = torch.randn(3, 200)
    logits = guard[:, ::2]  # column stride 2: not for the C kernel
    expected = guard.clone()
    bitmask = make_bitmask(3, 4, seed=1)
    apply_token_bitmask_inplace(expected[:, ::2], bitmask, backend="reference")
    apply_token_bitmask_inplace(logits, bitmask, backend="cpu")
    assert_bits_equal(guard, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_logits_kept_when_allowed(dtype):
    logits = torch.full((2, 64), float("nan"), dtype=dtype)
    bitmask = torch.tensor([[0x0000FFFF, -1], [0, 0x7FFFFFFF]], dtype=torch.int32)
    nan_bits = logits.view(torch.int32 if dtype == torch.float32 else torch.int16)[0, 0].item()
    apply_token_bitmask_inplace(logits, bitmask, backend="cpu")
    assert torch.isneginf(logits[0, 16:32]).all() and torch.isneginf(logits[1, :32]).all()
    assert torch.isneginf(logits[1, 63])
    kept = torch.cat([logits[0, :16], logits[0, 32:], logits[1, 32:63]])
    assert (kept.view(torch.int32 if dtype == torch.float32 else torch.int16) == nan_bits).all()


def test_auto_resolves_to_cpu():
    assert resolve_backend("auto", "cpu") == "cpu"
    assert resolve_backend("torch", "cpu") == "torch"


def test_cuda_tensors_rejected():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with pytest.raises(ValueError, match="needs CPU tensors"):
        apply_token_bitmask_inplace(torch.zeros(1, 32, device="cuda"),
                                    torch.zeros(1, 1, dtype=torch.int32, device="cuda"), backend="cpu")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty kernel cache and a module that has not tried to load the kernel yet."""
    monkeypatch.setenv("TPGUIDE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_backend, "_STATE", None)
    return tmp_path / "kernels"


def test_compile_cache_is_reused(fresh_cache, monkeypatch):
    assert cpu_backend.load_cpu_kernel() is not None
    built = list(fresh_cache.glob("*.so"))
    assert len(built) == 1 and not list(fresh_cache.glob(".*")), list(fresh_cache.iterdir())
    monkeypatch.setattr(cpu_backend, "_STATE", None)

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again despite a cached library")

    monkeypatch.setattr(cpu_backend.subprocess, "run", no_compiler)
    assert cpu_backend.load_cpu_kernel() is not None
    assert list(fresh_cache.glob("*.so")) == built


def test_cache_key_changes_with_flags(fresh_cache):
    cc = c_library.compiler()
    path = c_library.library_path(cpu_backend.SOURCE, cc, cpu_backend.CFLAGS)
    other = c_library.library_path(cpu_backend.SOURCE, cc, (*cpu_backend.CFLAGS, "-DEXTRA"))
    assert other != path and other.parent == path.parent == fresh_cache


def test_broken_compiler_falls_back_to_torch(fresh_cache, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")
    with caplog.at_level("DEBUG", logger=cpu_backend.__name__):
        assert resolve_backend("auto", "cpu") == "torch"
    assert "exited with 1" in cpu_backend.cpu_kernel_error()
    assert any("using the torch path" in r.message for r in caplog.records)
    assert not list(fresh_cache.glob("*"))  # no library, no temporary left behind
    bitmask = make_bitmask(3, 4, seed=3)
    logits = torch.randn(3, 100)
    expected = logits.clone()
    apply_token_bitmask_inplace(expected, bitmask, backend="reference")
    apply_token_bitmask_inplace(logits, bitmask)  # auto -> torch
    assert_bits_equal(logits, expected)
    with pytest.raises(RuntimeError, match="C CPU bitmask kernel is unavailable"):
        apply_token_bitmask_inplace(logits, bitmask, backend="cpu")

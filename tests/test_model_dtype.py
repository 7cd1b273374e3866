"""``--dtype auto`` resolution (tpguide.model.dtype)."""

import json

import pytest
import torch

from tpguide.model import dtype as dtype_mod
from tpguide.model.dtype import checkpoint_dtype, cpu_has_native_bf16, resolve_dtype


def test_explicit_names_are_taken_as_given():
    assert resolve_dtype("float32", "cpu") is torch.float32
    assert resolve_dtype("bfloat16", "cuda", torch.float32) is torch.bfloat16
    with pytest.raises(ValueError, match="'int8'"):
        resolve_dtype("int8", "cpu")


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("avx2", [True, False])
@pytest.mark.parametrize("fixed_order", [True, False])
def test_auto_on_cpu_follows_the_bf16_capability_and_the_kernels(monkeypatch, native, avx2, fixed_order):
    """bf16 with native bf16 matmul; with the fixed-order kernels also on AVX2 + FMA (they widen bf16 exactly)."""
    monkeypatch.setattr(dtype_mod, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(dtype_mod, "cpu_has_avx2_fma", lambda: avx2)
    want = torch.bfloat16 if native or (fixed_order and avx2) else torch.float32
    assert resolve_dtype("auto", "cpu", torch.float16, fixed_order=fixed_order) is want


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_on_cuda_is_vllms(monkeypatch, bf16):
    """16-bit checkpoints keep their dtype, fp32 or unnamed ones run in bf16; fp16 on a GPU without bf16."""
    monkeypatch.setattr(dtype_mod, "cuda_has_bf16", lambda device: bf16)
    half = torch.bfloat16 if bf16 else torch.float16
    assert resolve_dtype("auto", "cuda", torch.bfloat16) is half
    assert resolve_dtype("auto", "cuda", torch.float16) is torch.float16
    assert resolve_dtype("auto", "cuda", torch.float32) is half
    assert resolve_dtype("auto", torch.device("cuda", 0), None) is half
    assert resolve_dtype("float32", "cuda", torch.bfloat16) is torch.float32  # explicit: as given


def test_this_machine_capability_matches_cpuinfo():
    flags = open("/proc/cpuinfo").read().split() if __import__("os").path.exists("/proc/cpuinfo") else None
    if flags is None:
        pytest.skip("no /proc/cpuinfo")
    assert cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_tile" in flags)


@pytest.mark.parametrize("key,value,want", [("dtype", "bfloat16", torch.bfloat16),
                                            ("torch_dtype", "float16", torch.float16),
                                            ("dtype", "float32", torch.float32)])
def test_checkpoint_dtype_reads_config(tmp_path, key, value, want):
    (tmp_path / "config.json").write_text(json.dumps({key: value}))
    assert checkpoint_dtype(tmp_path) is want


def test_checkpoint_dtype_absent_or_bad(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_dtype(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "int3"}))
    with pytest.raises(ValueError, match="int3"):
        checkpoint_dtype(tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        checkpoint_dtype(tmp_path / "missing")

"""The CPU KV pool from an anonymous mmap reads as zeros, has the model's dtype and shape, and changes no output."""

import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.model.attention import AttentionMetadata
from tpguide.model.loader import load_model
from tpguide.model.random_checkpoint import write_random_checkpoint
from tpguide.model.zeroed_pool import zeroed_pool

CPU = torch.device("cpu")
VOCAB = 512
BLOCK = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("zeroed_pool"), vocab_size=VOCAB, seed=5)


def _all_zero_bytes(t):
    return not t.view(torch.uint8).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_zeroed_pool_is_zero_contiguous_aligned_and_writable(dtype):
    pool = zeroed_pool([33, 16, 3, 64], dtype, CPU)
    assert pool.shape == (33, 16, 3, 64) and pool.dtype == dtype and pool.device == CPU and pool.is_contiguous()
    assert pool.data_ptr() % 4096 == 0  # page-aligned (the kernels' vector loads want at least 64)
    assert _all_zero_bytes(pool)  # every bit zero: +0, never -0 or a NaN
    pool[32, 15, 2, 63] = 7
    pool[0, 0, 0, 0] = 3
    assert pool.sum().item() == 10 and pool.view(-1)[-1].item() == 7  # the last byte is mapped
    with pytest.raises(RuntimeError, match="not resizable"):
        pool.resize_(10 ** 9)


def test_zeroed_pool_empty_shape_and_bad_shape():
    assert zeroed_pool([0, 16, 3, 64], torch.bfloat16, CPU).shape == (0, 16, 3, 64)
    with pytest.raises(ValueError, match=r"\(2, -1\)"):
        zeroed_pool([2, -1], torch.float32, CPU)


def test_a_pool_larger_than_the_available_memory_fails_at_start(monkeypatch, tmp_path, ckpt):
    import tpguide.model.zeroed_pool as zp

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:       1024 kB\n")
    assert zp.available_memory_bytes(str(meminfo)) == 1024 * 1024
    assert zp.available_memory_bytes(str(tmp_path / "absent")) is None
    monkeypatch.setattr(zp, "available_memory_bytes", lambda: 1024 * 1024)
    with pytest.raises(MemoryError, match=r"needs 2 MiB .* 1 MiB available"):
        zp.check_pool_fits_memory(2 * 2**20, "a test")
    zp.check_pool_fits_memory(2**20, "a test")  # 1 MiB fits
    # the whole pool counts, every layer's K and V: each tensor alone fits here, all of them do not
    model = load_model(ckpt, TPGroup(), torch.float32)
    blocks = 1024 * 1024 // model.kv_cache_block_bytes(BLOCK) + 1
    assert 2 * len(model.model.layers) > 1 and blocks * model.kv_cache_block_bytes(BLOCK) > 2**20
    with pytest.raises(MemoryError, match=rf"{blocks} blocks of {BLOCK} tokens, {len(model.model.layers)} layers"):
        model.allocate_kv_cache(blocks, BLOCK, 16)
    model.allocate_kv_cache(blocks - 1, BLOCK, 16)


def test_zeroed_pool_off_the_cpu_is_torch_zeros():
    pool = zeroed_pool([2, 3], torch.bfloat16, torch.device("meta"))
    assert pool.device.type == "meta" and pool.shape == (2, 3) and pool.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_allocate_kv_cache_gives_zeroed_pools_again_after_writes(ckpt, dtype):
    model = load_model(ckpt, TPGroup(), dtype)
    model.allocate_kv_cache(5, BLOCK, 16)
    attn = model.model.layers[0].self_attn.attn
    shape = (5, BLOCK, model.num_local_kv_heads, model.config.head_dim)
    for layer in model.model.layers:
        for pool in (layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache):
            assert pool.shape == shape and pool.dtype == dtype and pool.data_ptr() % 4096 == 0
            assert _all_zero_bytes(pool)
    attn.k_cache.fill_(1)
    model.allocate_kv_cache(7, BLOCK, 16)  # replaces the pool: a fresh one, zero again
    assert attn.k_cache.shape[0] == 7 and _all_zero_bytes(attn.k_cache) and _all_zero_bytes(attn.v_cache)


def _logits(model):
    """Two steps (a prefill of 2 sequences over shuffled blocks, then a decode of each)."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, VOCAB, (9,), generator=g).tolist(), torch.randint(0, VOCAB, (5,), generator=g).tolist()
    tables = [[6, 1, 4], [0, 7]]
    out = []
    for q, c, ids in (([9, 5], [0, 0], a + b), ([1, 1], [9, 5], [11, 12])):
        meta = AttentionMetadata.from_block_tables(tables, q, c, block_size=BLOCK)
        out.append(model.compute_logits(model(torch.tensor(ids), meta.token_positions, meta)))
    return out


@pytest.mark.parametrize("tp_invariant", [True, False], ids=["fixed-order", "sdpa"])
def test_outputs_equal_a_torch_zeros_pool(ckpt, tp_invariant, monkeypatch):
    model = load_model(ckpt, TPGroup(), tp_invariant=tp_invariant)
    model.allocate_kv_cache(8, BLOCK, 16)
    assert not model.model.layers[0].self_attn.attn.k_cache.untyped_storage().resizable()  # the mmap
    mapped = _logits(model)
    monkeypatch.setattr("tpguide.model.llama.zeroed_pool",
                        lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
    model.allocate_kv_cache(8, BLOCK, 16)
    assert model.model.layers[0].self_attn.attn.k_cache.untyped_storage().resizable()  # torch's own memory
    for m, z in zip(mapped, _logits(model)):
        assert torch.equal(m, z)

"""The fixed-order Triton paged attention and KV-cache write (the CUDA path) against a torch oracle, and bit for bit.

As in ``test_kernels_matmul_fixed_tiling.py``, on CPU the kernels run under
``TRITON_INTERPRET=1`` in a child process (``tests/triton_interpreted.py``);
with a GPU the same cases also run compiled.  Checks: values against an
fp64 oracle (GQA, sliding window, soft-cap, three dtypes), and bit for bit
the properties the model relies on: a token's row alone equals its row
among random other sequences and padding rows, chunked prefill equals
one-shot prefill, and moving a sequence's blocks elsewhere in the pool
changes nothing.

Run the interpreted cases directly with
``TRITON_INTERPRET=1 python tests/test_kernels_paged_attention.py [NAME...]``.
"""

from __future__ import annotations

import random

import pytest
import torch
from triton_interpreted import check_in_child, run_cases

pytest.importorskip("triton")

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
BLOCK_SIZE, NUM_BLOCKS = 8, 40


def _randn(*shape, dtype, device, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def _tables(lengths, rng):
    """Random, disjoint block placements: ``[[block ids of sequence s]]`` covering each length."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    return [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in lengths]


def _as_tensor(tables, device):
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)


def _oracle(q, k_cache, v_cache, tables, seq, pos, scale, window=None, softcap=None):
    """fp64 attention per token, keys gathered by hand; zero rows for position < 0."""
    t_count, h, d = q.shape
    group = h // k_cache.shape[2]
    flat_k = k_cache.double().flatten(0, 1)
    flat_v = v_cache.double().flatten(0, 1)
    out = torch.zeros(t_count, h, d, dtype=torch.float64)
    for t in range(t_count):
        p = int(pos[t])
        if p < 0:
            continue
        lo = 0 if window is None else max(0, p - window + 1)
        j = torch.arange(lo, p + 1)
        rows = torch.tensor(tables[int(seq[t])])[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE
        keys = flat_k[rows].repeat_interleave(group, dim=1)  # [n, H, D]
        values = flat_v[rows].repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[t].double(), keys) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        out[t] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), values)
    return out


def _against_oracle(dtype, heads, kv_heads, head_dim, window=None, softcap=None):
    def case(device):
        from tpguide.kernels.paged_attention_triton import paged_attention_fixed_order
        rng = random.Random(1)
        lengths = [45, 3, 70]
        tables = _tables(lengths, rng)
        k_cache = _randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=device, seed=2)
        v_cache = _randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=device, seed=3)
        seq = [0] * 5 + [1] + [2] * 4 + [0]
        pos = [0, 1, 20, 33, 44, 2, 5, 40, 64, 69, -1]  # a padding row last
        q = _randn(len(seq), heads, head_dim, dtype=dtype, device=device, seed=4)
        scale = head_dim ** -0.5
        got = paged_attention_fixed_order(q, k_cache, v_cache, _as_tensor(tables, device),
                                          torch.tensor(seq, dtype=torch.int32, device=device),
                                          torch.tensor(pos, dtype=torch.int32, device=device), scale,
                                          sliding_window=window, logit_softcap=softcap)
        want = _oracle(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables, seq, pos, scale, window, softcap)
        assert got.dtype == dtype and got.shape == q.shape
        tol = {f32: 2e-5, bf16: 2e-2, f16: 4e-3}[dtype]
        torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)
        assert torch.equal(got[-1], torch.zeros_like(got[-1]))
    return case


def _batch_composition(dtype, window):
    """Property: a sequence's rows alone == its rows in random batches with padding, any table order."""
    def case(device):
        from tpguide.kernels.paged_attention_triton import paged_attention_fixed_order
        heads, kv_heads, head_dim = 6, 2, 16
        rng = random.Random(7)
        lengths = [37, 9, 64, 1, 50]
        tables = _tables(lengths, rng)
        k_cache = _randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=device, seed=8)
        v_cache = _randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=device, seed=9)
        q_all = [_randn(n, heads, head_dim, dtype=dtype, device=device, seed=10 + s) for s, n in enumerate(lengths)]

        def run(order, chunks, padding):
            """Attend ``chunks[s]`` (positions) of each sequence in ``order``; padding rows at random places."""
            rows, seq, pos = [], [], []
            for row, s in enumerate(order):
                for p in chunks[s]:
                    rows.append(q_all[s][p])
                    seq.append(row)
                    pos.append(p)
            for _ in range(padding):
                i = rng.randrange(len(rows) + 1)
                rows.insert(i, torch.full_like(q_all[0][0], 9.0))
                seq.insert(i, 0)
                pos.insert(i, -1)
            out = paged_attention_fixed_order(
                torch.stack(rows), k_cache, v_cache, _as_tensor([tables[s] for s in order], device),
                torch.tensor(seq, dtype=torch.int32, device=device), torch.tensor(pos, dtype=torch.int32,
                                                                                   device=device),
                head_dim ** -0.5, sliding_window=window)
            return {(order[seq[i]], pos[i]): out[i] for i in range(len(pos)) if pos[i] >= 0}, out, pos

        for trial in range(4):
            target = rng.randrange(len(lengths))
            n = lengths[target]
            start = rng.randrange(n)
            chunk = list(range(start, n)) if trial % 2 else [n - 1]  # a prefill chunk, or one decode token
            alone, _, _ = run([target], {target: chunk}, padding=0)
            others = [s for s in range(len(lengths)) if s != target]
            order = rng.sample(others, rng.randrange(1, len(others) + 1)) + [target]
            rng.shuffle(order)
            chunks = {s: list(range(rng.randrange(lengths[s]), lengths[s])) for s in order}
            chunks[target] = chunk
            batched, out, pos = run(order, chunks, padding=rng.randrange(1, 4))
            for key, row in alone.items():
                assert torch.equal(batched[key], row), (trial, key)
            pad = torch.tensor([p < 0 for p in pos])
            assert torch.equal(out[pad.to(out.device)], torch.zeros_like(out[pad.to(out.device)]))
    return case


def _chunked_prefill_and_placement(dtype):
    """Chunked prefill (k/v written chunk by chunk, padding slots -1) == one-shot; other block placement == same."""
    def case(device):
        from tpguide.kernels.kv_cache_write_triton import write_kv_cache_
        from tpguide.kernels.paged_attention_triton import paged_attention_fixed_order
        heads, kv_heads, head_dim, n = 4, 2, 24, 71
        q = _randn(n, heads, head_dim, dtype=dtype, device=device, seed=20)
        k = _randn(n, kv_heads, head_dim, dtype=dtype, device=device, seed=21)
        v = _randn(n, kv_heads, head_dim, dtype=dtype, device=device, seed=22)

        def prefill(table, chunks):
            k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=device)
            v_cache = torch.zeros_like(k_cache)
            tab = _as_tensor([table], device)
            outs = []
            for lo, hi in chunks:
                pos = torch.arange(lo, hi + 1, device=device)
                pos[-1] = -1  # a padding row after each chunk
                slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(lo, hi)]
                                     + [-1], device=device)
                pad = lambda x: torch.cat([x[lo:hi], torch.full_like(x[:1], 5.0)])  # noqa: E731
                before = k_cache.clone()
                write_kv_cache_(pad(k), pad(v), k_cache, v_cache, slots)
                changed = (k_cache != before).flatten(2).any(-1).flatten()  # [pool rows]
                assert set(changed.nonzero().flatten().tolist()) <= set(slots[:-1].tolist())
                seq = torch.zeros(hi - lo + 1, dtype=torch.int32, device=device)
                out = paged_attention_fixed_order(pad(q), k_cache, v_cache, tab, seq, pos.to(torch.int32),
                                                  head_dim ** -0.5)
                assert torch.equal(out[-1], torch.zeros_like(out[-1]))
                outs.append(out[:-1])
            assert torch.equal(k_cache.flatten(0, 1)[slots_of(table)], k)
            return torch.cat(outs)

        def slots_of(table):
            return torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)])

        rng = random.Random(3)
        table, moved = _tables([n], rng)[0], _tables([n], rng)[0]
        one_shot = prefill(table, [(0, n)])
        assert torch.equal(prefill(table, [(0, 5), (5, 40), (40, 41), (41, n)]), one_shot)
        assert torch.equal(prefill(moved, [(0, 33), (33, n)]), one_shot)
    return case


def _errors(device):
    from tpguide.kernels.kv_cache_write_triton import write_kv_cache_
    from tpguide.kernels.paged_attention_triton import paged_attention_fixed_order
    cache = torch.zeros(2, 4, 2, 8, device=device)
    idx = torch.zeros(3, dtype=torch.int32, device=device)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="num_heads % num_kv_heads"):
        paged_attention_fixed_order(torch.zeros(3, 3, 8, device=device), cache, cache, tables, idx, idx, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention_fixed_order(torch.zeros(3, 4, 8, device=device, dtype=bf16), cache, cache, tables, idx, idx, 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache_(torch.zeros(3, 2, 8, device=device), torch.zeros(3, 2, 8, device=device), cache, cache,
                        torch.zeros(2, dtype=torch.int64, device=device))
    empty = paged_attention_fixed_order(torch.zeros(0, 4, 8, device=device), cache, cache, tables, idx[:0], idx[:0], 1.0)
    assert empty.shape == (0, 4, 8)


CASES = {
    "oracle-f32-gqa3": _against_oracle(f32, 6, 2, 16),
    "oracle-bf16-window": _against_oracle(bf16, 4, 2, 32, window=19),
    "oracle-f16-softcap": _against_oracle(f16, 4, 4, 16, softcap=5.0),
    "oracle-f32-odd-dim-window-softcap": _against_oracle(f32, 3, 1, 20, window=40, softcap=30.0),
    "batch-composition-bf16": _batch_composition(bf16, None),
    "batch-composition-f32-window": _batch_composition(f32, 24),
    "chunked-prefill-bf16": _chunked_prefill_and_placement(bf16),
    "chunked-prefill-f16": _chunked_prefill_and_placement(f16),
    "errors": _errors,
}


def test_paged_attention_interpreted_on_cpu():
    check_in_child(__file__, list(CASES))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_cuda(name):
    CASES[name]("cuda")


if __name__ == "__main__":
    run_cases(CASES)

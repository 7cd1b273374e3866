"""A row's logits do not depend on its batch, its chunking, a verify pass, the threads, the tp size or the ISA.

``torch.equal``, never a tolerance (docs/architecture.md §6, "Fixed-order reductions").
One job per (model, tp size) runs, in fp32 and bf16 and at 1 and 2 threads per
rank, a target prompt ``S`` and a fixed continuation ``D`` (1 + K tokens):

* **alone**: ``S`` prefilled in one chunk, then ``D`` decoded token by token;
* **chunked**: ``S`` prefilled in chunks of 7 tokens;
* **verify**: ``D`` as one speculative verify pass of 1 + K rows;
* **batched**: ``S``'s prefill and its first decode row inside batches of 2,
  8 and 32 sequences (other prompts of other lengths), at the first, a middle
  and the last position.

Within a job every case must equal "alone"; across jobs each rank's shard
must equal the matching slice of the tp-1 logits at the same thread count.
Models: the tiny random Llama (9 heads / 3 KV heads: padded at tp 2 and 4, an
odd vocabulary: padded at every tp > 1) at tp 1-4, and the embedded
SmolLM2-135M at tp 1 and 2 in bf16 (its tp 3 and 4 shards are checked on two mixed
steps by ``test_tp_invariance.py``).  At tp 1 the tiny model's job runs again (1 thread) with
``ATEN_CPU_CAPABILITY`` forcing each narrower instruction set the CPU has.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_on_ranks
from tpguide.kernels.fixed_order_cpu import OWN_BF16_ORDER_ISAS, choose_isa, cpu_flags
from tpguide.model.attention import AttentionMetadata
from tpguide.model.loader import load_model
from tpguide.model.random_checkpoint import write_random_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
THREADS = (1, 2)
VOCAB = 32011
PROMPT_LEN, CHUNK, K = 20, 7, 4
BATCHES = (2, 8, 32)


def _tokens(n: int, seed: int, vocab: int) -> list:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _forward(model, seqs) -> list:
    """``seqs``: ``(slot, context_len, tokens)`` each; returns each sequence's fp32 logits rows (numpy)."""
    meta = AttentionMetadata.from_lists([s for s, _, _ in seqs], [len(t) for _, _, t in seqs],
                                        [c for _, c, _ in seqs])
    ids = torch.tensor([t for _, _, toks in seqs for t in toks])
    logits = model.compute_logits(model(ids, meta.token_positions, meta)).numpy()
    bounds = meta.query_start_loc.tolist()
    return [logits[a:b] for a, b in zip(bounds, bounds[1:])]


def _cases(model) -> tuple[dict, list]:
    """Logits of ``S`` alone and the list of cases that differ from them."""
    vocab = model.config.org_vocab_size
    s, d = _tokens(PROMPT_LEN, 0, vocab), _tokens(1 + K, 1, vocab)
    alone = {"prefill": _forward(model, [(0, 0, s)])[0][-1]}
    for i, tok in enumerate(d):
        alone[f"decode{i}"] = _forward(model, [(0, PROMPT_LEN + i, [tok])])[0][0]
    bad = []

    def check(name, got, want):
        if not np.array_equal(got, want):
            bad.append(name)

    for start in range(0, PROMPT_LEN, CHUNK):  # chunked prefill into slot 1
        last = _forward(model, [(1, start, s[start:start + CHUNK])])[0][-1]
    check("chunked prefill", last, alone["prefill"])
    check("decode after chunked prefill", _forward(model, [(1, PROMPT_LEN, d[:1])])[0][0], alone["decode0"])
    verify = _forward(model, [(1, PROMPT_LEN, d)])[0]  # 1 + K rows, overwrites the same positions
    for i in range(1 + K):
        check(f"verify row {i}", verify[i], alone[f"decode{i}"])
    for batch in BATCHES:
        for pos in sorted({0, batch // 2, batch - 1}):
            prompts = [_tokens(3 + (7 * j) % 17, 100 + j, vocab) for j in range(batch)]
            prompts[pos] = s
            rows = _forward(model, [(j, 0, p) for j, p in enumerate(prompts)])
            check(f"prefill in batch {batch} at {pos}", rows[pos][-1], alone["prefill"])
            step = [(j, len(p), d[:1] if j == pos else [p[0]]) for j, p in enumerate(prompts)]
            check(f"decode in batch {batch} at {pos}", _forward(model, step)[pos][0], alone["decode0"])
    return alone, bad


def _job(group: TPGroup, model_dir: str, dtypes=tuple(DTYPES), threads_list=THREADS) -> dict:
    """``{(dtype, threads): (alone logits, differing cases)}`` and ``"range"``: this rank's vocab slice."""
    out: dict = {}
    before = torch.get_num_threads()
    try:
        for dtype_name in dtypes:
            model = load_model(model_dir, group, DTYPES[dtype_name], tp_invariant=True)
            model.allocate_kv_cache(max(BATCHES), 64)
            shard = model.vocab_shard
            out["range"] = (shard.vocab_start_index, shard.vocab_end_index)
            for threads in threads_list:
                torch.set_num_threads(threads)
                out[(dtype_name, threads)] = _cases(model)
            del model
    finally:
        torch.set_num_threads(before)
    return out


#: Per model: dtypes and thread counts of its jobs.  The embedded model runs the default dtype of a
#: bf16 CPU only (its fp32 shards are checked on mixed steps by ``test_tp_invariance.py``).
JOB_ARGS = {"tiny": (tuple(DTYPES), THREADS), "embedded": (("bfloat16",), THREADS)}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, default_model_path):
    tiny = write_random_checkpoint(tmp_path_factory.mktemp("batch_inv_ckpt"), vocab_size=VOCAB, seed=7)
    return {"tiny": str(tiny), "embedded": default_model_path}


@pytest.fixture(scope="module")
def references(model_dirs):
    cache: dict = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = _job(TPGroup(), model_dirs[name], *JOB_ARGS[name])
        return cache[name]
    return get


def _assert_no_differing_cases(result: dict, where: str) -> None:
    for key, value in result.items():
        if key != "range":
            assert not value[1], f"{where} {key}: differ from the row alone: {value[1]}"


@pytest.mark.parametrize("name", ["tiny", "embedded"])
def test_tp1_row_independent_of_batch_chunks_verify_and_threads(references, name):
    ref = references(name)
    _assert_no_differing_cases(ref, f"tp 1 {name}")
    for dtype_name in JOB_ARGS[name][0]:
        one, two = ref[(dtype_name, 1)][0], ref[(dtype_name, 2)][0]
        for case in one:
            assert np.array_equal(one[case], two[case]), f"{name} {dtype_name} {case}: 1 and 2 threads differ"


@pytest.mark.parametrize(("name", "tp_size"), [("tiny", 2), ("tiny", 3), ("tiny", 4), ("embedded", 2)])
def test_shards_equal_tp1_in_every_case(references, model_dirs, name, tp_size):
    reference = references(name)
    dtypes, _ = JOB_ARGS[name]  # one thread per rank (tp 1 checks 1 against 2 threads)
    for rank, res in enumerate(run_on_ranks(_job, tp_size, model_dirs[name], dtypes, (1,), timeout_s=900)):
        _assert_no_differing_cases(res, f"tp {tp_size} rank {rank} {name}")
        start, end = res["range"]
        for key, (alone, _) in ((k, v) for k, v in res.items() if k != "range"):
            for case, got in alone.items():
                full = reference[key][0][case]
                width = max(min(end, full.shape[-1]) - start, 0)  # columns the tp-1 row has
                assert np.array_equal(got[:width], full[start:start + width]), \
                    f"tp {tp_size} rank {rank} {name} {key} {case}: logits differ from tp 1"
                assert np.isneginf(got[width:]).all(), f"tp {tp_size} rank {rank}: padded ids must be -inf"


NARROWER_ISAS = [isa for isa in ("avx512", "avx2", "default")
                 if isa != choose_isa(cpu_flags(), None) and choose_isa(cpu_flags(), isa) == isa]


ONEDNN_ISA = {"avx512": "AVX512_CORE", "avx2": "AVX2", "default": "DEFAULT"}
MKL_ISA = {"avx512": "AVX512", "avx2": "AVX2", "default": "SSE4_2"}


@pytest.mark.parametrize("isa", NARROWER_ISAS or [pytest.param("none", marks=pytest.mark.skip(
    reason="the CPU has a single instruction set for the fixed-order kernels"))])
def test_forced_narrower_isa_gives_the_same_bits(references, model_dirs, tmp_path, isa):
    """``ATEN_CPU_CAPABILITY`` (also read by the fixed-order kernels) forces a narrower ISA: same logits.

    The same bits in fp32 always, and in bf16 unless one side multiplies in the instruction's own pair
    order (AMX tiles, VDPBF16PS; not the fmaf chain): then each side is still invariant, checked within
    the job.
    """
    out = tmp_path / "alone.npz"
    code = ("import sys, numpy as np; sys.path.insert(0, sys.argv[1]); "
            "from test_batch_invariance import _job; from tpguide.dist import TPGroup; "
            "from tpguide.kernels.fixed_order_cpu import kernel_isa; "
            "r = _job(TPGroup(), sys.argv[2], threads_list=(1,)); assert kernel_isa() == sys.argv[4], kernel_isa(); "
            "np.savez(sys.argv[3], **{f'{k[0]}|{k[1]}|{c}': v for k, (a, bad) in r.items() if k != 'range' "
            "for c, v in a.items()}, bad=np.array([str(bad) for k, (a, bad) in r.items() if k != 'range' and bad]))")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": isa, "ONEDNN_MAX_CPU_ISA": ONEDNN_ISA[isa],
           "MKL_ENABLE_INSTRUCTIONS": MKL_ISA[isa]}
    subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__), model_dirs["tiny"], str(out), isa],
                   env=env, check=True, timeout=600)
    got = np.load(out)
    assert got["bad"].size == 0, f"ISA {isa}: cases differ from the row alone: {got['bad']}"
    ref = references("tiny")
    own_bf16_order = choose_isa(cpu_flags(), None) in OWN_BF16_ORDER_ISAS  # AMX, VDPBF16PS: their own bf16 bits
    for key, (alone, _) in ((k, v) for k, v in ref.items() if k != "range" and k[1] == 1):
        if key[0] == "bfloat16" and own_bf16_order:
            continue
        for case, want in alone.items():
            assert np.array_equal(got[f"{key[0]}|{key[1]}|{case}"], want), f"ISA {isa} {key} {case} differs"

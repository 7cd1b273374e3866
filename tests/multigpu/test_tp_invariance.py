"""TP-invariant reductions: logits bit-identical at tp 1, 2, 3, 4 (gloo), in fp32 and bf16, at 1 and 2 threads.

``torch.equal``, not a tolerance: each rank's logits shard must equal the
matching slice of the tp-1 logits at the same thread count bit for bit, on a
tiny random model (9 heads / 3 KV heads: padded at tp 2 and 4; tp 2, 3, 4) and on the
embedded SmolLM2-135M (tp 3 and 4), through a prefill step and a mixed step (new prompt,
decode, second prefill chunk).  One spawned job per tp size runs every case.
"""

from __future__ import annotations

import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_on_ranks
from tpguide.model.attention import AttentionMetadata
from tpguide.model.loader import load_model
from tpguide.model.random_checkpoint import write_random_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
THREADS = (1, 2)
VOCAB = 32011  # odd: padded vocabulary at every tp > 1


def _prompt(n: int, seed: int, vocab: int) -> list:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _step(model, seqs):
    meta = AttentionMetadata.from_lists([s for s, _, _ in seqs], [len(t) for _, _, t in seqs],
                                        [c for _, c, _ in seqs])
    ids = torch.tensor([t for _, _, toks in seqs for t in toks])
    return model.compute_logits(model(ids, meta.token_positions, meta))  # fp32 [T, vocab shard]


def _two_steps(model) -> list:
    vocab = model.config.org_vocab_size
    a, b, c = _prompt(6, 0, vocab), _prompt(9, 1, vocab), _prompt(8, 2, vocab)
    first = _step(model, [(0, 0, b[:8]), (2, 0, c[:4])])
    second = _step(model, [(1, 0, a), (0, 8, b[8:]), (2, 4, c[4:])])
    return [first.numpy(), second.numpy()]  # numpy: tensors in the result queue die with the rank


def _logits_job(group: TPGroup, model_dir: str, plain: bool) -> dict:
    """Every (dtype, threads) case on this rank; ``plain`` adds bf16 without invariance.

    Returns ``{(dtype_name, threads, invariant): [logits of step 1, step 2]}`` and
    ``"range": (vocab_start_index, vocab_end_index, padded_vocab_size)``.
    """
    out: dict = {}
    before = torch.get_num_threads()
    try:
        cases = [(dt, True) for dt in DTYPES] + ([("bfloat16", False)] if plain else [])
        for dtype_name, invariant in cases:
            model = load_model(model_dir, group, DTYPES[dtype_name], tp_invariant=invariant)
            model.allocate_kv_cache(3, 32)
            shard = model.vocab_shard
            out["range"] = (shard.vocab_start_index, shard.vocab_end_index, shard.padded_vocab_size)
            for threads in THREADS if invariant else (1,):
                torch.set_num_threads(threads)
                out[(dtype_name, threads, invariant)] = _two_steps(model)
            del model
    finally:
        torch.set_num_threads(before)
    return out


MODELS = ["tiny", pytest.param("embedded", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, default_model_path):
    tiny = write_random_checkpoint(tmp_path_factory.mktemp("inv_ckpt"), vocab_size=VOCAB, seed=5)
    return {"tiny": str(tiny), "embedded": default_model_path}


@pytest.fixture(scope="module")
def references(model_dirs):
    cache: dict = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = _logits_job(TPGroup(), model_dirs[name], plain=False)
        return cache[name]
    return get


def _padded(full, padded_vocab_size: int) -> torch.Tensor:
    full = torch.from_numpy(full)
    out = torch.full((full.shape[0], padded_vocab_size), float("-inf"))
    out[:, :full.shape[1]] = full
    return out


@pytest.mark.parametrize("name", MODELS)
def test_tp1_bf16_threads_agree(references, name):
    """The fixed-order kernels do not depend on the thread count (bf16 here; fp32 in test_batch_invariance.py)."""
    ref = references(name)
    one, two = ref[("bfloat16", 1, True)], ref[("bfloat16", 2, True)]
    assert all(torch.equal(torch.from_numpy(a), torch.from_numpy(b)) for a, b in zip(one, two))


@pytest.mark.parametrize(("name", "tp_size"), [
    ("tiny", 2), ("tiny", 3), ("tiny", 4),
    # the embedded model's tp 2 shards are checked in every batch case by test_batch_invariance.py
    pytest.param("embedded", 3, marks=pytest.mark.slow), pytest.param("embedded", 4, marks=pytest.mark.slow),
])
def test_logits_shards_bit_identical(references, model_dirs, name, tp_size):
    reference = references(name)
    results = run_on_ranks(_logits_job, tp_size, model_dirs[name], name == "tiny")
    plain_differs = False
    for rank, res in enumerate(results):
        start, end, padded_vocab = res["range"]
        for key, steps in res.items():
            if key == "range":
                continue
            dtype_name, threads, invariant = key
            for i, (got, full) in enumerate(zip(steps, reference[(dtype_name, threads, True)])):
                same = torch.equal(torch.from_numpy(got), _padded(full, padded_vocab)[:, start:end])
                if invariant:
                    assert same, f"rank {rank} {key} step {i}: logits differ from tp 1"
                else:
                    plain_differs |= not same
    if name == "tiny":  # the check has teeth: without invariance bf16 logits do change with tp_size
        assert plain_differs, "plain all-reduce gave bit-identical bf16 logits too: the test would not catch drift"

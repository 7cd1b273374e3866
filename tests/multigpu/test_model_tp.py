"""Real 2-, 3- and 4-rank gloo jobs: each rank's logits shard equals its slice of the tp-1 logits.

Tiny random checkpoint with SmolLM2's head layout (9 query heads, 3 KV heads:
zero-padded KV groups at tp 2 and 4, exact at tp 3) and an odd vocabulary
(32011, no tokenizer), run through a prefill step and a mixed step (new
prompt + decode + second prefill chunk).
"""

import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.dist import group as collectives
from tpguide.dist.spawn import run_on_ranks
from tpguide.model.attention import AttentionMetadata
from tpguide.model.loader import load_model
from tpguide.model.random_checkpoint import write_random_checkpoint

VOCAB = 32011


def _prompt(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _step(model, seqs):
    meta = AttentionMetadata.from_lists([s for s, _, _ in seqs], [len(t) for _, _, t in seqs],
                                        [c for _, c, _ in seqs])
    ids = torch.tensor([t for _, _, toks in seqs for t in toks])
    return model.compute_logits(model(ids, meta.token_positions, meta))


def _scenario(group: TPGroup, model_dir: str):
    """Two steps on ``group``; returns this rank's logits shards, its vocab range and greedy ids."""
    model = load_model(model_dir, group)
    model.allocate_kv_cache(3, 32)
    a, b, c = _prompt(6, 0), _prompt(9, 1), _prompt(8, 2)
    first = _step(model, [(0, 0, b[:8]), (2, 0, c[:4])])
    second = _step(model, [(1, 0, a), (0, 8, b[8:]), (2, 4, c[4:])])
    shards = [first, second]
    # Greedy over shards: local max + global id, all-gathered pairs (docs/architecture.md §6).
    greedy = []
    for logits in shards:
        value, idx = logits.max(-1)  # [R]
        pairs = collectives.all_gather_stacked(torch.stack([value, (idx + model.vocab_shard.vocab_start_index).float()]), group)
        best = pairs[:, 0].argmax(0)  # [R] rank with the largest value (first on ties)
        greedy.append(pairs[best, 1, torch.arange(best.numel())].long())
    # numpy, not tensors: torch's multiprocessing queue shares tensors by fd, which dies with the rank
    return ([t.numpy() for t in shards], (model.vocab_shard.vocab_start_index, model.vocab_shard.vocab_end_index),
            [g.numpy() for g in greedy])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = write_random_checkpoint(tmp_path_factory.mktemp("tp_ckpt"), vocab_size=VOCAB, seed=3)
    return str(d), _scenario(TPGroup(), str(d))


@pytest.mark.parametrize("tp_size", [2, 3, 4])
def test_logits_shards_equal_unsharded_slices(reference, tp_size):
    model_dir, (ref_shards, _, ref_greedy) = reference
    results = run_on_ranks(_scenario, tp_size, model_dir)
    for rank, (shards, (start, end), greedy) in enumerate(results):
        for got, full, g, rg in zip(shards, ref_shards, greedy, ref_greedy):
            got, full = torch.from_numpy(got), torch.from_numpy(full)
            # tp-1 logits, extended with -inf to this tp size's padded vocabulary
            padded = torch.full((full.shape[0], max(end, full.shape[1])), float("-inf"))
            padded[:, :full.shape[1]] = full
            want = padded[:, start:end]
            assert got.shape == want.shape
            assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"rank {rank}: -inf pattern differs"
            fin = torch.isfinite(want)
            torch.testing.assert_close(got[fin], want[fin], atol=1e-5, rtol=1e-5)
            assert g.tolist() == rg.tolist() == full.argmax(-1).tolist()


def _default_dir(group: TPGroup, ready_dir: str, bad_dir: str):
    from tpguide.model.default_model import default_model_dir

    path = str(default_model_dir(group, cache_dir=ready_dir))
    try:
        default_model_dir(group, cache_dir=bad_dir)
        error = None
    except Exception as exc:  # noqa: BLE001 - the driver's failure must reach every rank
        error = type(exc).__name__
    return path, error


def test_default_model_dir_is_collective(tmp_path):
    from tpguide.model.default_model import MARKER_FILENAME

    ready, bad = tmp_path / "ready", tmp_path / "bad"
    ready.mkdir(), bad.mkdir()
    (ready / MARKER_FILENAME).write_text("{}")  # a finished conversion: nothing to do
    (bad / "stray").write_text("x")  # not a conversion: the driver refuses, the others hear of it
    results = run_on_ranks(_default_dir, 2, str(ready), str(bad))
    assert results == [(str(ready), "FileExistsError"), (str(ready), "RuntimeError")]


def _greedy_default(group: TPGroup, model_dir: str, ids: list):
    model = load_model(model_dir, group)
    model.allocate_kv_cache(1, 64)
    out, seq, new = [], [], ids
    for _ in range(6):
        logits = _step(model, [(0, len(seq), new)])[-1:]
        value, idx = logits.max(-1)
        pairs = collectives.all_gather_stacked(torch.stack([value, (idx + model.vocab_shard.vocab_start_index).float()]), group)
        seq, new = seq + new, [int(pairs[pairs[:, 0, 0].argmax(), 1, 0])]
        out.append(new[0])
    return out


@pytest.mark.slow
def test_default_model_tp2_greedy_equals_tp1():
    from tpguide.model.default_model import default_model_dir

    model_dir = str(default_model_dir())
    ids = [1, 9690, 198, 2683, 253, 1346, 21326, 30, 2]  # any short prompt
    ref = _greedy_default(TPGroup(), model_dir, ids)
    assert run_on_ranks(_greedy_default, 2, model_dir, ids) == [ref, ref]

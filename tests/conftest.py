"""Shared fixtures: the embedded real model, a tiny random-weight model with its tokenizer, a temporary cache root."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config):
    """Under pytest-xdist, each worker's torch gets its share of the cores (as ``launch/generate.py`` gives each rank).

    ``-n auto`` starts one worker per core; with torch's default (every core)
    per worker the intra-op thread pools oversubscribe the machine, and an
    OpenMP pool whose threads wait for a busy core makes small GEMMs several
    times slower.  Spawned ranks already run one thread each
    (:func:`tpguide.dist.spawn.run_on_ranks`); ``test_tp_invariance`` sets 1
    and 2 threads itself.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


SHARED_SCOPES = ("class", "module", "package")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Tests that share a class-, module- or package-scoped fixture go to one xdist worker (``--dist loadgroup``).

    Plain ``--dist load`` hands tests out one by one, alternately, so both
    workers would build such a fixture (an architecture job, a served model,
    three engine runs).  Session fixtures are built once per worker whatever
    the scheduling; other tests are still handed out one by one.
    """
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d.scope in SHARED_SCOPES for chain in defs for d in chain):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(scope="session")
def default_model_path():
    """The embedded SmolLM2-135M-Instruct, converted once (file-locked across xdist workers)."""
    from tpguide.model.default_model import default_model_dir

    return str(default_model_dir())


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory, default_model_path):
    """A 2-layer random Llama (9 heads / 3 KV heads, vocab 49152) with SmolLM2's tokenizer."""
    from tpguide.model.random_checkpoint import write_random_checkpoint

    out = tmp_path_factory.mktemp("tiny-llama")
    return str(write_random_checkpoint(out, tokenizer_dir=default_model_path, seed=1))


@pytest.fixture(scope="session")
def reasoning_model_path(tmp_path_factory, default_model_path):
    """The tiny random Qwen3 reasoning checkpoint (<think>/</think> added, Qwen3's enable_thinking template)."""
    from tpguide.model.tiny_reasoning import write_tiny_reasoning_model

    return str(write_tiny_reasoning_model(tmp_path_factory.mktemp("tiny-reasoning"), default_model_path))


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer (cached on disk after the first GGUF read); skips if the model package is absent."""
    from guided_testing import load_test_tokenizer

    try:
        return load_test_tokenizer()
    except ModuleNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def stop_ids(tokenizer):
    from tpguide.model.tokenizer_facts import collect_stop_token_ids

    return collect_stop_token_ids(tokenizer)


@pytest.fixture
def lens_cache(tmp_path, monkeypatch):
    """A temporary ``$TPGUIDE_CACHE`` (inherited by spawned ranks); returns where draft lenses are cached."""
    monkeypatch.setenv("TPGUIDE_CACHE", str(tmp_path))
    return tmp_path / "draft_lens"

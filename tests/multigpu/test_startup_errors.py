"""Startup errors fail every rank with a clear message; a driver failure between steps aborts the group.

One gloo job (:func:`run_on_ranks`, tp 2) walks through every startup error
(each rank must raise the same ``ValueError`` at the same point, never hang),
then makes the driver fail between two steps; one torchrun job checks what
``launch/generate.py`` prints and that it exits 1 on every rank.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tpguide.dist.group import check_same_device_type
from tpguide.dist.spawn import run_on_ranks
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.request_io import parse_request_lines
from tpguide.model.random_checkpoint import write_random_checkpoint
from tpguide.worker.protocol import DriverAborted

REPO = Path(__file__).resolve().parents[2]
CONFIG = EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64)


@pytest.fixture(scope="module")
def broken_models(tiny_model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    odd = write_random_checkpoint(root / "odd-mlp", intermediate_size=195, tokenizer_dir=tiny_model_path)
    shapes = root / "shapes"
    shutil.copytree(tiny_model_path, shapes)
    config = json.loads((shapes / "config.json").read_text())
    config["intermediate_size"] = 96  # the checkpoint holds 192
    (shapes / "config.json").write_text(json.dumps(config))
    no_tokenizer = root / "no-tokenizer"
    shutil.copytree(tiny_model_path, no_tokenizer,
                    ignore=shutil.ignore_patterns("tokenizer*", "chat_template*", "special_tokens*"))
    return {"missing": str(root / "does-not-exist"), "tp_size": str(odd), "shapes": str(shapes),
            "tokenizer": str(no_tokenizer)}


def startup_then_abort(group, cases, model_dir):
    """Every startup case, then a driver failure between steps; returns what each rank saw."""
    seen = {}
    for name, path in cases.items():
        try:
            build_engine(group, path, CONFIG)
            seen[name] = None
        except ValueError as exc:
            seen[name] = str(exc)
    engine = build_engine(group, model_dir, CONFIG)
    try:
        if group.is_driver:
            def fail(*args):
                raise RuntimeError("injected driver failure")

            engine.driver.finish_step = fail
            engine.generate(parse_request_lines(['{"prompt": "hi", "max_tokens": 4}'], 4))
        else:
            engine.run_worker()
        seen["abort"] = None
    except (RuntimeError, DriverAborted) as exc:
        seen["abort"] = f"{type(exc).__name__}: {exc}"
    return seen


def test_startup_errors_and_driver_abort_on_every_rank(tiny_model_path, broken_models):
    driver, worker = run_on_ranks(startup_then_abort, 2, broken_models, tiny_model_path, timeout_s=200)
    for seen in (driver, worker):
        assert "does-not-exist" in seen["missing"] and "does not exist" in seen["missing"]
        assert "intermediate_size=195 is not divisible by tp_size=2" in seen["tp_size"]
        assert "valid tp sizes" in seen["tp_size"] and "[1, 3, 5, 13, 15]" in seen["tp_size"]
        assert "model.layers.0.mlp" in seen["shapes"]
        assert "cannot load the tokenizer" in seen["tokenizer"]
    assert worker["tokenizer"].startswith("the driver (rank 0) failed to start")
    assert driver["abort"] == "RuntimeError: injected driver failure"
    assert worker["abort"].startswith("DriverAborted: rank 1: the driver (rank 0) failed between steps")
    assert "injected driver failure" in worker["abort"]


def test_generate_py_prints_one_line_per_rank_and_exits_1(broken_models):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "launch/generate.py", "--model", broken_models["tp_size"], "--quiet"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    for rank in (0, 1):
        assert f"[rank {rank}] error: intermediate_size=195 is not divisible by tp_size=2" in proc.stderr
    assert "generate.py\", line" not in proc.stderr  # no Python traceback from the ranks


def test_mixed_device_types_are_named():
    check_same_device_type(["cuda", "cuda"])
    with pytest.raises(ValueError, match=r"cpu on rank\(s\) \[2\]; cuda on rank\(s\) \[0, 1\]"):
        check_same_device_type(["cuda", "cuda", "cpu"])

"""Offline data parallel: ``torchrun --nproc-per-node 4 launch/generate.py --data-parallel-size 2`` (2 x tp 2).

One 4-rank job on the tiny random model (gloo, one thread per rank) against
the same requests on one tp-2 group in spawned ranks: every request has the
same token ids and finish reason (greedy, seeded sampling, a guided one; a
bad line fails in its place), the output file is in input order, and
``--resume`` keeps the lines already in ``OUT.partial`` (only the others run,
split over both replicas).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tpguide.dist.spawn import free_port, run_on_ranks
from tpguide.engine import EngineConfig, generate_on_group

REPO = Path(__file__).resolve().parents[2]
GOOD = [{"id": f"r{i}", "prompt": f"Story {i}:", "max_tokens": 6 + i % 3} for i in range(7)]
GOOD[1].update(temperature=0.8, top_p=0.9, seed=11)
GOOD[4].update(temperature=0.7, seed=3)
GOOD[2]["structured_output"] = {"regex": r"[a-z]{3,8}"}
LINES = [json.dumps(GOOD[0]), "{not json", *map(json.dumps, GOOD[1:])]
FLAGS = ["--max-num-seqs", "3", "--max-num-batched-tokens", "64", "--max-model-len", "128", "--dtype", "float32",
         "--threads", "1", "--quiet"]
CONFIG = EngineConfig(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=128, dtype=torch.float32)
KEPT = {"r3": "kept from the first run", "r5": "kept too"}


def test_dp2_tp2_equals_one_tp2_group_and_resumes(tiny_model_path, tmp_path):
    requests, output = tmp_path / "requests.jsonl", tmp_path / "out.jsonl"
    requests.write_text("\n".join(LINES) + "\n")
    Path(str(output) + ".partial").write_text("".join(
        json.dumps({"id": rid, "text": text, "token_ids": [1], "finish_reason": "length", "error": None,
                    "num_prompt_tokens": 3}) + "\n" for rid, text in KEPT.items()))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "launch/generate.py", "--model", tiny_model_path,
           "--requests", str(requests), "--output", str(output), "--data-parallel-size", "2", "--resume", *FLAGS]
    res = subprocess.run(cmd, cwd=REPO, env={**os.environ, "TPGUIDE_BACKEND": "gloo"}, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    final = [json.loads(line) for line in output.read_text().splitlines()]
    assert [o["id"] for o in final] == ["r0", "1", *[g["id"] for g in GOOD[1:]]]
    assert "not valid JSON" in final[1]["error"]
    by_id = {o["id"]: o for o in final}
    assert {rid: by_id[rid]["text"] for rid in KEPT} == KEPT

    reference = run_on_ranks(generate_on_group, 2, tiny_model_path, GOOD, CONFIG)[0]
    fresh = [(o["id"], o["token_ids"], o["finish_reason"]) for o in final if o["id"] in {g["id"] for g in GOOD}
             and o["id"] not in KEPT]
    assert fresh == [(o["id"], o["token_ids"], o["finish_reason"]) for o in reference if o["id"] not in KEPT]
    assert all(len(o["token_ids"]) > 0 for o in reference)


def _offline_with_a_dying_replica(group, model_dir, lines):
    """dp 2 x tp 1: replica 1 fails at its 4th step (its process then exits); rank 0 reports what it got."""
    import threading

    from tpguide.dist.replica_channel import open_replica_channels
    from tpguide.engine import build_engine
    from tpguide.engine.data_parallel import ReplicaFailed, follow_front_end, generate_on_replicas
    from tpguide.engine.request_io import parse_request_lines

    channels = open_replica_channels(group, heartbeat_s=0.5, timeout_s=30.0)
    engine = build_engine(group, model_dir, CONFIG)
    if group.rank == 1:
        steps = []

        def die():
            steps.append(1)
            if len(steps) == 4:
                threading.Timer(1.0, os._exit, (0,)).start()  # after run_on_ranks has this rank's result
                raise RuntimeError("injected failure")

        engine.runner.on_step = die
        try:
            follow_front_end(engine, channels[0])
        except RuntimeError as exc:
            return str(exc)
        return "no failure"
    got = []
    try:
        generate_on_replicas(engine, channels, parse_request_lines(lines, 8), on_output=got.append)
    except ReplicaFailed as exc:
        return str(exc), sorted(o.request_id for o in got)
    return "no failure", []


def test_a_dead_replica_fails_the_offline_run_naming_it(tiny_model_path):
    lines = [json.dumps({"id": f"q{i}", "prompt": f"Line {i}", "max_tokens": 8}) for i in range(4)]
    (message, finished), died = run_on_ranks(_offline_with_a_dying_replica, 2, tiny_model_path, lines,
                                             data_parallel_size=2, timeout_s=240)
    assert died == "injected failure"
    assert message.startswith("replica 1 (global rank 1) is unreachable") and "2 request(s) did not finish" in message
    assert finished == ["q0", "q2"]  # replica 0's share, every one of its requests

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
from tpguide.engine.engine import EngineConfig, generate_on_group

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

"""Two nodes simulated on this machine: two torchrun agents joined by c10d rendezvous, 2 ranks each (dp 2 x tp 2).

One job (tiny random model, gloo, one thread per rank), in three phases:

1. openai-client requests (greedy and seeded) spread over both replicas
   give the token ids of the offline path on one group (tp 1 in this
   process: the model is TP-invariant, so that is also the tp-2 group's),
   and ``/metrics`` has both replicas' token counters;
2. rank 3 (replica 1's second rank) dies mid-run
   (``TPGUIDE_FAULT_INJECT=3:STEP``): streamed requests on replica 1 end
   with an error naming the replica, the others finish, non-streamed ones
   are retried on replica 0 and finish with the same tokens, nothing waits
   past the collective timeout, and ``/health`` reports replica 1 dead;
3. SIGTERM to the surviving agent ends every process it started.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.dist.spawn import free_port
from tpguide.engine import EngineConfig, generate_on_group

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
COLLECTIVE_TIMEOUT_S = 20
KILL_STEP = 24  # replica 1's engine steps: phase 1 takes fewer than 10
FLAGS = ["--tensor-parallel-size", "2", "--threads", "1", "--dtype", "float32", "--max-num-seqs", "4",
         "--max-model-len", "256", "--max-num-batched-tokens", "128", "--collective-timeout",
         str(COLLECTIVE_TIMEOUT_S), "--heartbeat-interval", "1", "--served-model-name", "tiny"]
CONFIG = EngineConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=128, dtype=torch.float32)
PHASE1 = [{"prompt": f"Story {i}:", "max_tokens": 6, "temperature": 0.0 if i % 2 else 0.8, "seed": 7 + i}
          for i in range(4)]
PHASE2 = [{"prompt": f"Tale {i}:", "max_tokens": 40, "temperature": 0.0} for i in range(6)]


def _agent(node: int, rdzv_port: int, http_port: int, model: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", f"t{rdzv_port}",
           "--rdzv-conf", f"is_host={1 if node == 0 else 0}", "launch/serve.py", "--model", model,
           "--port", str(http_port), *FLAGS]
    env = {**os.environ, "TPGUIDE_BACKEND": "gloo", "PYTHONUNBUFFERED": "1",
           "TPGUIDE_FAULT_INJECT": f"3:{KILL_STEP}"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_healthy(base: str, agents, logs, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(a.poll() is not None for a in agents):
            raise RuntimeError("an agent exited early:\n" + "\n".join(p.read_text()[-3000:] for p in logs))
        try:
            body = httpx.get(base + "/health", timeout=2).json()
            if [r["status"] for r in body.get("replicas", [])] == ["ok", "ok"]:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError("no healthy job:\n" + "\n".join(p.read_text()[-3000:] for p in logs))


def _stop(agent: subprocess.Popen) -> None:
    try:
        os.killpg(agent.pid, signal.SIGKILL)  # the session this test created for the agent
    except ProcessLookupError:
        pass
    agent.wait()


def _complete(client, body, stream: bool):
    start = time.monotonic()
    try:
        if stream:
            parts = list(client.completions.create(model="tiny", stream=True, **body))
            reasons = [p.choices[0].finish_reason for p in parts if p.choices and p.choices[0].finish_reason]
            return "ok", reasons[-1] if reasons else None, time.monotonic() - start
        r = client.completions.create(model="tiny", extra_body={"return_token_ids": True}, **body)
        return "ok", r.choices[0].token_ids, time.monotonic() - start
    except openai.APIError as exc:
        return "error", str(exc), time.monotonic() - start


def test_two_nodes_serve_fail_and_stop(tiny_model_path, tmp_path):
    rdzv, http = free_port(), free_port()
    base = f"http://127.0.0.1:{http}"
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    agents = [_agent(0, rdzv, http, tiny_model_path, logs[0])]
    time.sleep(2)  # node 0 first: it hosts the store and (lower pid) gets global ranks 0-1
    agents.append(_agent(1, rdzv, http, tiny_model_path, logs[1]))
    try:
        _wait_healthy(base, agents, logs)
        assert "[rank 0] serving 'tiny' at tp_size=2 x dp_size=2" in logs[0].read_text()
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        reference = generate_on_group(TPGroup(), tiny_model_path, [{"id": str(i), **b} for i, b in
                                                                   enumerate(PHASE1 + PHASE2)], CONFIG)

        # phase 1: spread over both replicas, same tokens as one group
        with cf.ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda b: _complete(client, b, stream=False), PHASE1))
        assert [g[1] for g in got] == [o["token_ids"] for o in reference[:4]], got
        metrics = httpx.get(base + "/metrics").text
        for d in (0, 1):
            line = next(x for x in metrics.splitlines() if x.startswith(f'tpguide:replica_generation_tokens_total'
                                                                       f'{{replica="{d}"}}'))
            assert float(line.split()[-1]) > 0, metrics

        # phase 2: replica 1 loses rank 3 mid-run
        streamed, plain = PHASE2[:4], PHASE2[4:]
        with cf.ThreadPoolExecutor(6) as ex:
            futs = [ex.submit(_complete, client, b, True) for b in streamed]
            futs += [ex.submit(_complete, client, b, False) for b in plain]
            results = [f.result(timeout=COLLECTIVE_TIMEOUT_S * 4) for f in futs]
        errors = [r for r in results[:4] if r[0] == "error"]
        assert errors, f"no streamed request was on replica 1 when it died: {results}"
        assert all("replica 1 (global ranks 2-3)" in r[1] for r in errors), errors
        assert all(r[1] == "length" for r in results[:4] if r[0] == "ok"), results
        assert [r[1] for r in results[4:]] == [o["token_ids"] for o in reference[8:]], results[4:]
        assert max(r[2] for r in results) < COLLECTIVE_TIMEOUT_S * 3, results
        health = httpx.get(base + "/health").json()
        assert health["status"] == "degraded" and [r["status"] for r in health["replicas"]] == ["ok", "dead"]
        assert "[rank 3] TPGUIDE_FAULT_INJECT: exiting" in logs[1].read_text()
        assert agents[1].wait(timeout=60) != 0

        # phase 3: SIGTERM to the surviving agent ends its ranks
        agents[0].send_signal(signal.SIGTERM)
        agents[0].wait(timeout=60)
        text = logs[0].read_text()
        assert "[rank 0] error: engine loop of replica 1 (global ranks 2-3) failed" in text, text[-3000:]
        assert "[rank 1] stopped; exit 0" in text, text[-3000:]
    finally:
        for agent in agents:
            _stop(agent)

"""Reasoning through the engine in one process: a draft that carries </think>, the startup errors, the demo's model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from reasoning_testing import THINK_END_ID, check_reasoning_outputs, key, reasoning_requests
from transformers import AutoTokenizer

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.intake import tokenize_prompt
from tpguide.engine.request_io import parse_request_lines

REPO = Path(__file__).resolve().parents[1]
CONFIG = dict(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=96, reasoning_parser="qwen3")


def _run(model_dir, lines, **config):
    engine = build_engine(TPGroup(), model_dir, EngineConfig(**dict(CONFIG, **config)))
    outputs = [o.to_json() for o in engine.generate(parse_request_lines([json.dumps(r) for r in lines], 64))]
    stats = engine.driver.spec.stats if engine.driver.spec is not None else None
    engine.shutdown()
    return outputs, stats


class PerfectDrafter:
    """Drafts the plain run's continuation, so windows straddle </think> wherever it falls."""

    def __init__(self, sequences):
        self.sequences = sequences

    def propose(self, token_ids, k):
        for seq in self.sequences:
            if seq[:len(token_ids)] == list(token_ids):
                return seq[len(token_ids):len(token_ids) + k]
        return []


def test_drafts_carrying_think_end_are_verified_with_the_answer_rows(reasoning_model_path, monkeypatch):
    """n-gram drafts that are the plain output: every window is accepted whole, </think> inside many of them.

    Were a row after a drafted ``</think>`` not masked by the grammar, the
    target would sample there unguided and the output would leave the plain one.
    """
    lines = reasoning_requests()
    plain, _ = _run(reasoning_model_path, lines, speculative_method=None)
    check_reasoning_outputs(lines, plain)
    tokenizer = AutoTokenizer.from_pretrained(reasoning_model_path)
    prompts = [tokenize_prompt(tokenizer, r) for r in parse_request_lines([json.dumps(r) for r in lines], 64)]
    sequences = [p + o["token_ids"] for p, o in zip(prompts, plain)]
    monkeypatch.setattr("tpguide.speculative.propose.NgramProposer", lambda: PerfectDrafter(sequences))
    drafted, stats = _run(reasoning_model_path, lines, speculative_method="ngram", grammar_draft=False,
                          num_speculative_tokens=4)
    assert key(drafted) == key(plain)
    assert stats.num_accepted == stats.num_drafted > 0, stats  # every prompt differs: no draft is a guess
    straddling = [o for o in plain if THINK_END_ID in o["token_ids"][1:]]
    assert len(straddling) >= 8  # </think> after the first token: inside a verify window


def test_a_named_parser_without_think_tokens_fails_the_start(default_model_path):
    with pytest.raises(ValueError, match="lacks '<think>', '</think>'"):
        build_engine(TPGroup(), default_model_path, EngineConfig(reasoning_parser="qwen3"))
    proc = subprocess.run([sys.executable, "launch/generate.py", "--reasoning-parser", "deepseek_r1", "--quiet"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "'</think>'" in proc.stderr and "--reasoning-parser deepseek_r1" in proc.stderr


def test_thinking_token_budget_needs_a_reasoning_model(tiny_model_path):
    outputs, _ = _run(tiny_model_path, [{"id": "b", "prompt": "hi", "thinking_token_budget": 4, "max_tokens": 4}],
                      reasoning_parser="auto")
    assert outputs[0]["finish_reason"] == "error" and "thinking_token_budget=4 needs a reasoning" in outputs[0]["error"]

"""Grammar drafts on the shared bench data (skipped where absent): same tokens and logprobs as without drafts.

``../shared/bench-data/vllm_fixtures.jsonl`` (25 request lines from vLLM's
structured-output tests: schemas, regex, choice, EBNF and Lark grammars, a
structural tag, an invalid grammar) and the 60 JSONSchemaBench schemas of
``jsonschemabench_sample.jsonl`` as request lines
(``jsonschemabench_requests.jsonl``), each file in one engine run with and
one without drafts: tp 1, the tiny random-weight model, ``max_tokens`` 8,
``guided_backend`` auto (both backends run).  The data is read in place,
never copied into the repository.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from grammar_draft_testing import key, run

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig
from tpguide.model.dtype import resolve_dtype

DATA = Path(__file__).resolve().parents[2] / "shared" / "bench-data"
BASE = dict(max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=2048, dtype=resolve_dtype("auto", "cpu"))


@pytest.mark.parametrize("name", ["vllm_fixtures.jsonl", "jsonschemabench_requests.jsonl"])
def test_bench_data_gives_the_same_tokens_with_grammar_drafts(tiny_model_path, name):
    path = DATA / name
    if not path.is_file():
        pytest.skip(f"{path} not present")
    lines = [{**json.loads(line), "max_tokens": 8, "logprobs": 1} for line in path.read_text().splitlines()
             if line.strip()]
    plain, _ = run(TPGroup(), tiny_model_path, lines, EngineConfig(**BASE, speculative_method=None))
    outputs, stats = run(TPGroup(), tiny_model_path, lines, EngineConfig(**BASE))
    assert key(outputs) == key(plain)
    assert sum(o["finish_reason"] != "error" for o in outputs) > len(lines) // 2  # most ran
    assert stats.num_forced_accepted > 0 and stats.num_sample_passes < stats.num_generated_tokens, stats

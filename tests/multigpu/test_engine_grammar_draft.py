"""Grammar drafts change nothing but the number of forward passes: same token ids and logprobs, tp 1 and 2.

The README demo (``tpguide/engine/demo_requests.py``; greedy, and with
seeded sampling), and tool calls with ``tool_choice`` "required" and named,
on xgrammar and on llguidance: the default engine (grammar drafts for guided
requests, K = 4) at tp 1 and on two gloo ranks gives exactly the tokens and
logprobs of an engine without drafts, and it did draft forced text, had
some of it accepted, and took fewer forward passes than it generated
tokens.  The tiny random-weight model, in the CPU's default dtype
(``--dtype auto``: bf16 with AVX512_BF16 or AMX); the embedded model is in
``tests/test_grammar_draft_real.py``.
"""

from __future__ import annotations

import pytest
from grammar_draft_testing import key, run, tool_call_lines

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_at_tp_size
from tpguide.engine import EngineConfig
from tpguide.engine.demo_requests import DEMO_REQUESTS
from tpguide.model.dtype import resolve_dtype

MAX_TOKENS = 12
BASE = dict(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024, dtype=resolve_dtype("auto", "cpu"))
def request_lines(backend: str) -> list:
    """The demo as written (one of its requests is sampled), two more seeded-sampled copies, the tool calls.

    Logprobs on every line.  Few sampled rows: their noise over the whole
    vocabulary is what a tiny-model step spends most on.
    """
    lines = [{**r, "max_tokens": MAX_TOKENS, "logprobs": 1} for r in DEMO_REQUESTS]
    for i, r in enumerate(r for r in lines if r["id"] in ("regex-date", "grammar-ebnf")):
        lines.append({**r, "id": f"{r['id']}-sampled", "temperature": 0.8, "top_p": 0.95, "seed": 50 + i})
    return lines + tool_call_lines(backend)


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def case(request, tiny_model_path):
    """(backend, lines, outputs without drafts)."""
    lines = request_lines(request.param)
    plain, stats = run(TPGroup(), tiny_model_path, lines,
                       EngineConfig(**BASE, guided_backend=request.param, speculative_method=None))
    assert stats is None
    assert all(o["finish_reason"] in ("stop", "length") for o in plain), [o["error"] for o in plain]
    return request.param, lines, plain


@pytest.mark.parametrize("tp_size", [1, 2])
def test_grammar_drafts_give_the_tokens_and_logprobs_of_plain_decoding(case, tiny_model_path, tp_size):
    backend, lines, plain = case
    config = EngineConfig(**BASE, guided_backend=backend)  # the default: grammar drafts, K = 4
    for outputs, stats in run_at_tp_size(run, tp_size, tiny_model_path, lines, config):
        assert key(outputs) == key(plain)
        assert stats.num_forced_accepted > 0, stats  # forced text was drafted and accepted ...
        assert stats.num_forced_drafted == stats.num_drafted  # ... and nothing else drafted
        assert stats.num_sample_passes < stats.num_generated_tokens, stats  # ... saving forward passes
        assert stats.num_generated_tokens == sum(len(o["token_ids"]) for o in outputs)

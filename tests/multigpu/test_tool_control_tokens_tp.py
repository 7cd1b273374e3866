"""tp 2 equals tp 1 on a Mistral-style checkpoint whose ``[TOOL_CALLS]`` is a control token.

The requests of ``tests/test_tool_control_tokens_engine.py`` (``required``,
named and ``auto`` on xgrammar, ``required`` on llguidance; the forced
calls begin with the control token's id) on two gloo ranks with grammar
drafts give the token ids, logprobs, calls and argument strings of tp 1
without drafts.
"""

from __future__ import annotations

from grammar_draft_testing import key
from tool_format_testing import control_lines, run_formats, write_control_model
from transformers import AutoTokenizer

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_at_tp_size
from tpguide.engine import EngineConfig
from tpguide.engine.request import RequestOutput
from tpguide.model.dtype import resolve_dtype
from tpguide.serving.responses import TokenText, build_answer

BASE = dict(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=1024, guided_backend="auto",
            dtype=resolve_dtype("auto", "cpu"))


def calls(outputs, cases, tok):
    """(id, [(name, arguments)]) of each output as the server answers it, read from its token ids."""
    by_id = {o["id"]: o for o in outputs}
    out = []
    for _, parsed in cases:
        o = by_id[parsed.lines[0]["id"]]
        result = RequestOutput(o["id"], token_ids=o["token_ids"], text=o["text"], finish_reason=o["finish_reason"])
        message = build_answer(parsed, "r", [result], TokenText(tok))["choices"][0]["message"]
        out.append((o["id"], [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]))
    return out


def test_tp2_gives_the_calls_and_ids_of_tp1(tmp_path, default_model_path):
    model = write_control_model(tmp_path, default_model_path)
    tok = AutoTokenizer.from_pretrained(model)
    _, cases = control_lines(model)
    jobs = [(model, [p.lines[0] for _, p in cases])]
    ((want, _),) = run_formats(TPGroup(), jobs, EngineConfig(**BASE, speculative_method=None))
    tid = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert [o["token_ids"][0] for o in want] == [tid] * len(want) and all(o["finish_reason"] == "stop" for o in want)
    want_calls = calls(want, cases, tok)
    assert all(c for _, c in want_calls)
    for ((outputs, _),) in run_at_tp_size(run_formats, 2, jobs, EngineConfig(**BASE)):
        assert key(outputs) == key(want)
        assert calls(outputs, cases, tok) == want_calls

"""A Mistral-style checkpoint whose ``[TOOL_CALLS]`` is a control token: calls forced as ids, read back from ids.

A tiny random Mistral with the family's control tokens (special in
``added_tokens_decoder``, not in ``additional_special_tokens``) runs at tp 1:
``required`` and named start with the control token's id (xgrammar and
llguidance); ``auto`` calls when a bias makes that id the greedy first
token; the server's answer reads the calls from the ids.  Cut at every
length (as ``max_tokens`` would cut the greedy output), the answer and the
stream have no call syntax in ``content``, the complete calls in
``tool_calls``, and the same calls.  tp 2: ``tests/multigpu/test_tool_control_tokens_tp.py``.
"""

from __future__ import annotations

import json

import pytest
from tool_format_testing import control_lines, write_control_model
from transformers import AutoTokenizer

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, generate_on_group
from tpguide.engine.request import RequestOutput
from tpguide.serving.responses import TokenText, build_answer
from tpguide.serving.sse import ChoiceStream

CONFIG = EngineConfig(max_num_seqs=4, max_model_len=1024, guided_backend="auto")


@pytest.fixture(scope="module")
def run(tmp_path_factory, default_model_path):
    model = write_control_model(tmp_path_factory.mktemp("mistral-control"), default_model_path)
    setup, cases = control_lines(model)
    outputs = {o["id"]: o for o in generate_on_group(TPGroup(), model, [p.lines[0] for _, p in cases], CONFIG)}
    return AutoTokenizer.from_pretrained(model), {case: (p, outputs[p.lines[0]["id"]]) for case, p in cases}


def answer(parsed, tok, ids, reason):
    out = RequestOutput("r", token_ids=list(ids), text=tok.decode(ids, skip_special_tokens=True), finish_reason=reason,
                        num_prompt_tokens=1)
    (choice,) = build_answer(parsed, "r", [out], TokenText(tok))["choices"]
    return choice["message"], choice["finish_reason"]


def stream(parsed, tok, ids, reason):
    """The chunks' content and calls when the engine reports ``ids`` one token at a time."""
    s, content, calls, finish = ChoiceStream(parsed, 0, tok, TokenText(tok)), "", {}, None
    for k in range(1, len(ids) + 1):
        done = k == len(ids)
        out = RequestOutput("r", new_token_ids=list(ids[k - 1:k]), token_ids=list(ids[:k]),
                            text=tok.decode(ids[:k], skip_special_tokens=True), finish_reason=reason if done else None)
        for entry in s.on_output(out):
            delta, finish = entry["delta"], entry["finish_reason"] or finish
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] = call["function"].get("name") or entry[0]
                entry[1] += call["function"]["arguments"]
    return content, [tuple(c) for _, c in sorted(calls.items())], finish


def test_forced_calls_start_with_the_control_id_and_are_read_from_ids(run):
    tok, by_case = run
    tid = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    for case in ("required-xgrammar", "named-xgrammar", "required-llguidance", "auto-xgrammar"):
        parsed, out = by_case[case]
        assert out["finish_reason"] == "stop", (case, out["error"])
        assert out["token_ids"][0] == tid, case  # auto: the biased greedy first token is the control id
        assert "[TOOL_CALLS]" not in out["text"]  # the decoded text omits it
        message, reason = answer(parsed, tok, out["token_ids"], "stop")
        assert reason == "tool_calls" and message["content"] is None, (case, message)
        names = [c["function"]["name"] for c in message["tool_calls"]]
        assert names and set(names) <= ({"get_time"} if case.startswith("named") else {"get_time", "get_weather"})
        assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in message["tool_calls"])
        content, calls, finish = stream(parsed, tok, out["token_ids"], "stop")
        assert (content, finish) == ("", "tool_calls")
        assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def test_a_call_cut_by_max_tokens_leaves_no_syntax_in_content(run):
    tok, by_case = run
    parsed, out = by_case["required-xgrammar"]
    ids = out["token_ids"]
    whole, _ = answer(parsed, tok, ids, "stop")
    assert len(whole["tool_calls"]) >= 2, whole  # the bias toward "," makes a second call to cut
    seen = set()
    for k in range(1, len(ids)):  # greedy: max_tokens k gives the first k tokens
        message, reason = answer(parsed, tok, ids[:k], "length")
        assert reason == "length" and message["content"] is None, (k, message)
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]][:len(calls)]
        seen.add(len(calls))
        if k % 7 == 0 or k == len(ids) - 1:  # streamed (every 7th cut: each replays k tokens)
            content, streamed, finish = stream(parsed, tok, ids[:k], "length")
            assert content == "" and finish == "length"
            assert streamed[:len(calls)] == calls and len(streamed) - len(calls) <= 1  # + the cut call's part
    assert {0, 1} <= seen

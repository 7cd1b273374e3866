"""Streaming pieces: incremental detokenizer, stop-string holdback, SSE chunks (tokenizer only, no model)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tpguide.serving.detokenizer import IncrementalDetokenizer, TextStream, stop_holdback
from tpguide.serving.protocol import parse_request
from tpguide.serving.responses import TokenText, build_answer
from tpguide.serving.sse import DONE, ChoiceStream, chunk, sse_event

TEXTS = ["Hello, world!", "naïve café — 東京タワー 🚀🎉 ok", "emoji 👩‍👩‍👧 family, ∑ x² ≥ 0"]


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_never_splits_a_character(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_holdback():
    assert stop_holdback("abc END", ["END"]) == 0
    assert stop_holdback("abc EN", ["END"]) == 2
    assert stop_holdback("abc E", ["END", "xyz"]) == 1
    assert stop_holdback("abc", []) == 0


def test_text_stream_cuts_a_stop_string_that_spans_deltas():
    s = TextStream(["STOP"])
    sent = [s.update(t) for t in ["Hello S", "Hello ST", "Hello STO", "Hello STOP and more"]]
    assert sent == ["Hello ", "", "", ""]
    assert s.finish("Hello ") == ""  # the engine's final text is cut before the stop string


def out(new, all_ids, text, reason=None, logprobs=None):
    return SimpleNamespace(request_id="x-0", new_token_ids=new, token_ids=all_ids, text=text,
                           finish_reason=reason, error=None, num_prompt_tokens=3, new_logprobs=logprobs,
                           logprobs=logprobs, finished=reason is not None)


def test_choice_stream_chat_chunks_concatenate_to_the_answer(tokenizer):
    text = "Paris 🚀 is nice."
    ids = tokenizer.encode(text, add_special_tokens=False)
    parsed = parse_request({"model": "m", "messages": [{"role": "user", "content": "q"}], "stream": True,
                            "stream_options": {"include_usage": True}}, "chat", "r")
    cs = ChoiceStream(parsed, 0, tokenizer, TokenText(tokenizer))
    entries = []
    for k in range(len(ids)):
        done = k == len(ids) - 1
        entries += cs.on_output(out(ids[k:k + 1], ids[:k + 1], tokenizer.decode(ids[:k + 1]),
                                    "stop" if done else None))
    assert entries[0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["delta"].get("content", "") for e in entries) == text
    assert entries[-1]["finish_reason"] == "stop" and all(e["finish_reason"] is None for e in entries[:-1])
    c = chunk(parsed, "r", 1, entries[:1])
    assert c["object"] == "chat.completion.chunk" and c["usage"] is None
    event = sse_event(c)
    assert event.startswith("data: ") and event.endswith("\n\n") and json.loads(event[6:]) == c
    assert DONE == "data: [DONE]\n\n"


def test_completion_answer_and_logprobs(tokenizer):
    ids = tokenizer.encode(" one two", add_special_tokens=False)
    lps = [{"token_id": t, "logprob": -0.5, "top": [[t, -0.5], [0, -3.0]]} for t in ids]
    parsed = parse_request({"model": "m", "prompt": "count:", "logprobs": 1, "n": 1}, "completion", "cmpl-1")
    ans = build_answer(parsed, "cmpl-1", [out(ids, ids, " one two", "length", lps)], TokenText(tokenizer))
    (choice,) = ans["choices"]
    assert choice["text"] == " one two" and choice["finish_reason"] == "length"
    assert "".join(choice["logprobs"]["tokens"]) == " one two"
    assert all(len(t) == 1 for t in choice["logprobs"]["top_logprobs"])
    assert ans["usage"] == {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 3 + len(ids)}


def test_logprob_bytes_are_the_tokens_own_bytes(tokenizer):
    tt = TokenText(tokenizer)
    ids = tokenizer.encode("東京 🚀 ok", add_special_tokens=False)
    assert bytes(b for t in ids for b in tt.bytes_of(t)).decode("utf-8") == "東京 🚀 ok"

"""An unfinished output's text is detokenized incrementally: the whole decode's text, at a bounded cost per step.

``request_output`` (engine/outputs.py) reports every step; decoding the
whole output each time costs O(n) a step (docs/architecture.md §1, step 10).
These tests follow a request token by token with the real tokenizer.
"""

from __future__ import annotations

import pytest

from tpguide.engine.outputs import request_output
from tpguide.engine.request import Request, SamplingParams

TEXTS = ["Hello, world! " * 40, "naïve café — 東京タワー 🚀🎉 ok, " * 20, '{"name": "Zoë", "tags": ["∑", "x²"]}']


class CountingTokenizer:
    """The tokenizer, counting the tokens each decode is given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("counted", [True, False])  # False: the fast tokenizer's own decoder
@pytest.mark.parametrize("text", TEXTS)
def test_step_texts_are_the_whole_decode_at_a_bounded_cost(tokenizer, text, counted):
    ids = tokenizer.encode(text, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer) if counted else tokenizer
    req = Request(request_id="r", index=0, sampling_params=SamplingParams(max_tokens=len(ids) + 1))
    for k, t in enumerate(ids):
        req.output_token_ids.append(t)
        out = request_output(req, counting)
        whole = tokenizer.decode(ids[:k + 1], skip_special_tokens=True)
        # the whole decode; behind it only while the last token ends inside a character (never shown cut)
        assert whole.startswith(out.text) and "\ufffd" not in out.text, (k, out.text[-20:], whole[-20:])
        assert out.text == whole or whole.endswith("\ufffd"), (k, out.text[-20:], whole[-20:])
        assert out.new_token_ids == [t] and out.token_ids == ids[:k + 1]
    assert out.text == tokenizer.decode(ids, skip_special_tokens=True)
    # a window per step, not the whole output: O(n) tokens decoded in all, not O(n^2)
    if counted:
        assert counting.decoded <= 12 * len(ids), (counting.decoded, len(ids))
    req.finish("stop")
    final = request_output(req, counting)
    assert final.text == tokenizer.decode(ids, skip_special_tokens=True) and final.finish_reason == "stop"


def test_a_finished_output_is_decoded_whole_with_its_stop_cut(tokenizer):
    ids = tokenizer.encode("The answer is 42. END and more", add_special_tokens=False)
    req = Request(request_id="r", index=0, sampling_params=SamplingParams(max_tokens=64))
    for t in ids:
        req.output_token_ids.append(t)
        request_output(req, tokenizer)
    req.stop_text_cut = tokenizer.decode(ids, skip_special_tokens=True).index(" END")
    req.finish("stop")
    assert request_output(req, tokenizer).text == "The answer is 42."

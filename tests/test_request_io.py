"""Request lines: parsing, per-line errors, atomic output writing."""

import json

import pytest

from tpguide.engine.request import RequestOutput, SamplingParams
from tpguide.engine.request_io import load_finished, parse_request_lines, write_outputs


def _line(**kw):
    base = {"id": "x", "prompt": "hi"}
    base.update(kw)
    return json.dumps(base)


def test_good_line_parses_with_defaults():
    (req,) = parse_request_lines([_line(temperature=0.5, seed=3)], default_max_tokens=9)
    assert req.sampling_params == SamplingParams(max_tokens=9, temperature=0.5, seed=3)
    assert req.finish_reason is None and req.prompt == "hi"


@pytest.mark.parametrize(
    "line, needle",
    [
        ("{not json", "bad request line 2"),
        (_line(colour="red"), "unknown request field"),
        (json.dumps({"id": "x"}), "exactly one of 'prompt' or 'messages'"),
        (_line(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (_line(temperature=-1), "temperature must be 0 or a number in [1.175e-38, 3.403e+38]"),
        (_line(top_p=1.5), "top_p"),
        (_line(temperature=float("inf")), "temperature must be 0 or a number in"),
        (_line(temperature=1e308), "(a normal float32 value: the step holds it as one), got 1e+308"),  # a trial
        (_line(top_p=1e-50), "top_p must be in (0, 1] and at least"),
        (_line(logit_bias={"٣": 1}), "logit_bias keys must be token ids"),  # an Arabic-Indic 3
        (_line(prompt="ok", structured_output={"json": {"type": "string", "maxLength": -1}}),
         "json schema is not a valid JSON Schema (Draft202012): -1 is less than the minimum of 0 (at /maxLength)"),
        (_line(seed=2**63), "seed must be null or an int in [0, 2**63 - 1]"),  # found by the server fuzz
        (_line(top_k=10**30), "top_k must be an int in [-1, 2**31)"),
        (json.dumps({"id": "x", "prompt": "\ud800"}), "prompt is not valid Unicode (lone surrogate U+D800"),
        (json.dumps({"id": "x", "messages": [{"role": "user"}]}), "'role' and 'content'"),
    ],
)
def test_bad_lines_fail_alone(line, needle):
    good = _line(id="ok")
    reqs = parse_request_lines([good, line, good], default_max_tokens=4)
    assert [r.finish_reason for r in reqs] == [None, "error", None]
    assert needle in reqs[1].error
    assert [r.index for r in reqs] == [0, 1, 2]


def test_outputs_are_written_atomically_in_order(tmp_path):
    path = tmp_path / "out.jsonl"
    outs = [RequestOutput(request_id=str(i), text=f"t{i}", token_ids=[i], finish_reason="stop", error=None)
            for i in range(3)]
    write_outputs(str(path), outs)
    lines = path.read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["0", "1", "2"]
    assert list(load_finished(str(path))) == ["0", "1", "2"]
    assert not list(tmp_path.glob("*.tmp"))

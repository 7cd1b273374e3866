"""Fuzz fail-closed: schemas drawn from the full keyword set, tiny random model at temperature 1.

Every request is either refused at admission with a reason (no tokens), or
runs; a run that finishes ``"stop"`` must validate with ``jsonschema``
(format checkers on), whatever the backend, with or without best effort.
"""

import copy
import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.request_io import parse_request_lines
from tpguide.guided.keyword_cases import KEYWORD_CASES

CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=96)
BACKENDS = ("xgrammar", "llguidance", "auto")
FAMILIES = {
    "2020-12": ([c for c in KEYWORD_CASES if c.dialect in ("2020-12", "format")], jsonschema.Draft202012Validator),
    "draft-07": ([c for c in KEYWORD_CASES if c.dialect in ("draft-07", "format")], jsonschema.Draft7Validator),
    "draft-04": ([c for c in KEYWORD_CASES if c.dialect == "draft-04"], jsonschema.Draft4Validator),
}


def _strip_schema_uri(schema):
    schema = copy.deepcopy(schema)
    schema.pop("$schema", None)
    return schema


@st.composite
def schemas(draw):
    family = draw(st.sampled_from(sorted(FAMILIES)))
    cases, validator = FAMILIES[family]
    parts = [_strip_schema_uri(c.schema) for c in draw(st.lists(st.sampled_from(cases), min_size=1, max_size=3))]
    shape = draw(st.sampled_from(["one", "object", "array"]))
    if shape == "one":
        schema = parts[0]
    elif shape == "object":
        names = [f"p{i}" for i in range(len(parts))]
        schema = {"type": "object", "properties": dict(zip(names, parts)),
                  "required": [n for n in names if draw(st.booleans())]}
    else:
        schema = {"type": "array", "items": parts[0], "minItems": draw(st.integers(0, 2)), "maxItems": 3}
    if family == "draft-04":
        schema["$schema"] = "http://json-schema.org/draft-04/schema#"
    return schema, validator


@pytest.fixture(scope="module")
def engines(tiny_model_path):
    built = {name: build_engine(TPGroup(), tiny_model_path, EngineConfig(guided_backend=name, **CONFIG))
             for name in BACKENDS}
    yield built
    for engine in built.values():
        engine.shutdown()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=schemas(), backend=st.sampled_from(BACKENDS), strict=st.booleans(),
       whitespace=st.sampled_from(["compact", "bounded"]), seed=st.integers(0, 1000))
def test_every_request_is_refused_with_a_reason_or_runs_and_stop_outputs_validate(
        engines, drawn, backend, strict, whitespace, seed):
    schema, validator_class = drawn
    line = json.dumps({"id": "fuzz", "prompt": "JSON:", "max_tokens": 16, "temperature": 1.0, "seed": seed,
                       "structured_output": {"json": schema, "strict": strict, "json_whitespace": whitespace}})
    (out,) = engines[backend].generate(parse_request_lines([line], 16))
    assert out.finish_reason in ("stop", "length", "error")
    if out.finish_reason == "error":
        assert out.error, out
    if not out.token_ids:
        assert out.finish_reason == "error", out  # refused at admission, with its reason
        return
    assert out.guided_backend in ("xgrammar", "llguidance")
    if out.finish_reason == "stop":
        validator = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)
        errors = list(validator.iter_errors(json.loads(out.text)))
        assert not errors, (schema, out.text, errors[0].message)

"""Fuzz the guided path: random JSON schemas and regexes, tiny model, real tokenizer, tp 1.

Whatever hypothesis draws, generation must not crash or hang; a request
either finishes (``stop``: its text must validate, ``length``: cut off) or
fails alone with ``finish_reason="error"`` and a message.
"""

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.request_io import parse_request_lines

CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96)


@st.composite
def int_schema(draw):
    lo = draw(st.integers(-50, 50))
    return {"type": "integer", "minimum": lo, "maximum": lo + draw(st.integers(0, 100))}


@st.composite
def string_schema(draw):
    lo = draw(st.integers(0, 3))
    return {"type": "string", "minLength": lo, "maxLength": lo + draw(st.integers(0, 6))}


LEAVES = st.one_of(
    int_schema(), string_schema(),
    st.just({"type": "boolean"}), st.just({"type": "null"}), st.just({"type": "number"}),
    st.lists(st.one_of(st.integers(-9, 9), st.sampled_from(["a", "b c", "ü"])), min_size=1, max_size=3,
             unique=True).map(lambda values: {"enum": values}),
)


@st.composite
def object_schema(draw, children):
    names = draw(st.lists(st.sampled_from(["a", "b", "id", "n_2", "x y"]), min_size=1, max_size=3, unique=True))
    props = {name: draw(children) for name in names}
    required = [n for n in names if draw(st.booleans())]
    return {"type": "object", "properties": props, "required": required}


@st.composite
def array_schema(draw, children):
    lo = draw(st.integers(0, 2))
    return {"type": "array", "items": draw(children), "minItems": lo, "maxItems": lo + draw(st.integers(0, 2))}


SCHEMAS = st.recursive(LEAVES, lambda children: st.one_of(object_schema(children), array_schema(children)),
                       max_leaves=4)

ATOMS = st.sampled_from(["a", "b", "z", "0", "-", "[a-c]", "[0-9]", r"\d", "[xyz]", " "])


@st.composite
def regexes(draw):
    def piece(depth):
        if depth > 1 or draw(st.booleans()):
            atom = draw(ATOMS)
        else:
            atom = "(" + "|".join(piece(depth + 1) for _ in range(draw(st.integers(1, 3)))) + ")"
        return atom + draw(st.sampled_from(["", "", "?", "+", "*", "{1,3}", "{2}"]))

    return "".join(piece(0) for _ in range(draw(st.integers(1, 4))))


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    engine = build_engine(TPGroup(), tiny_model_path, CONFIG)
    yield engine
    engine.shutdown()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, regex=regexes(), seed=st.integers(0, 1000))
def test_random_guides_never_crash_and_stop_outputs_validate(engine, schema, regex, seed):
    lines = [
        json.dumps({"id": "schema", "prompt": "JSON:", "structured_output": {"json": schema},
                    "max_tokens": 16, "temperature": 1.0, "seed": seed}),
        json.dumps({"id": "regex", "prompt": "text:", "structured_output": {"regex": regex},
                    "max_tokens": 10, "temperature": 1.0, "seed": seed}),
    ]
    schema_out, regex_out = engine.generate(parse_request_lines(lines, 16))
    for out in (schema_out, regex_out):
        assert out.finish_reason in ("stop", "length", "error")
        assert (out.finish_reason == "error") == (out.error is not None)
    if schema_out.finish_reason == "stop":
        jsonschema.validate(json.loads(schema_out.text), schema)
    if regex_out.finish_reason == "stop":
        assert re.fullmatch(regex, regex_out.text), (regex, regex_out.text)

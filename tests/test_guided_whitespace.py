"""JSON whitespace modes on both backends: compact allows none, bounded at most 12 in a row, any any amount."""

import pytest
from guided_testing import load_test_backend

from tpguide.guided.enforcement import matcher_accepts_text
from tpguide.guided.params import (
    MAX_BOUNDED_WHITESPACE,
    WHITESPACE_MODES,
    StructuredOutputsParams,
    check_whitespace_mode,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
RUN = " " * MAX_BOUNDED_WHITESPACE
TEXTS = {  # text: accepted in (compact, bounded, any)
    '{"a":1}': (True, True, True),
    '{ "a": 1 }': (False, True, True),
    '{\n  "a": 1\n}': (False, True, True),
    '{' + RUN + '"a":1}': (False, True, True),
    '{' + RUN + ' "a":1}': (False, False, True),
    '{"a":1' + "\n" * 40 + '}': (False, False, True),
}


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("mode", WHITESPACE_MODES)
def test_whitespace_mode(tokenizer, backend_name, mode):
    backend = load_test_backend(backend_name, 49152)
    params = StructuredOutputsParams(json=SCHEMA, json_whitespace=mode)  # the per-request override
    compiled = backend.compile(params)
    for text, expected in TEXTS.items():
        ids = tokenizer.encode(text, add_special_tokens=False)
        accepted = matcher_accepts_text(backend.matcher(compiled), ids, backend.stop_token_ids[0])
        assert accepted == expected[WHITESPACE_MODES.index(mode)], (backend_name, mode, text)


def test_override_is_part_of_the_cache_key_and_checked():
    assert StructuredOutputsParams(json=SCHEMA) != StructuredOutputsParams(json=SCHEMA, json_whitespace="any")
    with pytest.raises(ValueError, match=r"json_whitespace must be one of \['compact', 'bounded', 'any'\], got 'x'"):
        StructuredOutputsParams(json=SCHEMA, json_whitespace="x")
    with pytest.raises(ValueError, match="json_whitespace applies to JSON guides only"):
        StructuredOutputsParams(regex="a", json_whitespace="any")
    with pytest.raises(ValueError, match="--json-whitespace must be one of"):
        check_whitespace_mode("tabs", "--json-whitespace")
    parsed = StructuredOutputsParams.from_request({"json": SCHEMA, "strict": False, "json_whitespace": "compact"})
    assert (parsed.strict, parsed.json_whitespace) == (False, "compact")
    with pytest.raises(ValueError, match="strict must be true or false"):
        StructuredOutputsParams(json=SCHEMA, strict="no")

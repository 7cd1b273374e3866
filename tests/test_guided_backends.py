"""Both backends on SmolLM2's real tokenizer: generations obey their guides.

Each generation greedily follows deterministic random logits under the
matcher's bitmask (``tests/guided_testing.py`` ``drive_matcher``) until a stop token.
"""

import json
import re

import jsonschema
import pytest
import torch
from guided_testing import drive_matcher, load_test_backend, steering_biases

from tpguide.guided import StructuredOutputsParams, unpack_bitmask
from tpguide.guided.bitmask import allocate_token_bitmask

#: SmolLM2's 49152 ids padded to 49280 (as for org_vocab_size 49157 at tp 2):
#: the bitmask is that wide, and ids >= 49152 must never be allowed.
PADDED_VOCAB_SIZE = 49280
TOKENIZER_VOCAB_SIZE = 49152
SEEDS = (0, 1, 2)

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "kind": {"anyOf": [{"type": "null"}, {"enum": ["a", "b"]}]},
        },
        "required": ["id", "point", "kind"],
        "additionalProperties": False,
    },
]
REGEX = r"(apple|banana|cherry)-[0-9]{1,3}( [A-Z][a-z]{0,4})?"
CHOICES = ["yes", "no", 'say "hi"\\n', "tab\there"]
EBNF = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"\n'
LARK = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: /[0-9]+/ | "(" expr ")"\n'
GRAMMAR_OF = {"xgrammar": EBNF, "llguidance": LARK}


@pytest.fixture(scope="module")
def biases(tokenizer, stop_ids):
    return steering_biases(tokenizer, PADDED_VOCAB_SIZE, stop_ids)


def get_backend(name, tokenizer, stop_ids):
    backend = load_test_backend(name, PADDED_VOCAB_SIZE)  # shared with the other test modules
    assert backend.stop_token_ids == stop_ids
    return backend


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request, tokenizer, stop_ids):
    return get_backend(request.param, tokenizer, stop_ids)


def generate(backend, params, tokenizer, biases, stop_ids, seed):
    tokens = drive_matcher(
        backend.matcher(backend.compile(params)), PADDED_VOCAB_SIZE, seed=seed, biases=biases,
        stop_token_ids=stop_ids,
    )
    return tokens, tokenizer.decode(tokens[:-1])


def allowed_ids(matcher):
    bitmask = allocate_token_bitmask(1, PADDED_VOCAB_SIZE)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask[0], PADDED_VOCAB_SIZE).nonzero().flatten().tolist()


def bitmask_of(matcher):
    bitmask = torch.zeros(1, PADDED_VOCAB_SIZE // 32, dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask[0].clone()


def test_stop_ids_of_smollm2(stop_ids):
    assert stop_ids == [0, 2]  # <|endoftext|>, <|im_end|>


# ---- generations obey the guide ------------------------------------------------


@pytest.mark.parametrize("schema_index", range(len(SCHEMAS)))
@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema(backend, tokenizer, biases, stop_ids, schema_index, seed):
    schema = SCHEMAS[schema_index]
    _, text = generate(backend, StructuredOutputsParams(json=schema), tokenizer, biases, stop_ids, seed)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("seed", SEEDS)
def test_json_object(backend, tokenizer, biases, stop_ids, seed):
    _, text = generate(backend, StructuredOutputsParams(json_object=True), tokenizer, biases, stop_ids, seed)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", SEEDS)
def test_regex(backend, tokenizer, biases, stop_ids, seed):
    _, text = generate(backend, StructuredOutputsParams(regex=REGEX), tokenizer, biases, stop_ids, seed)
    assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("seed", range(6))
def test_choice(backend, tokenizer, biases, stop_ids, seed):
    _, text = generate(backend, StructuredOutputsParams(choice=CHOICES), tokenizer, biases, stop_ids, seed)
    assert text in CHOICES


def parse_expr(text, i=0):
    """End index of ``expr`` (the EBNF/Lark grammar above) starting at ``i``."""
    i = parse_term(text, i)
    while i < len(text) and text[i] in "+-":
        i = parse_term(text, i + 1)
    return i


def parse_term(text, i):
    if text[i] == "(":
        i = parse_expr(text, i + 1)
        assert text[i] == ")", text
        return i + 1
    j = i
    while j < len(text) and text[j].isdigit():
        j += 1
    assert j > i, text
    return j


@pytest.mark.parametrize("seed", SEEDS)
def test_grammar(backend, tokenizer, biases, stop_ids, seed):
    params = StructuredOutputsParams(grammar=GRAMMAR_OF[backend.name])
    _, text = generate(backend, params, tokenizer, biases, stop_ids, seed)
    assert parse_expr(text) == len(text), text


def test_llguidance_also_takes_gbnf(tokenizer, biases, stop_ids):
    backend = get_backend("llguidance", tokenizer, stop_ids)
    _, text = generate(backend, StructuredOutputsParams(grammar=EBNF), tokenizer, biases, stop_ids, 0)
    assert parse_expr(text) == len(text), text


def test_backend_parity(tokenizer, biases, stop_ids):
    """Each backend accepts, token by token, what the other generated."""
    xgr_backend = get_backend("xgrammar", tokenizer, stop_ids)
    llg_backend = get_backend("llguidance", tokenizer, stop_ids)
    for schema in SCHEMAS:
        params = StructuredOutputsParams(json=schema)
        for source, target in ((xgr_backend, llg_backend), (llg_backend, xgr_backend)):
            tokens, text = generate(source, params, tokenizer, biases, stop_ids, seed=3)
            jsonschema.validate(json.loads(text), schema)
            matcher = target.matcher(target.compile(params))
            assert all(matcher.accept_token(t) for t in tokens), (source.name, text)
            assert matcher.is_terminated()


# ---- vocabulary, stop tokens, rollback -------------------------------------------


def test_padded_and_special_ids_never_allowed(backend, stop_ids):
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(regex=r"[\s\S]*")))
    ids = allowed_ids(matcher)
    assert len(ids) > 40000
    assert max(ids) < TOKENIZER_VOCAB_SIZE
    # Ids 0..16 are special (<|im_start|>, <repo_name>, ...): only the stop tokens
    # among them, allowed because this grammar may end anywhere.
    assert set(ids) & set(range(17)) == set(stop_ids)
    assert not matcher.accept_token(TOKENIZER_VOCAB_SIZE + 3)
    assert not matcher.accept_token(PADDED_VOCAB_SIZE + 3)


def test_stop_tokens_only_at_the_end(backend, tokenizer, stop_ids):
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(choice=["yes"])))
    assert not matcher.accept_token(stop_ids[0])  # grammar not complete yet
    for token_id in tokenizer.encode("yes", add_special_tokens=False):
        assert matcher.accept_token(token_id)
    assert allowed_ids(matcher) == stop_ids
    assert not matcher.is_terminated()
    assert matcher.accept_token(stop_ids[-1])
    assert matcher.is_terminated()
    assert allowed_ids(matcher) == stop_ids  # terminated rows allow only stop tokens
    assert not matcher.accept_token(stop_ids[0])
    assert matcher.num_accepted_tokens == len(tokenizer.encode("yes", add_special_tokens=False)) + 1
    matcher.rollback(1)  # undo the stop token
    assert not matcher.is_terminated() and allowed_ids(matcher) == stop_ids
    assert matcher.accept_token(stop_ids[0]) and matcher.is_terminated()


def test_rejected_token_keeps_state(backend, tokenizer):
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(regex="[0-9]+x")))
    digit, letter = tokenizer.encode("7", add_special_tokens=False)[0], tokenizer.encode("q", add_special_tokens=False)[0]
    assert matcher.accept_token(digit)
    before = bitmask_of(matcher)
    assert not matcher.accept_token(letter)
    assert torch.equal(bitmask_of(matcher), before)
    assert matcher.accept_token(tokenizer.encode("x", add_special_tokens=False)[0])


def test_rollback(backend, tokenizer):
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(json=SCHEMAS[0])))
    tokens = tokenizer.encode('{"name": "Bob', add_special_tokens=False)
    assert len(tokens) >= 3
    assert matcher.accept_token(tokens[0])
    after_one = bitmask_of(matcher)
    assert matcher.accept_token(tokens[1]) and matcher.accept_token(tokens[2])
    assert not torch.equal(bitmask_of(matcher), after_one)
    matcher.rollback(2)
    assert torch.equal(bitmask_of(matcher), after_one)
    assert matcher.num_accepted_tokens == 1
    with pytest.raises(ValueError, match="cannot roll back 2 tokens: 1 accepted"):
        matcher.rollback(2)
    with pytest.raises(ValueError, match="-1"):
        matcher.rollback(-1)


@pytest.mark.parametrize(
    "obj, text",
    [({"choice": ["ab", "abc"]}, "abc"), ({"regex": "[0-9]+"}, "12")],
    ids=["grammar-stopped", "grammar-could-continue"],
)
def test_rollback_over_stop_token(backend, tokenizer, stop_ids, obj, text):
    """llguidance records a stop token only if its grammar could still continue; rollback handles both."""
    matcher = backend.matcher(backend.compile(StructuredOutputsParams.from_request(obj)))
    start = bitmask_of(matcher)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert all(matcher.accept_token(t) for t in tokens)
    before_stop = bitmask_of(matcher)
    assert matcher.accept_token(stop_ids[0]) and matcher.is_terminated()
    matcher.rollback(1)
    assert not matcher.is_terminated()
    assert torch.equal(bitmask_of(matcher), before_stop)
    assert matcher.accept_token(stop_ids[1])
    matcher.rollback(len(tokens) + 1)
    assert torch.equal(bitmask_of(matcher), start)


# ---- errors, cache, structural tags -----------------------------------------------


@pytest.mark.parametrize(
    "obj, fragment",
    [
        ({"json": {"type": 12}, "strict": False}, "json_schema"),  # strict: refused at parse by the metaschema
        ({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "json_schema"),
        ({"regex": "a(b"}, "regex"),
        ({"regex": "[z-a]"}, "regex"),
        ({"grammar": "root ::= foo"}, "grammar"),
        ({"grammar": 'root ::= "a'}, "grammar"),
    ],
)
def test_invalid_guides_raise_value_error(backend, obj, fragment):
    params = StructuredOutputsParams.from_request(obj)
    with pytest.raises(ValueError, match=f"{backend.name} cannot compile this {fragment}: .+"):
        backend.compile(params)


def test_xgrammar_rejects_lark(tokenizer, stop_ids):
    backend = get_backend("xgrammar", tokenizer, stop_ids)
    with pytest.raises(ValueError, match="xgrammar cannot compile this grammar"):
        backend.compile(StructuredOutputsParams(grammar=LARK))


def test_compile_cache(backend):
    params = StructuredOutputsParams(regex="[a-c]{2}")
    compiled = backend.compile(params)
    assert backend.compile(StructuredOutputsParams(regex="[a-c]{2}")) is compiled
    first, second = backend.matcher(compiled), backend.matcher(compiled)
    assert first is not second


LEGACY_TAG = {
    "structures": [
        {
            "begin": "<function=get>",
            "schema": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
            "end": "</function>",
        }
    ],
    "triggers": ["<function="],
}
NEW_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<function="],
        "tags": [
            {
                "begin": "<function=get>",
                "content": {"type": "json_schema", "json_schema": LEGACY_TAG["structures"][0]["schema"]},
                "end": "</function>",
            }
        ],
    },
}


@pytest.mark.parametrize("tag", [LEGACY_TAG, NEW_TAG], ids=["legacy", "new"])
def test_structural_tag(backend, tokenizer, stop_ids, tag):
    params = StructuredOutputsParams(structural_tag=tag)
    if backend.name == "llguidance" and tag is NEW_TAG:
        with pytest.raises(ValueError, match="xgrammar backend supports"):
            backend.compile(params)
        return
    text = 'Sure. <function=get>{"x": 42}</function>'
    matcher = backend.matcher(backend.compile(params))
    assert all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)), text
    assert matcher.accept_token(stop_ids[-1]) and matcher.is_terminated()
    bad = backend.matcher(backend.compile(params))
    tokens = tokenizer.encode('<function=get>{"x": "no"}', add_special_tokens=False)
    assert not all(bad.accept_token(t) for t in tokens)

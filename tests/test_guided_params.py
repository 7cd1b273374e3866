"""StructuredOutputsParams parsing/validation and stop-token collection."""

import json

import pytest

from tpguide.guided import make_backend
from tpguide.guided.params import JSON_OBJECT_SCHEMA, StructuredOutputsParams
from tpguide.model.tokenizer_facts import collect_stop_token_ids

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize(
    "obj, guide_type, text",
    [
        ({"json": SCHEMA}, "json_schema", json.dumps(SCHEMA)),
        ({"json": '{"type": "object"}'}, "json_schema", '{"type": "object"}'),
        ({"json_object": True}, "json", JSON_OBJECT_SCHEMA),
        ({"regex": "[0-9]+"}, "regex", "[0-9]+"),
        ({"choice": ["yes", "no"]}, "choice", '["yes", "no"]'),
        ({"grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
        ({"structural_tag": {"type": "structural_tag"}}, "structural_tag", '{"type": "structural_tag"}'),
        ({"regex": "a", "json": None, "json_object": False}, "regex", "a"),
    ],
)
def test_from_request(obj, guide_type, text):
    params = StructuredOutputsParams.from_request(obj)
    assert params.guide_type == guide_type
    assert params.guide_text == text
    assert params.cache_key() == (guide_type, text, ("strict", True), ("json_whitespace", None))
    hash(params)


def test_from_request_none_and_choice_tuple():
    assert StructuredOutputsParams.from_request(None) is None
    params = StructuredOutputsParams(choice=["a", "b"])
    assert params.choice == ("a", "b")
    assert params == StructuredOutputsParams(choice=("a", "b"))
    assert len({params, StructuredOutputsParams(choice=("a", "b"))}) == 1


def test_schema_key_order_is_kept_in_cache_key():
    reordered = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    assert StructuredOutputsParams(json=SCHEMA).cache_key() != StructuredOutputsParams(json=reordered).cache_key()


@pytest.mark.parametrize(
    "obj, fragments",
    [
        ({"jsn": {}, "regexp": "a"}, ["'jsn'", "'regexp'", "allowed keys", "'json'"]),
        ({}, ["no guide set", "'json'"]),
        ({"regex": "a", "choice": ["b"]}, ["2", "regex='a'", "choice=['b']"]),
        ({"json_object": False}, ["no guide set"]),
        ({"choice": []}, ["non-empty", "[]"]),
        ({"choice": "yes"}, ["list of strings", "str", "'yes'"]),
        ({"choice": ["a", 3, ""]}, ["[3, '']"]),
        ({"regex": 5}, ["regex must be a string", "int", "5"]),
        ({"regex": ""}, ["non-empty", "''"]),
        ({"grammar": "root ::= \x00"}, ["NUL"]),
        ({"json": "{not json"}, ["not valid JSON", "'{not json'"]),
        ({"json": "[1, 2]"}, ["JSON object", "list", "'[1, 2]'"]),
        ({"json": 7}, ["dict or a JSON string", "int", "7"]),
        ({"json_object": "yes"}, ["json_object", "'yes'"]),
        ({"structural_tag": [1]}, ["structural_tag", "list", "[1]"]),
    ],
)
def test_invalid_requests_name_the_values(obj, fragments):
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams.from_request(obj)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_non_dict_request():
    with pytest.raises(ValueError, match="object or null, got list"):
        StructuredOutputsParams.from_request(["json"])


def test_params_are_frozen():
    params = StructuredOutputsParams(regex="a")
    with pytest.raises(AttributeError):
        params.regex = "b"


class FakeTokenizer:
    def __init__(self, vocab, eos_token_id):
        self._vocab, self.eos_token_id = vocab, eos_token_id

    def get_vocab(self):
        return dict(self._vocab)


def test_collect_stop_token_ids(tmp_path):
    tok = FakeTokenizer({"<|eot_id|>": 9, "<|end_of_text|>": 8, "<|eom_id|>": 7, "hi": 3, "</s>": 11}, 8)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 8}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [8, 9, 20]}))
    assert collect_stop_token_ids(tok, tmp_path) == [7, 8, 9, 11, 20]
    assert collect_stop_token_ids(tok, {"eos_token_id": 42}) == [7, 8, 9, 11, 42]
    assert collect_stop_token_ids(tok) == [7, 8, 9, 11]


def test_collect_stop_token_ids_errors(tmp_path):
    with pytest.raises(ValueError, match="no end token"):
        collect_stop_token_ids(FakeTokenizer({"a": 0}, None))
    with pytest.raises(ValueError, match="'x'"):
        collect_stop_token_ids(FakeTokenizer({}, 1), {"eos_token_id": "x"})
    with pytest.raises(ValueError, match="does not exist"):
        collect_stop_token_ids(FakeTokenizer({}, 1), str(tmp_path / "missing"))


def test_make_backend_unknown_name():
    with pytest.raises(ValueError, match=r"'outlines'.*\['auto', 'xgrammar', 'llguidance'\]"):
        make_backend("outlines", None, 64, [0])

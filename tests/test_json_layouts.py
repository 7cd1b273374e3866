"""JSON layouts over bytes: the same forced texts as the layout compiled over the model's vocabulary, token by token."""

import json

import pytest
import xgrammar as xgr

from tpguide.guided import StructuredOutputsParams
from tpguide.guided.json_layouts import JSON_LAYOUTS, LayoutCompiler
from tpguide.guided.xgrammar_backend import make_tokenizer_info

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "place": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
              "required": ["city", "zip"]}},
    "required": ["name", "tags", "place"], "additionalProperties": False}
VALUE = {"name": "Ana Lía", "tags": ["a", "b c"], "place": {"city": "Zürich", "zip": 8001}}
DUMPS = {"indent2": {"indent": 2}, "spaced": {}, "indent4": {"indent": 4}, "compact": {"separators": (",", ":")}}


@pytest.fixture(scope="module")
def info(tokenizer):
    return make_tokenizer_info(tokenizer, VOCAB, [tokenizer.eos_token_id])


@pytest.mark.parametrize("layout", list(JSON_LAYOUTS))
def test_byte_layout_forces_what_the_vocabulary_layout_forces(layout, tokenizer, info):
    """At every token of a ``json.dumps`` text: the same forced string, the same accept, the same end."""
    params = StructuredOutputsParams.from_request({"json": SCHEMA})
    layouts = LayoutCompiler(info.decoded_vocab, "bounded")
    byte_matcher = layouts.matcher(layouts.compile(params, layout))
    vocab_compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, **JSON_LAYOUTS[layout])
    vocab_matcher = xgr.GrammarMatcher(vocab_compiled)
    text = json.dumps(VALUE, ensure_ascii=False, **DUMPS[layout])
    forced = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert byte_matcher.find_jump_forward_string() == vocab_matcher.find_jump_forward_string()
        forced.append(byte_matcher.find_jump_forward_string())
        assert byte_matcher.accept_token(token) and vocab_matcher.accept_token(token)
    assert any(len(f) > 3 for f in forced)  # the layout forces whole keys and indentation
    wrong_space = tokenizer.encode("  ", add_special_tokens=False)[0]
    assert not byte_matcher.accept_token(wrong_space) and not vocab_matcher.accept_token(wrong_space)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert not byte_matcher.accept_token(im_start)  # a special token leaves every layout, as in the vocabulary
    assert not byte_matcher.accept_token(VOCAB + 5)  # an id past the table too


def test_layout_cache_is_bounded_and_refuses_non_json_guides(info):
    layouts = LayoutCompiler(info.decoded_vocab, "bounded", capacity=2)
    params = StructuredOutputsParams.from_request({"json": SCHEMA})
    for layout in JSON_LAYOUTS:
        layouts.compile(params, layout)
    assert len(layouts) == 2 and layouts.cached(params, "compact") is not None
    assert layouts.cached(params, "indent2") is None  # evicted, least recently used
    with pytest.raises(ValueError, match="no 'indent2' JSON layout for a regex guide"):
        layouts.compile(StructuredOutputsParams.from_request({"regex": "a+"}), "indent2")
    with pytest.raises(ValueError, match="cannot compile the compact layout"):
        layouts.compile(StructuredOutputsParams.from_request({"json": {"type": "nonsense"}, "strict": False}),
                        "compact")  # strict: false skips the metaschema check that refuses it at parse

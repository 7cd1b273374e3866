"""xgrammar's masks built on first use (``enable_dynamic_compilation``) equal the eagerly compiled ones, state by state."""

import inspect
import json

import pytest
import torch
import xgrammar as xgr

from tpguide.guided.xgrammar_backend import make_grammar_compiler, make_tokenizer_info

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": -5},
    "kind": {"enum": ["a", "bb", "ccc"]}, "tags": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    "when": {"type": "string", "format": "date"}},
    "required": ["name", "n", "kind"], "additionalProperties": False}
VALUE = {"name": "Ana Lía", "n": 42, "kind": "bb", "tags": [1.5, -2, 3e2], "when": "2024-02-29"}


@pytest.mark.skipif("enable_dynamic_compilation" not in inspect.signature(xgr.GrammarCompiler.__init__).parameters,
                    reason="this xgrammar compiles eagerly only")
@pytest.mark.parametrize("indent", [None, 2])
def test_dynamic_masks_equal_eager_masks_along_an_output(indent, tokenizer):
    info = make_tokenizer_info(tokenizer, VOCAB, [tokenizer.eos_token_id])
    options = {"any_whitespace": True, "max_whitespace_cnt": 12}
    dynamic = make_grammar_compiler(info, 2).compile_json_schema(json.dumps(SCHEMA), **options)
    eager = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA), **options)
    matchers = [xgr.GrammarMatcher(dynamic), xgr.GrammarMatcher(eager)]
    masks = [xgr.allocate_token_bitmask(1, VOCAB) for _ in matchers]
    tokens = tokenizer.encode(json.dumps(VALUE, indent=indent, ensure_ascii=False), add_special_tokens=False)
    for token in tokens + [tokenizer.eos_token_id]:
        for matcher, mask in zip(matchers, masks):
            matcher.fill_next_token_bitmask(mask)
        assert torch.equal(masks[0], masks[1])
        assert all(matcher.accept_token(token) for matcher in matchers)
    assert all(matcher.is_terminated() for matcher in matchers)

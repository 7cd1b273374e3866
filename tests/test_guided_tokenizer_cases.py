"""Tokenizer edge cases: an id gap keeps its EOS; llguidance and the metaspace U+2581."""

import json

import pytest
from guided_testing import metaspace_tokenizer, write_id_gap_tokenizer

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, generate_on_group
from tpguide.guided import make_backend
from tpguide.guided.admission import admit
from tpguide.guided.bitmask import allocate_token_bitmask, unpack_bitmask
from tpguide.guided.enforcement import matcher_accepts_text
from tpguide.guided.params import StructuredOutputsParams
from tpguide.model.tokenizer_facts import producible_vocab_size

METASPACE = "\u2581"


@pytest.fixture(scope="module")
def gap_model(tmp_path_factory):
    from tpguide.model.random_checkpoint import write_random_checkpoint

    tok_dir = tmp_path_factory.mktemp("gap-tokenizer")
    write_id_gap_tokenizer(str(tok_dir))
    # the model's eos is the tokenizer's (15), not LlamaConfig's default 2 (here the letter "c")
    (tok_dir / "config.json").write_text(json.dumps({"eos_token_id": 15}))
    return str(write_random_checkpoint(tmp_path_factory.mktemp("gap-model"), vocab_size=64,
                                       tokenizer_dir=str(tok_dir), seed=2))


def test_producible_vocab_size_covers_the_gap(tmp_path):
    tokenizer = write_id_gap_tokenizer(str(tmp_path))
    assert (len(tokenizer), tokenizer.eos_token_id) == (11, 15)
    assert producible_vocab_size(tokenizer) == 16


@pytest.mark.parametrize("backend", ["xgrammar", "auto"])
def test_tokenizer_with_an_id_gap_keeps_its_eos(gap_model, backend):
    requests = [{"id": "choice", "prompt": "abc", "structured_output": {"choice": ["ab"]}, "max_tokens": 8},
                {"id": "regex", "prompt": "abc", "structured_output": {"regex": "[a-j]{3}"}, "max_tokens": 8}]
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32, guided_backend=backend)
    outputs = {o["id"]: o for o in generate_on_group(TPGroup(), gap_model, requests, config, 8)}
    # the grammar ends after "ab" / three letters: only EOS (id 15 > len(tokenizer)) may follow
    assert outputs["choice"]["finish_reason"] == "stop", outputs["choice"]
    assert outputs["choice"]["text"] == "ab" and outputs["choice"]["token_ids"] == [0, 1, 15]
    assert outputs["regex"]["finish_reason"] == "stop" and len(outputs["regex"]["text"]) == 3, outputs["regex"]
    assert {o["guided_backend"] for o in outputs.values()} == {"xgrammar"}


def test_llguidance_refuses_a_tokenizer_with_an_id_gap_clearly(tmp_path):
    tokenizer = write_id_gap_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="llguidance cannot use this tokenizer.*11 tokens, ids up to 15.*xgrammar"):
        make_backend("llguidance", tokenizer, 64, [15])
    auto = make_backend("auto", tokenizer, 64, [15])
    assert list(auto.backends) == ["xgrammar"] and "llguidance" in auto.unavailable


@pytest.fixture(scope="module")
def sp_backends():
    tokenizer = metaspace_tokenizer()
    return tokenizer, {name: make_backend(name, tokenizer, 320, [2]) for name in ("xgrammar", "llguidance", "auto")}


def _first_mask(backend, params):
    row = allocate_token_bitmask(1, backend.padded_vocab_size)
    backend.matcher(backend.compile(params)).fill_next_token_bitmask(row, 0)
    return unpack_bitmask(row, backend.padded_vocab_size)[0].nonzero().flatten().tolist()


GUIDES = [StructuredOutputsParams(regex=f"{METASPACE}dog"), StructuredOutputsParams(json={"const": f"{METASPACE}x"}),
          StructuredOutputsParams(regex="\\u2581dog")]


@pytest.mark.parametrize("params", GUIDES, ids=["regex", "schema-const", "regex-escape"])
def test_llguidance_refuses_u2581_on_a_metaspace_tokenizer(sp_backends, params):
    _, backends = sp_backends
    assert backends["llguidance"].rewrites_metaspace
    with pytest.raises(ValueError, match="contains U\\+2581.*SentencePiece-style.*xgrammar"):
        backends["llguidance"].compile(params)


def test_xgrammar_and_auto_run_u2581_with_a_consistent_mask(sp_backends):
    tokenizer, backends = sp_backends
    params = GUIDES[0]
    assert admit(backends["auto"], params)[0] == "xgrammar"  # auto's matchers come from its admitted guides
    for name in ("xgrammar", "auto"):
        backend = backends[name]
        allowed = _first_mask(backend, params)
        assert tokenizer.convert_ids_to_tokens(allowed) == ["<0xE2>"]  # the byte-fallback path, not "▁dog"
        for token_id in allowed:  # every allowed token is accepted
            assert backend.matcher(backend.compile(params)).accept_token(token_id)
        ids = tokenizer.convert_tokens_to_ids(["<0xE2>", "<0x96>", "<0x81>", "dog"])
        assert matcher_accepts_text(backend.matcher(backend.compile(params)), ids, 2)
    assert backends["auto"].compile(params).backend_name == "xgrammar"  # the admission, from auto's cache


def test_llguidance_keeps_real_spaces_on_a_metaspace_tokenizer(sp_backends):
    tokenizer, backends = sp_backends
    backend = backends["llguidance"]
    params = StructuredOutputsParams(regex=" dog")
    allowed = _first_mask(backend, params)
    assert allowed and all(backend.matcher(backend.compile(params)).accept_token(t) for t in allowed)


def test_byte_level_tokenizer_is_not_flagged(tokenizer):
    from guided_testing import load_test_backend

    assert not load_test_backend("llguidance", 49152).rewrites_metaspace

"""Receipts (docs/receipts.md): the guide hash, the output hashes, the exactness class, the model fingerprint,
and the receipts of a real tp-1 run on the tiny random model (tp 2 and replay: multigpu/test_receipts_replay_tp.py).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, generate_on_group
from tpguide.engine import model_fingerprint as fingerprint_module
from tpguide.engine.model_fingerprint import CACHE_NAME, model_fingerprint
from tpguide.engine.receipt import logprobs_hash, token_ids_hash
from tpguide.engine.request_io import parse_request
from tpguide.guided.guide_hash import guide_hash
from tpguide.guided.params import StructuredOutputsParams
from tpguide.kernels.exactness_class import cpu_exactness_class, exactness_class


def _hash(schema) -> str:
    return guide_hash(StructuredOutputsParams(json=schema))


def test_guide_hash_ignores_keyword_order_but_not_property_order():
    a = {"type": "object", "required": ["x"], "properties": {"x": {"type": "integer", "minimum": 0},
                                                             "y": {"type": "string"}}}
    keywords_moved = {"properties": {"x": {"minimum": 0, "type": "integer"}, "y": {"type": "string"}},
                      "required": ["x"], "type": "object"}
    properties_swapped = {"type": "object", "required": ["x"], "properties": {"y": {"type": "string"},
                                                                             "x": {"type": "integer", "minimum": 0}}}
    assert _hash(a) == _hash(keywords_moved) == _hash(json.dumps(keywords_moved))
    assert _hash(a) != _hash(properties_swapped)
    # a const object is data: the grammar writes its keys in the order given
    assert _hash({"const": {"a": 1, "b": 2}}) != _hash({"const": {"b": 2, "a": 1}})
    # the kind is part of the hash: the same text as a regex and as a grammar hash apart
    assert guide_hash(StructuredOutputsParams(regex="a+")) != guide_hash(StructuredOutputsParams(grammar="a+"))


def test_output_hashes_change_with_one_token_or_one_logprob_bit():
    ids = [5, 17, 0]
    logprobs = [{"token_id": t, "logprob": -0.25 * (i + 1), "top": [[t, -0.25 * (i + 1)], [3, -4.0]]}
                for i, t in enumerate(ids)]
    assert token_ids_hash(ids) != token_ids_hash([5, 18, 0])
    base = logprobs_hash(logprobs)
    flipped = json.loads(json.dumps(logprobs))
    flipped[1]["logprob"] = math.nextafter(flipped[1]["logprob"], 0.0)  # one bit of the float64
    assert logprobs_hash(flipped) != base
    flipped_top = json.loads(json.dumps(logprobs))
    flipped_top[2]["top"][1][1] = math.nextafter(-4.0, 0.0)
    assert logprobs_hash(flipped_top) != base
    assert logprobs_hash(json.loads(json.dumps(logprobs))) == base  # JSON round trip keeps the bits
    assert logprobs_hash(None) is None


def test_exactness_class_table():
    for isa in ("default", "avx2", "avx512", "amx"):
        assert cpu_exactness_class(isa, torch.float32) == "cpu-fixed-order"
    for isa in ("default", "avx2", "avx512"):
        assert cpu_exactness_class(isa, torch.bfloat16) == "cpu-fixed-order"
    assert cpu_exactness_class("amx", torch.bfloat16) == "cpu-amx"
    assert cpu_exactness_class("avx512_bf16", torch.bfloat16) == "cpu-avx512bf16"
    assert cpu_exactness_class("avx512_bf16", torch.float32) == "cpu-fixed-order"
    assert cpu_exactness_class("avx10", torch.float32) == "cpu-avx10"  # an ISA not declared: a class of its own
    cpu = torch.device("cpu")
    assert exactness_class(cpu, torch.float32, False, 2) == "cpu-not-invariant-tp2"
    assert exactness_class(cpu, torch.float32, True, 2, isa="avx2", triton_forced=False) == "cpu-fixed-order"
    assert exactness_class(cpu, torch.float32, True, 1, triton_forced=True) == "cpu-triton-interpreter"


def test_fingerprint_is_cached_by_size_and_mtime_and_follows_the_content(tiny_model_path, tmp_path, monkeypatch):
    model = tmp_path / "m"
    shutil.copytree(tiny_model_path, model, ignore=shutil.ignore_patterns(CACHE_NAME))
    first = model_fingerprint(str(model))
    assert (model / CACHE_NAME).is_file() and first["files"] >= 4
    calls = []
    real = fingerprint_module.file_sha256
    monkeypatch.setattr(fingerprint_module, "file_sha256", lambda p: calls.append(p.name) or real(p))
    assert model_fingerprint(str(model)) == first and calls == []  # unchanged files: nothing re-read
    config = json.loads((model / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-5) * 2
    (model / "config.json").write_text(json.dumps(config))
    changed = model_fingerprint(str(model))
    assert calls == ["config.json"]
    assert changed["config"] != first["config"] and changed["weights"] == first["weights"]
    assert changed["sha256"] != first["sha256"]
    templated = model_fingerprint(str(model), chat_template="{{ messages }}")
    assert templated["chat_template"] != changed["chat_template"] and templated["tokenizer"] == changed["tokenizer"]


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "number", "multipleOf": 3}},
          "required": ["ok"]}
REQUESTS = [
    {"id": "schema", "prompt": "JSON:", "structured_output": {"json": SCHEMA, "strict": False}, "max_tokens": 20,
     "logprobs": 2},
    {"id": "choice", "messages": [{"role": "user", "content": "colour?"}],
     "structured_output": {"choice": ["red", "green"]}, "temperature": 1.0, "seed": 7},
    {"id": "free", "prompt": "Once upon", "max_tokens": 6, "temperature": 0.8, "logprobs": 1},
]


@pytest.fixture(scope="module")
def outputs(tiny_model_path):
    return {o["id"]: o for o in generate_on_group(
        TPGroup(), tiny_model_path, REQUESTS, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                           max_model_len=128, seed=11))}


def test_receipts_of_a_run(outputs, tiny_model_path):
    schema, choice, free = outputs["schema"]["receipt"], outputs["choice"]["receipt"], outputs["free"]["receipt"]
    assert schema["model"] == choice["model"] == model_fingerprint(tiny_model_path, schema_template(tiny_model_path))
    assert schema["engine"]["exactness_class"] == exactness_class(torch.device("cpu"), torch.float32, True, 1)
    assert free["sampling"]["seed"] == (11 * 1_000_003 + 2) % (2**63 - 1) and not free["sampling"]["seed_given"]
    assert choice["sampling"]["seed"] == 7 and choice["sampling"]["seed_given"]
    for rid, out in outputs.items():
        receipt = out["receipt"]
        assert receipt["output"]["token_ids"] == token_ids_hash(out["token_ids"])
        assert receipt["output"]["logprobs"] == logprobs_hash(out.get("logprobs"))
        assert receipt["enforcement"]["generated_tokens"] == len(out["token_ids"])
        given = parse_request(next(r for r in REQUESTS if r["id"] == rid), 0, 64)
        again = parse_request(out["request"], 0, 64)  # the line parses back to the request that ran
        assert (again.sampling_params, again.structured_output, again.prompt, again.messages) == (
            given.sampling_params, given.structured_output, given.prompt, given.messages)
    guide = schema["guide"]
    assert guide["hash"] == _hash(SCHEMA) and guide["strict"] is False and guide["backend"] == "xgrammar"
    assert guide["json_whitespace"] == "bounded" and guide["backend_version"]
    enforcement = schema["enforcement"]
    assert enforcement["masked_tokens"] == len(outputs["schema"]["token_ids"])
    # best effort on xgrammar: multipleOf is not enforced, so it is checked after generation only
    assert enforcement["checked_after_generation"] == [
        {"pointer": "/properties/n/multipleOf", "reason": "'multipleOf (number)' is not enforced by xgrammar"}]
    finish = outputs["schema"]["finish_reason"]
    assert enforcement["post_check"] == {"stop": "passed", "error": "failed"}.get(finish, f"not run (finish_reason {finish})")
    assert free["guide"] is None and free["enforcement"]["masked_tokens"] == 0
    assert outputs["choice"]["request"]["seed"] == 7 and "seed" not in outputs["free"]["request"]


def schema_template(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).chat_template


def test_replay_cli_one_request_at_a_time(outputs, tiny_model_path, tmp_path, capsys):
    from tpguide.cli import replay

    lines = [outputs[r["id"]] for r in REQUESTS]
    flipped = json.loads(json.dumps(lines[0]))
    flipped["id"] = flipped["request"]["id"] = "schema-flipped"
    flipped["logprobs"][2]["logprob"] = math.nextafter(flipped["logprobs"][2]["logprob"], 0.0)  # one bit
    path = tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines + [flipped]))
    status = replay.main([str(path), "--model", tiny_model_path, "--batch", "one", "--max-num-batched-tokens", "64"])
    printed = capsys.readouterr().out
    assert status == 1 and "3 of 4 requests identical at tp 1, batch one" in printed
    assert all(f"{r['id']}: identical" in printed for r in REQUESTS)
    token = flipped["token_ids"][2]
    assert f"schema-flipped: differs at position 2: recorded token {token}" in printed and f"replayed token {token}" in printed
    (path.parent / "bad.jsonl").write_text("{not json\n")
    assert replay.main([str(path.parent / "bad.jsonl"), "--model", tiny_model_path]) == 2


def test_reasoning_tokens_are_counted_apart_from_the_masked_answer(reasoning_model_path):
    from reasoning_testing import THINK_END_ID, reasoning_requests

    lines = [r for r in reasoning_requests() if r["id"] in ("no-thinking", "unguided")
             or r["id"].startswith(("json-8-", "choice-1-"))]
    outs = generate_on_group(TPGroup(), reasoning_model_path, lines, EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=256, max_model_len=96, reasoning_parser="qwen3"))
    assert len(outs) == 4 and sum(THINK_END_ID in o["token_ids"] for o in outs) >= 2
    for line, out in zip(lines, outs):
        enforcement, ids = out["receipt"]["enforcement"], out["token_ids"]
        thought = ids.index(THINK_END_ID) + 1 if line["id"] != "no-thinking" and THINK_END_ID in ids else 0
        if line["id"] != "no-thinking" and THINK_END_ID not in ids:
            thought = len(ids)  # still thinking at the end: nothing was constrained
        assert enforcement["reasoning_tokens"] == thought, (line["id"], ids)
        guided = "structured_output" in line
        assert enforcement["masked_tokens"] == (len(ids) - thought if guided else 0), line["id"]
        assert out["receipt"]["engine"]["reasoning_parser"] == "qwen3"


def test_single_token_rows_equal_the_one_row_oracle():
    from tpguide.guided.bitmask import find_single_token_rows, single_allowed_token, token_ids_to_bitmask_row

    gen = torch.Generator().manual_seed(0)
    vocab = 320
    rows = [[], [0], [31], [32], [63], [319], [5, 6], [31, 32], [0, 319]]
    rows += [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in torch.randint(1, 3, (20,), generator=gen)]
    bitmask = torch.stack([token_ids_to_bitmask_row(ids, vocab) for ids in rows])
    token_mask = torch.ones(len(rows), dtype=torch.int32)
    token_mask[1] = 0  # an unguided row never counts
    expected = [i for i, row in enumerate(bitmask) if token_mask[i] and single_allowed_token(row, vocab) is not None]
    assert find_single_token_rows(bitmask, token_mask) == expected and 2 in expected and 3 in expected


def test_replay_names_a_top_alternative_that_differs():
    from tpguide.engine.replay import first_difference

    recorded = {"token_ids": [1, 2], "finish_reason": "stop",
                "logprobs": [{"logprob": -0.5, "top": [[1, -0.5], [3, -2.0]]},
                             {"logprob": -0.1, "top": [[2, -0.1], [4, -3.0]]}]}
    replayed = json.loads(json.dumps(recorded))
    replayed["logprobs"][1]["top"][1][1] = math.nextafter(-3.0, 0.0)  # one bit of an alternative
    found = first_difference(recorded, replayed)
    assert found["index"] == 1 and found["recorded_bits"] == found["replayed_bits"]
    assert found["recorded_top"][1] == (4, "c008000000000000") and found["replayed_top"][1][1] != "c008000000000000"
    assert first_difference(recorded, json.loads(json.dumps(recorded))) is None

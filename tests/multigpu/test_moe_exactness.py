"""Mixtures of experts are bit-exact at tp 1 and 2: batch, chunking, verify passes, grammar drafts, guided JSON.

``torch.equal`` / ``np.array_equal``, never a tolerance (docs/models.md,
"Mixtures of experts").  Per family (the tiny Qwen3-MoE and Mixtral of
:func:`tiny_hf_config`, 8 experts, top-2, SmolLM2's tokenizer; Qwen3-MoE in bf16, Mixtral in fp32), at
tp 1 (this process) and tp 2 (gloo):

* the cases of ``test_batch_invariance._cases``: a prompt alone, chunked,
  its decode rows as one verify pass, and inside batches of 2, 8 and 32
  other prompts; plus a batch of copies of the prompt, whose tokens route to
  exactly the experts of the prompt's own (checked on the recorded
  routing): every row equals the row alone;
* each tp-2 rank's logits shard equals the slice of the tp-1 logits;
* each rank holds half of every expert (bytes of the expert weights);
* without ``tp_invariant`` (library kernels, an all-reduce), tp 2 gives tp 1's
  fp32 logits up to rounding;
* the engine with grammar drafts (the default) gives the token ids and
  logprobs of the engine without drafts; its JSON-schema request ends with
  ``stop`` and valid JSON, the same tokens at tp 1 and 2.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from grammar_draft_testing import key, run
from test_batch_invariance import PROMPT_LEN, _cases, _forward, _tokens

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_at_tp_size
from tpguide.engine import EngineConfig
from tpguide.model.loader import load_model
from tpguide.model.moe import SparseMoeBlock, expert_weight_bytes
from tpguide.model.random_checkpoint import tiny_hf_config, write_random_model

ARCHS = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
#: One dtype per family (the same block): bf16, the CPU's default, with Qwen3-MoE's routing weights rounded to
#: it; fp32, where a changed order of additions is not rounded away (bf16 hides most of them in a tiny model).
DTYPES = {"Qwen3MoeForCausalLM": torch.bfloat16, "MixtralForCausalLM": torch.float32}
VOCAB = 49152  # SmolLM2's tokenizer
COPIES = 6
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
LINES = [{"id": "json", "messages": [{"role": "user", "content": "A person as JSON"}],
          "structured_output": {"json": SCHEMA}, "max_tokens": 40, "logprobs": 1},
         {"id": "regex", "prompt": "Date:", "structured_output": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"},
          "max_tokens": 16, "logprobs": 1}]
BASE = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=128, dtype=torch.bfloat16)


def _record_routing(model) -> list:
    """Wrap each MoE block's router (in this test only) so that every step's ``topk_ids`` are appended to a list."""
    log: list = []
    for block in (m for m in model.modules() if isinstance(m, SparseMoeBlock)):
        route = block.gate.forward

        def recorded(x, route=route):
            ids, weights = route(x)
            log.append(ids.clone())
            return ids, weights
        block.gate.forward = recorded
    return log


def _copies_case(model) -> tuple[dict, list]:
    """The prompt alone and in a batch of :data:`COPIES` copies (the same experts per token, every layer)."""
    s = _tokens(PROMPT_LEN, 0, model.config.org_vocab_size)
    log = _record_routing(model)
    alone = _forward(model, [(0, 0, s)])[0]
    alone_routes = list(log)
    log.clear()
    rows = _forward(model, [(j, 0, s) for j in range(COPIES)])
    for single, batched in zip(alone_routes, log):  # per MoE layer: each copy routed as the prompt alone
        assert torch.equal(batched.view(COPIES, PROMPT_LEN, -1), single.expand(COPIES, -1, -1))
    bad = [f"copy {j}" for j in range(COPIES) if not np.array_equal(rows[j], alone)]
    return {"copies": alone[-1]}, bad


def _job(group: TPGroup, model_dirs: dict) -> dict:
    """``{arch: (case logits rows, cases that differ from alone, vocab range, expert bytes)}``, ``(arch, "plain")``."""
    out = {}
    for arch, model_dir in model_dirs.items():
        model = load_model(model_dir, group, DTYPES[arch])
        model.allocate_kv_cache(32, 64)
        alone, bad = _cases(model)
        copies, bad_copies = _copies_case(model)
        shard = model.vocab_shard
        out[arch] = ({**alone, **copies}, bad + bad_copies, (shard.vocab_start_index, shard.vocab_end_index),
                     expert_weight_bytes(model))
        plain = load_model(model_dir, group, tp_invariant=False)  # library kernels, one all-reduce per MoE layer
        plain.allocate_kv_cache(1, 64)
        out[arch, "plain"] = _forward(plain, [(0, 0, _tokens(PROMPT_LEN, 0, VOCAB))])[0][-1]
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, default_model_path):
    return {arch: str(write_random_model(tmp_path_factory.mktemp(arch),
                                         tiny_hf_config(arch, VOCAB, tokenizer_dir=default_model_path),
                                         seed=11, tokenizer_dir=default_model_path)) for arch in ARCHS}


@pytest.fixture(scope="module")
def tp1(model_dirs):
    return _job(TPGroup(), model_dirs)


def test_rows_equal_alone_and_tp2_shards_equal_tp1(model_dirs, tp1):
    for arch in ARCHS:
        assert not tp1[arch][1], f"tp 1 {arch}: differ from the row alone: {tp1[arch][1]}"
    for rank, res in enumerate(run_at_tp_size(_job, 2, model_dirs)):
        for arch in ARCHS:  # the plain mode (fp32) at tp 2: its tp-1 logits up to rounding
            start, end = res[arch][2]
            width = min(end, VOCAB) - start
            np.testing.assert_allclose(res[arch, "plain"][:width], tp1[arch, "plain"][start:start + width],
                                       atol=1e-4, rtol=0)
        for arch, (alone, bad, (start, end), expert_bytes) in ((a, res[a]) for a in ARCHS):
            assert not bad, f"tp 2 rank {rank} {arch}: differ from the row alone: {bad}"
            reference, _, _, whole = tp1[arch]
            assert 2 * expert_bytes == whole, f"{arch} rank {rank}: {expert_bytes} expert bytes of {whole}"
            print(f"{arch}: expert weights per rank {whole / 2**10:.0f} KiB at tp 1, {expert_bytes / 2**10:.0f} "
                  f"KiB at tp 2 (rank {rank})")
            for case, got in alone.items():
                want = reference[case]
                width = max(min(end, want.shape[-1]) - start, 0)
                assert np.array_equal(got[:width], want[start:start + width]), f"{arch} rank {rank} {case}"


@pytest.mark.parametrize("arch", ARCHS)
def test_grammar_drafts_and_tp_change_no_token_and_the_json_is_valid(arch, model_dirs):
    import jsonschema

    plain, stats = run(TPGroup(), model_dirs[arch], LINES, EngineConfig(**BASE, speculative_method=None))
    assert stats is None
    by_id = {o["id"]: o for o in plain}
    assert by_id["json"]["finish_reason"] == "stop", by_id["json"]
    jsonschema.validate(json.loads(by_id["json"]["text"]), SCHEMA)
    for tp_size in (1, 2):
        for outputs, stats in run_at_tp_size(run, tp_size, model_dirs[arch], LINES, EngineConfig(**BASE)):
            assert key(outputs) == key(plain), f"{arch} tp {tp_size}"
            assert stats.num_forced_accepted > 0, stats  # forced JSON text was drafted and accepted

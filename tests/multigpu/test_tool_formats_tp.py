"""Tool-call formats give the same token ids at tp 1 and tp 2, and with grammar drafts on and off.

One job covers llama3_json, mistral, qwen3 and qwen3_coder (hermes is covered by
``test_engine_grammar_draft.py``), each on a tiny random model of its family
with a family-style template (``tests/tool_format_testing.py``), with
``tool_choice`` required, named and auto on xgrammar and required on
llguidance (not for qwen3_coder, whose guide is xgrammar's only): two gloo ranks with grammar drafts (the default) give exactly
the token ids and logprobs of tp 1 without drafts, and so does tp 1 with
drafts; the forced parts of a call (the call's opening, the name, the
arguments key) are drafted and accepted, so a required or named call takes
fewer forward passes than it has tokens.
"""

from __future__ import annotations

import pytest
from grammar_draft_testing import key
from tool_format_testing import FAMILIES, family_setup, run_formats, tool_lines, write_family_model

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_at_tp_size
from tpguide.engine import EngineConfig
from tpguide.model.dtype import resolve_dtype

FORMATS_TP = ("llama3_json", "mistral", "qwen3", "qwen3_coder")
BASE = dict(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=1024, guided_backend="auto",
            dtype=resolve_dtype("auto", "cpu"))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, default_model_path):
    out = []
    for name in FORMATS_TP:
        arch, template, _ = FAMILIES[name]
        model = write_family_model(tmp_path_factory.mktemp(name), arch, template, default_model_path, seed=5)
        lines, _ = tool_lines(family_setup(model, name), name)
        out.append((model, lines))
    return out


@pytest.fixture(scope="module")
def plain(jobs):
    results = run_formats(TPGroup(), jobs, EngineConfig(**BASE, speculative_method=None))
    for outputs, _ in results:
        assert all(o["finish_reason"] in ("stop", "length") for o in outputs), [o["error"] for o in outputs]
        forced = [o["finish_reason"] for o in outputs if "auto" not in o["id"]]
        assert forced == ["stop"] * len(forced) and len(forced) >= 2  # qwen3_coder has no llguidance line
    return results


def test_drafts_at_tp1_change_no_token_and_save_passes_on_forced_calls(jobs, plain):
    forced = [(model, [line for line in lines if "auto" not in line["id"]]) for model, lines in jobs]
    for (outputs, stats), (want, _) in zip(run_formats(TPGroup(), forced, EngineConfig(**BASE)), plain):
        assert key(outputs) == key([o for o in want if "auto" not in o["id"]])
        assert stats.num_forced_accepted > 0, stats
        assert stats.num_sample_passes < stats.num_generated_tokens, stats  # passes per token < 1


def test_tp2_with_drafts_gives_the_tokens_of_tp1_without(jobs, plain):
    for rank_results in run_at_tp_size(run_formats, 2, jobs, EngineConfig(**BASE)):
        for (outputs, _), (want, _) in zip(rank_results, plain):
            assert key(outputs) == key(want)

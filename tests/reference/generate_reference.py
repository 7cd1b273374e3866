"""Write ``tests/reference/outputs.json``: token ids of the pre-refactor engine (commit 5d3fc53).

Run ONLY on the old commit (``git worktree add /tmp/old 5d3fc53`` then
``PYTHONPATH=/tmp/old python tests/reference/generate_reference.py OUT``): the
file is the regression oracle of ``tests/multigpu/test_reference_outputs.py``
and must never be regenerated from the code it checks.

Every request set of the engine tests in ``tests/`` (the request lines and
the engine limits are stored with the outputs, so the check does not import
the test modules) on the tiny random-weight model, and the built-in demo of
``launch/generate.py`` on the embedded model, each at tp 1, 2 and 4 (gloo).
Only stable entry points are used: ``build_engine``, ``parse_request_lines``,
``Engine.generate``/``shutdown``/``run_worker``.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "launch"), os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "multigpu")]

CONFIG_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "guided_backend", "seed",
                 "speculative_method", "num_speculative_tokens")


def request_sets():
    """``[(name, model, lines, config dict, default_max_tokens)]`` from the test modules and the demo."""
    import test_bad_requests as bad
    import test_engine_draft_head as dh
    import test_engine_faults as faults
    import test_engine_logprobs as lp
    import test_engine_prompt_logprobs as plp
    import test_engine_slots as slots
    import test_engine_speculative as spec
    import test_engine_tp as tp
    import test_generate_real as real
    import test_rank_failure as rf
    from demo_requests import DEMO_REQUESTS

    from tpguide.engine import EngineConfig

    def cfg(c):
        return {f: getattr(c, f) for f in CONFIG_FIELDS}

    def dumps(reqs):
        return [json.dumps(r) for r in reqs]

    eos = {"id": "a", "prompt": "Once upon a time", "max_tokens": 8}
    return [
        ("engine_tp", "tiny", dumps(tp.REQUESTS), cfg(tp.CONFIG), 64),
        ("engine_speculative_plain", "tiny", dumps(spec.REQUESTS), cfg(spec.PLAIN), 64),
        ("engine_speculative_ngram", "tiny", dumps(spec.REQUESTS), cfg(spec.SPEC), 64),
        ("engine_slots_one_slot", "tiny", dumps(slots.REQUESTS), cfg(slots.ONE_SLOT), 64),
        ("engine_slots_two_slots", "tiny", dumps(slots.REQUESTS),
         cfg(EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256)), 64),
        ("engine_faults", "tiny", dumps(faults.REQUESTS), cfg(faults.CONFIG), 8),
        ("engine_prompt_logprobs_unchunked", "tiny", dumps(plp.REQUESTS), cfg(plp.UNCHUNKED), 64),
        ("engine_prompt_logprobs_chunked", "tiny", dumps(plp.REQUESTS), cfg(plp.CHUNKED), 64),
        ("engine_draft_head_plain", "tiny", dumps(dh.REQUESTS), cfg(EngineConfig(**dh.BASE)), 64),
        ("engine_logprobs", "tiny", dumps(lp.REQUESTS), cfg(lp.CHUNKED), 64),
        ("bad_requests", "tiny", dumps(bad.MIXED), cfg(bad.CONFIG), bad.MAX_TOKENS),
        ("rank_failure", "tiny", list(rf.LINES), cfg(rf.CONFIG), 64),
        ("ignore_eos", "tiny", dumps([eos, {**eos, "id": "b", "ignore_eos": True}]),
         cfg(EngineConfig(max_num_seqs=2, max_model_len=64)), 8),
        ("generate_real", "default", dumps(real.REQUESTS), cfg(EngineConfig()), 40),
        ("demo", "default", dumps(DEMO_REQUESTS), cfg(EngineConfig()), 64),
    ]


def run_sets(group, model_paths, sets):
    """Every set on this group (spawnable); every rank returns the driver's outputs per set."""
    from tpguide.dist import group as C
    from tpguide.engine import EngineConfig
    from tpguide.engine.offline import build_engine
    from tpguide.engine.request_io import parse_request_lines

    results = []
    for _name, model, lines, config, default_max_tokens in sets:
        engine = build_engine(group, model_paths[model], EngineConfig(**config))
        out = None
        if group.is_driver:
            out = [{"id": o.id, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                   for o in engine.generate(parse_request_lines(lines, default_max_tokens))]
            engine.shutdown()
        else:
            engine.run_worker()
        results.append(C.broadcast_object(out, group))
    return results


def main(out_path: str) -> None:
    import tempfile

    import torch

    from tpguide.dist import TPGroup
    from tpguide.dist.spawn import run_on_ranks
    from tpguide.model.default_model import default_model_dir
    from tpguide.model.random_checkpoint import write_random_checkpoint

    torch.set_num_threads(1)
    default = str(default_model_dir())
    tiny = str(write_random_checkpoint(tempfile.mkdtemp(prefix="tiny-llama-"), tokenizer_dir=default, seed=1))
    paths = {"tiny": tiny, "default": default}
    sets = request_sets()
    by_tp = {}
    for tp_size in (1, 2, 4):
        if tp_size == 1:
            by_tp[tp_size] = run_sets(TPGroup(), paths, sets)
        else:
            by_tp[tp_size] = run_on_ranks(run_sets, tp_size, paths, sets, timeout_s=3600)[0]
        print(f"tp {tp_size} done", flush=True)
    doc = {
        "commit": "5d3fc53",
        "models": {"tiny": "write_random_checkpoint(seed=1, tokenizer of the embedded model)",
                   "default": "embedded SmolLM2-135M-Instruct"},
        "sets": [
            {"name": name, "model": model, "lines": lines, "config": config,
             "default_max_tokens": dmt, "outputs": {str(tp): by_tp[tp][i] for tp in by_tp}}
            for i, (name, model, lines, config, dmt) in enumerate(sets)
        ],
    }
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])

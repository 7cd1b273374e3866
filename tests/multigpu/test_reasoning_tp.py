"""Reasoning on the tiny random Qwen3: the same ids and logprobs at tp 1, 2, 4, with and without drafts, on both backends.

One gloo job of 4 ranks (tp ``t`` on ranks ``0..t-1``) runs the requests of
:func:`reasoning_requests` (thinking budgets 0, 1, 8, 32 with JSON-schema,
regex and choice guides, greedy and seeded; ``enable_thinking: false``; an
unguided budget; a guided request without a budget) in :data:`CASES`: every
speculative method and both backends at tp 1, and a mix of them at tp 2 and
tp 4 (a full product would cost 18 runs on 2 cores).  Each run equals the
plain tp 1 run of its backend, token ids, logprobs, reasoning and answer;
the plain runs' answers satisfy their guides (tests/reasoning_testing.py).
"""

import json

from reasoning_testing import check_reasoning_outputs, key, reasoning_requests

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_on_ranks

#: (tp size, speculative method, guided backend); the first run of each backend is its reference.
CASES = [(1, "none", "xgrammar"), (1, "none", "llguidance"), (1, "grammar", "xgrammar"), (1, "ngram", "xgrammar"),
         (1, "grammar", "llguidance"), (1, "ngram", "llguidance"), (2, "grammar", "xgrammar"),
         (2, "none", "llguidance"), (4, "ngram", "xgrammar"), (4, "grammar", "llguidance")]


def _all_cases(group, model_dir, lines):
    import torch.distributed as dist

    from tpguide.engine import EngineConfig, generate_on_group

    rank = group.tp_rank
    groups = {1: TPGroup()} if rank == 0 else {}
    for t in (2, 4):
        pg = dist.new_group(list(range(t)))  # collective over all 4 ranks
        if rank < t:
            groups[t] = TPGroup(tp_rank=rank, tp_size=t, device=group.device, process_group=pg, backend="gloo")
    out = {}
    for t, method, backend in CASES:
        if t in groups:
            config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=96,
                                  speculative_method=None if method == "none" else method, guided_backend=backend,
                                  reasoning_parser="qwen3")
            out[(t, method, backend)] = generate_on_group(groups[t], model_dir, lines, config)
    return out


def test_reasoning_is_exact_at_every_tp_size_method_and_backend(reasoning_model_path):
    lines = json.loads(json.dumps(reasoning_requests()))
    results = run_on_ranks(_all_cases, 4, reasoning_model_path, lines, timeout_s=1500)[0]
    for backend in ("xgrammar", "llguidance"):
        reference = results[(1, "none", backend)]
        check_reasoning_outputs(lines, reference)
        for case, outputs in results.items():
            if case[2] == backend:
                assert key(outputs) == key(reference), case

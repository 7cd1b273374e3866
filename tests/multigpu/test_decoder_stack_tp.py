"""The decoder stack in C at tp 2 (a call per half layer, the unit partials gathered between them over gloo).

Each rank's logits shard equals its slice of the tp-1 logits bit for bit, with the
C calls and with the per-op path, over a chunked prefill, a decode beside a chunk and
a decode step; and the C calls did run (counted on every rank).
"""

import torch
from decoder_steps import STEPS, run_steps

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_on_ranks
from tpguide.model.loader import load_model


def _logits(group: TPGroup, model_dir: str, stacked: bool):
    """This rank's logits shard of every step, its vocabulary start, and how many C stack runs finished."""
    import tpguide.model.decoder_stack_cpu as stack_module
    from tpguide.model.invariant_reduce import prepack_weights

    finished = []
    real = stack_module.run_decoder_half

    def counted(*args, **kwargs):
        ok = real(*args, **kwargs)
        finished.append(ok)
        return ok

    stack_module.run_decoder_half = counted
    model = load_model(model_dir, group, torch.bfloat16)
    prepack_weights(model)
    model.model.use_decoder_stack = stacked
    out = [logits.numpy() for logits in run_steps(model)]
    return out, model.vocab_shard.vocab_start_index, len(finished), all(finished)


def test_tp2_stack_halves_equal_tp1_and_the_per_op_path(tiny_model_path):
    want, _, _, _ = _logits(TPGroup(), tiny_model_path, stacked=False)
    layers = load_model(tiny_model_path, TPGroup()).config.num_hidden_layers
    for stacked in (True, False):
        for shards, start, calls, all_ok in run_on_ranks(_logits, 2, tiny_model_path, stacked):
            assert calls == (2 * layers * len(STEPS) if stacked else 0) and all_ok
            for shard, full in zip(shards, want):
                assert torch.equal(torch.from_numpy(shard), torch.from_numpy(full)[:, start:start + shard.shape[1]])

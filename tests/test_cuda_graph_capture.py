"""A bucket's graph, captured on a padding-only step, is what a real step of that bucket would run (docs/gpu.md).

A CUDA graph replays the kernels, launch arguments and addresses recorded
when it was captured (:meth:`tpguide.worker.cuda_graphs.CudaGraphs.capture`:
a padding-only step staged by ``stage_padding``, read through fresh
``padding_views``); at replay only the step buffers' contents change.  So
for each family (Llama bf16; Gemma 2 fp32 with soft-caps, window and
``1 + w`` norms; Qwen 3 bf16 with q/k norms) and bucket this test records,
on CPU with the CUDA code path forced and its kernels interpreted
(``tests/graph_trace.py``), :func:`~tpguide.worker.cuda_graphs.forward_logits`
on the capture's inputs and on real steps staged into that bucket (decodes,
a verify window, a prefill chunk, other blocks and context lengths), and
checks that:

* the event sequences are identical: the same aten ops on the same shapes,
  the same Triton grids, scalars and constexprs, the same persistent tensors
  at the same addresses (nothing the forward reads is built per step off
  the buffers);
* no op reads a device value on the host or has a data-dependent shape,
  neither in a graph step nor in an eager step over the buffers (the
  runner's sync-free path).

The bits of a padded step are :mod:`tests.test_cuda_graph_padding`'s.  Run
directly with ``TRITON_INTERPRET=1 python tests/test_cuda_graph_capture.py``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from step_plans import step_plan
from triton_interpreted import check_in_child, run_cases

pytest.importorskip("triton")

VOCAB, BLOCK_SIZE = 300, 8

#: bucket -> real steps staged into it: [(block table, context_len, new ids, sample rows)]
STEPS = {
    4: [[([5, 1], 7, [3], 1), ([9], 3, [8], 1), ([2, 12], 9, [4], 1)],  # three decodes
        [([6, 3, 11], 17, [1, 2, 3], 3)]],  # a verify window of three drafts
    8: [[([5, 1], 8, [7], 1), ([2, 12], 5, [1, 2, 3], 3), ([9], 0, [4, 5, 6, 7], 1)],  # decode, verify, prefill
        [([0], 0, [10, 11, 12, 13, 14, 15, 16], 1), ([4, 8, 13, 14], 25, [9], 1)]],
}


def _family_case(arch, dtype):
    def case(device):
        from graph_trace import first_difference, trace

        from tpguide.dist import TPGroup
        from tpguide.kernels.triton_path import forced_triton_path
        from tpguide.model.loader import load_model
        from tpguide.model.random_checkpoint import tiny_hf_config, write_random_model
        from tpguide.worker.cuda_graphs import forward_logits
        from tpguide.worker.step_inputs import StepBuffers, StepCapacity

        d = write_random_model(Path(tempfile.mkdtemp()), tiny_hf_config(arch, VOCAB), seed=5)
        model = load_model(d, TPGroup(device=torch.device(device)), dtype=dtype)
        model.allocate_kv_cache(16, BLOCK_SIZE, max_model_len=32)
        buffers = StepBuffers(StepCapacity(max_tokens=16, max_seqs=4, max_blocks_per_seq=4, block_size=BLOCK_SIZE),
                              torch.device(device))
        with forced_triton_path():
            for bucket, steps in STEPS.items():
                buffers.stage_padding(bucket)  # as CudaGraphs.capture does
                _, captured = trace(forward_logits, model, buffers.padding_views(bucket))
                assert not captured.host_reads, captured.host_reads[:3]
                for i, seqs in enumerate(steps):
                    plan = step_plan(seqs, guided=False, step=i)
                    _, real = trace(forward_logits, model, buffers.stage(plan, bucket))
                    assert not real.host_reads, real.host_reads[:3]
                    diff = first_difference(captured.events, real.events)
                    assert diff is None, f"bucket {bucket}, step {i}: {diff}"
                    _, eager = trace(forward_logits, model, buffers.stage(plan))  # unpadded, no graph
                    assert not eager.host_reads, eager.host_reads[:3]
                assert any(e[0] == "triton" for e in captured.events)  # the launches were recorded
    return case


CASES = {
    "llama-bf16": _family_case("LlamaForCausalLM", torch.bfloat16),
    "gemma2-f32": _family_case("Gemma2ForCausalLM", torch.float32),
    "qwen3-bf16": _family_case("Qwen3ForCausalLM", torch.bfloat16),
}


def test_capture_is_what_a_real_step_runs_interpreted_on_cpu():
    pytest.importorskip("tpguide.kernels.triton_path")
    check_in_child(__file__, list(CASES), timeout_s=900)


if __name__ == "__main__":
    run_cases(CASES)

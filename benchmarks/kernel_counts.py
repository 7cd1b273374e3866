"""How many kernels a decode step launches on the CUDA code path, counted on CPU without a GPU.

docs/gpu.md "Kernels per decoder layer".  Two counts:

1. **The forward** (what a CUDA graph replays): a random-weight Llama of
   ``--shape`` (default: SmolLM2-135M's heads and widths) with 1 and with 2
   layers, bf16, tp 1, the CUDA code path forced on CPU tensors with its
   Triton kernels interpreted; one padded decode step of ``--rows`` rows.
   Each Triton launch and each torch op outside a Triton launch that makes
   a kernel (views and allocations are not counted) is one kernel; the
   2-layer count minus the 1-layer count is one layer's.
2. **The sampler** (eager, after the graph): :func:`tpguide.worker.group_sampling.sample`
   on the meta device (no values, no GPU), ``--rows`` rows, tp 1, per mode;
   ops on meta tensors are device kernels, the rest host work.

Usage::

    python benchmarks/kernel_counts.py [--rows 32] [--layers 30] [--shape smollm2|tiny]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined: before any tpguide import

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

#: aten ops that make no kernel: views, metadata, allocations
NO_KERNEL = {"view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "expand", "slice", "select",
             "as_strided", "reshape", "permute", "alias", "detach", "split", "split_with_sizes", "unbind", "narrow",
             "empty", "empty_strided", "empty_like", "new_empty", "lift_fresh", "chunk", "flatten", "unflatten"}


class Counter(TorchDispatchMode):
    """Counts kernel-making aten ops by name, skipping those inside a Triton launch (the interpreter's own)."""

    def __init__(self, device_only: str = "") -> None:
        super().__init__()
        self.ops, self.host_ops, self.inside_triton, self.device_only = collections.Counter(), 0, False, device_only

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.inside_triton or name in NO_KERNEL:
            return out
        if self.device_only:
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            if not any(t.device.type == self.device_only for t in tensors):
                self.host_ops += 1
                return out
        self.ops[name] += 1
        return out


def count_triton_launches(counter: Counter) -> collections.Counter:
    """Patch the interpreter's launch to count Triton kernels by name (and mute ``counter`` inside them)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: collections.Counter = collections.Counter()
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        counter.inside_triton = True
        try:
            return run(self, *args, **kwargs)
        finally:
            counter.inside_triton = False

    InterpretedFunction.run = counted
    return launches


#: ``--shape``: the embedded model's heads and widths, or the test suite's tiny ones (the same kernels, faster)
SHAPES = {"smollm2": dict(num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_size=576,
                          intermediate_size=1536),
          "tiny": {}}


def forward_kernels(layers: int, rows: int, shape: str = "smollm2") -> collections.Counter:
    """Kernels of one padded decode step's ``forward_logits`` (Triton launches and torch ops, by name)."""
    from tpguide.dist import TPGroup
    from tpguide.kernels.triton_path import forced_triton_path
    from tpguide.model.loader import load_model
    from tpguide.model.random_checkpoint import tiny_hf_config, write_random_model
    from tpguide.worker.cuda_graphs import forward_logits
    from tpguide.worker.step_inputs import StepBuffers, StepCapacity

    config = tiny_hf_config("LlamaForCausalLM", 320, num_hidden_layers=layers, **SHAPES[shape])
    model_dir = write_random_model(Path(tempfile.mkdtemp()), config, seed=5)
    model = load_model(model_dir, TPGroup(device=torch.device("cpu")), dtype=torch.bfloat16)
    model.allocate_kv_cache(rows + 1, 16, max_model_len=64)
    buffers = StepBuffers(StepCapacity(max_tokens=rows, max_seqs=rows, max_blocks_per_seq=4, block_size=16),
                          torch.device("cpu"))
    counter = Counter()
    launches = count_triton_launches(counter)
    with forced_triton_path():
        buffers.stage_padding(rows)
        inputs = buffers.padding_views(rows)  # host work of the step's staging: not in the graph
        with counter:
            forward_logits(model, inputs)
    return launches + counter.ops


def sampler_kernels(rows: int, mode: str) -> tuple[int, int]:
    """(device ops, host ops) of one :func:`~tpguide.worker.group_sampling.sample` call on the meta device."""
    from tpguide.dist import TPGroup
    from tpguide.model.vocab_shard import VocabShard
    from tpguide.sampling.sampler import SamplingMetadata
    from tpguide.worker.group_sampling import sample

    shard = VocabShard.create(49152, 0, 1)
    logprobs = 1 if mode.endswith("+logprobs") else 0
    host = SamplingMetadata(temperature=torch.full((rows,), 0.0 if mode.startswith("greedy") else 0.8),
                            top_k=torch.zeros(rows, dtype=torch.int32), top_p=torch.ones(rows),
                            seeds=torch.arange(rows), sample_positions=torch.arange(rows) + 5,
                            num_logprobs=logprobs, return_logprobs=logprobs > 0)
    on_device = host.to("meta")  # staged with the step's inputs, not the sampler's work
    logits = torch.empty(rows, shard.num_embeddings_per_partition, device="meta")
    counter = Counter(device_only="meta")
    with counter:
        sample(logits, on_device, shard, TPGroup(device=torch.device("meta")))
    return sum(counter.ops.values()), counter.host_ops


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32, help="rows of the decode step (a graph bucket)")
    parser.add_argument("--layers", type=int, default=30, help="decoder layers of the model the total is for")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="heads and widths of the model")
    args = parser.parse_args(argv)
    one, two = forward_kernels(1, args.rows, args.shape), forward_kernels(2, args.rows, args.shape)
    layer = {k: two[k] - one[k] for k in two if two[k] - one[k]}
    per_layer = sum(layer.values())
    fixed = sum(one.values()) - per_layer
    print(f"forward, one decoder layer (forced CUDA path, interpreted): {dict(sorted(layer.items()))}")
    outside = {k: one[k] - layer.get(k, 0) for k in one if one[k] - layer.get(k, 0)}
    print(f"forward, outside the layers: {dict(sorted(outside.items()))}")
    print(f"  per layer: {per_layer} kernels; outside the layers: {fixed}; "
          f"a {args.layers}-layer step: about {fixed + args.layers * per_layer}")
    for mode in ("greedy", "greedy+logprobs", "temperature"):
        device, host = sampler_kernels(args.rows, mode)
        print(f"sampler, {args.rows} rows, {mode}: {device} device ops, {host} host ops")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The step's CUDA fast path: persistent input buffers, CUDA-graph replays, its first steps checked (docs/gpu.md).

docs/gpu.md "Speed on CUDA: graphs and host syncs".  On CUDA the runner's
forward goes through :class:`FastPath`:

* the step's inputs are staged in persistent buffers
  (:mod:`tpguide.worker.step_inputs`: one non-blocking copy from pinned memory);
* a step that fits a token-count bucket and asks no prompt logprobs replays
  that bucket's CUDA graph of the forward and the LM head
  (:mod:`tpguide.worker.cuda_graphs`); any other step runs
  :func:`~tpguide.worker.forward.eager_forward` on views of the same buffers;
* the guided bitmask goes to the device through its own persistent buffers
  (:meth:`FastPath.bitmask_on_device`);
* the first steps of each kind also run the plain step, compared bit for bit
  (:mod:`tpguide.worker.fast_path_check`); a difference, or a capture that
  fails, turns the fast path off for the run.

No host sync before the sampled ids are read (the runner's ``read_to_host``).
Penalties, the bitmask application and sampling are the runner's, the same
code as the plain step's.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from tpguide.dist import TPGroup
from tpguide.worker.cuda_graphs import BUCKETS, CudaGraphs, PaddedEager, bucket_for, capture_buckets, graphs_supported
from tpguide.worker.fast_path_check import FastPathCheck, GraphCaptureError
from tpguide.worker.forward import ForwardOutput, eager_forward, plain_inputs
from tpguide.worker.host_sync import allowed_host_sync
from tpguide.worker.protocol import BitmaskSlices, StepPlan
from tpguide.worker.step_inputs import BitmaskBuffers, StepBuffers, StepCapacity

__all__ = ["FastPath"]


class FastPath:
    """One runner's persistent buffers and CUDA graphs, and the check of their first steps.

    Parameters
    ----------
    model : LlamaForCausalLM
        This rank's shard, KV cache allocated.
    group : TPGroup
    capacity : StepCapacity
        The buffers' size (the engine's step limits); a larger plan grows them.
    cuda_graphs : bool
        Replay a CUDA graph per token-count bucket where :func:`graphs_supported` agrees.
    check : FastPathCheck
        Counts the checked steps per kind (the runner's, kept when the fast path goes off).

    Attributes
    ----------
    buffers : StepBuffers
    bitmask_buffers : BitmaskBuffers
    graphs : PaddedEager or None
        :class:`CudaGraphs` on CUDA when supported; tests may set a :class:`PaddedEager`.
    graphs_off_reason : str
        Why CUDA graphs are off although asked for ("" when on or not asked for).
    """

    def __init__(self, model, group: TPGroup, capacity: StepCapacity, cuda_graphs: bool,
                 check: FastPathCheck) -> None:
        self.model, self.group, self.check = model, group, check
        self.graphs_off_reason = ""
        self._want_graphs = cuda_graphs
        self._allocate(capacity)

    def _allocate(self, capacity: StepCapacity) -> None:
        """(Re)build the persistent buffers for ``capacity``, and the graph set over them (dropping old graphs)."""
        dev = self.group.device
        self.buffers = StepBuffers(capacity, dev)
        self.bitmask_buffers = BitmaskBuffers(capacity.max_tokens, self.model.vocab_shard.bitmask_size,
                                              self.group.tp_size, dev)
        self.graphs: Optional[PaddedEager] = None
        if self._want_graphs:
            supported, self.graphs_off_reason = graphs_supported(self.model, self.group)
            if supported:
                self.graphs = CudaGraphs(self.model, self.buffers, capture_buckets(capacity))

    def execute_model(self, plan: StepPlan) -> Tuple[ForwardOutput, Optional[str]]:
        """The step's forward on the fast path, its first steps of each kind checked (docs/gpu.md).

        The first :data:`~tpguide.worker.fast_path_check.CHECKED_STEPS` steps
        of each kind (a bucket's graph; the eager step on the buffers, by the
        bucket its size would take) also run the plain step
        (:func:`~tpguide.worker.forward.plain_inputs`, written after the fast
        one: the same KV slots, the plain bits stay) and compare the logits
        bit for bit over the group.

        Returns
        -------
        (ForwardOutput, str or None)
            The output (no penalties yet), and why the fast path must go off
            for the run: a difference, or a graph capture that failed; then
            the output is the plain step's.  None: keep it.
        """
        size, bucket = max(plan.input_ids.numel(), plan.selected_token_indices.numel()), None
        if self.graphs is not None and plan.selected_prompt_indices is None:
            bucket = self.graphs.bucket_for(size)
        kind = ("eager", bucket_for(size, BUCKETS)) if bucket is None else ("graph", bucket)  # None: above all buckets
        checked = self.check.wants(kind)
        try:
            fast = self._forward(plan, bucket)
        except GraphCaptureError as err:
            return self._plain(plan), str(err)
        if not checked:
            return fast, None
        with allowed_host_sync():  # a checked step's plain twin waits on the host: deliberate, a few steps a run
            plain = self._plain(plan)  # writes the same KV slots last: the plain bits stay
        why = self.check.compare(kind, fast.logits, plain.logits)
        if why is None:
            return fast, None
        name = "the eager step on the persistent buffers" if bucket is None else f"the CUDA graph of bucket {bucket}"
        return plain, f"{name} gave other logits than the plain eager step ({why})"

    def _plain(self, plan: StepPlan) -> ForwardOutput:
        """The plain step's forward (the runner's path without the fast path)."""
        inputs = plain_inputs(plan, self.group.device, self.model.kv_block_size)
        return eager_forward(self.model, inputs, plan, self.group)

    def _forward(self, plan: StepPlan, bucket: Optional[int]) -> ForwardOutput:
        """The forward over the persistent buffers: no host sync (docs/gpu.md).

        With a ``bucket`` (a step that fits one and asks no prompt logprobs)
        it replays that bucket's CUDA graph; else it runs the same forward
        eagerly, unpadded.

        Raises
        ------
        GraphCaptureError
            The bucket's graph was new and could not be captured.
        """
        if bucket is None:
            self._fit(plan)
            return eager_forward(self.model, self.buffers.stage(plan), plan, self.group)
        inputs, logits = self.graphs.run(plan, bucket)  # [bucket, V_pad / tp] fp32
        return ForwardOutput(logits[:plan.selected_token_indices.numel()], inputs.sampling, None)

    def _fit(self, plan: StepPlan) -> None:
        """Grow the buffers (dropping the graphs) when ``plan`` is larger than they are."""
        cap = self.buffers.capacity
        tokens, rows = plan.input_ids.numel(), plan.selected_token_indices.numel()
        seqs, blocks = len(plan.block_tables), max(len(t) for t in plan.block_tables)
        if not cap.fits(tokens, rows, seqs, blocks):
            self._allocate(StepCapacity(max(cap.max_tokens, tokens, rows), max(cap.max_seqs, seqs),
                                        max(cap.max_blocks_per_seq, blocks), cap.block_size, cap.max_graph_tokens))

    def bitmask_on_device(self, bitmask: Optional[BitmaskSlices],
                          num_rows: int) -> Tuple[torch.Tensor, Optional[List[torch.Tensor]]]:
        """The driver's ``bitmask`` through the persistent bitmask buffers (one non-blocking copy).

        Returns
        -------
        (token_mask, word_slices)
            Device int32 ``[R]`` and, on the driver, its ``tp_size`` word
            slices ``[R, W]``; on the other ranks the receive view of
            ``token_mask`` and None.
        """
        if self.group.is_driver:
            return self.bitmask_buffers.send(*bitmask)
        return self.bitmask_buffers.receive_views(num_rows)[0], None

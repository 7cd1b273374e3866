"""The forward and the LM head over a step's rows as CUDA graphs, one per token-count bucket (docs/gpu.md).

A decode step of ``R`` requests (``1 + k`` tokens each with ``k`` grammar
drafts) is ``T`` tokens; it replays the graph of the smallest bucket
``T_pad >= T`` (:data:`BUCKETS`).  The graph reads its inputs from the
persistent buffers of :class:`~tpguide.worker.step_inputs.StepBuffers`,
staged for the step with the padding the buckets need: padding tokens have
position -1 and KV slot -1 (the fixed-order kernels write nothing and attend
to nothing for them), padded sample rows point at a padding token.  The
fixed-order kernels give every row the same bits whatever the other rows,
so a padded replay gives the plan's rows the bits of an unpadded eager
forward.  What runs after the graph, eagerly, on the logits' first ``R``
rows: penalties, the grammar bitmask (filled on the host while the graph
runs), sampling.

A bucket is captured the first time a step needs it (the capture runs a
padding-only step: nothing touches the KV cache), so start-up pays nothing
for buckets that are never used.  All graphs share one memory pool; each
graph's logits stay allocated, and graphs replay one at a time on one
stream, so no graph overwrites another's live memory.

Graphs are used when :func:`graphs_supported` says so: a CUDA device, tp
size 1 (NCCL collectives inside a graph need care this engine has not taken
yet: tp > 1 runs eagerly, still without host syncs), and the TP-invariant
model (its attention reads the KV pool through the block table with launch
arguments from shapes only; the plain path builds masks from host values
each step).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional, Tuple

import torch

from tpguide.worker.fast_path_check import GraphCaptureError
from tpguide.worker.step_inputs import StepBuffers, StepInputs

__all__ = ["BUCKETS", "MAX_GRAPH_TOKENS", "graph_buckets", "bucket_for", "capture_buckets", "graphs_supported", "forward_logits", "PaddedEager", "CudaGraphs"]

#: Token counts a graph is captured for (a step pads its tokens up to the next one).
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


def graph_buckets(max_tokens: int) -> Tuple[int, ...]:
    """The buckets of :data:`BUCKETS` up to ``max_tokens`` (steps above the last one run eagerly)."""
    return tuple(b for b in BUCKETS if b <= max_tokens)


def bucket_for(num_tokens: int, buckets: Tuple[int, ...]) -> Optional[int]:
    """The smallest bucket ``>= num_tokens``, or None when the step is larger than every bucket."""
    return next((b for b in buckets if b >= num_tokens), None)


#: The most tokens a graph is captured for (vLLM's largest default capture size): larger steps are
#: prefill chunks, whose launches a forward over that many tokens amortizes.
MAX_GRAPH_TOKENS = 512


def capture_buckets(capacity) -> Tuple[int, ...]:
    """The buckets a runner of ``capacity`` (a :class:`~tpguide.worker.step_inputs.StepCapacity`) captures.

    Up to the bucket of its largest decode step (``capacity.max_graph_tokens``:
    every sequence with every draft), at most :data:`MAX_GRAPH_TOKENS` and
    ``capacity.max_tokens``.  Each captured bucket keeps its fp32 logits
    ``[bucket, V_local]`` allocated, so a bucket no decode step needs would
    hold memory for a prefill chunk, which runs eagerly instead.
    """
    want = min(capacity.max_graph_tokens or capacity.max_tokens, MAX_GRAPH_TOKENS)
    return graph_buckets(min(bucket_for(want, BUCKETS) or BUCKETS[-1], capacity.max_tokens))


def graphs_supported(model, group) -> Tuple[bool, str]:
    """``(supported, why not)`` for CUDA graphs of ``model`` on ``group`` (module docstring)."""
    if group.device.type != "cuda" or not torch.cuda.is_available():
        return False, f"device {group.device} is not CUDA"
    if group.tp_size != 1:
        return False, f"tp_size {group.tp_size} > 1 runs eagerly (collectives are not captured)"
    if not model.tp_invariant:
        return False, "--no-tp-invariant: the plain attention path is not capturable"
    return True, ""


def forward_logits(model, inputs: StepInputs) -> torch.Tensor:
    """The forward over ``inputs``' tokens and this rank's LM-head shard over its selected rows.

    Returns
    -------
    Tensor, float32 [T_pad, V_local]
        Row ``i`` is hidden row ``inputs.selected[i]``; the plan's rows are the first ``num_rows``.
    """
    hidden = model(inputs.input_ids, inputs.positions, inputs.meta)  # [T_pad, H]
    return model.compute_logits(hidden[inputs.selected])  # [T_pad, V_local] fp32


class PaddedEager:
    """A graph step without the graph: ``plan`` staged padded to its bucket, :func:`forward_logits` run eagerly.

    What :class:`CudaGraphs` replays, minus the capture: the same buffers,
    padding and row selection.  The CPU tests' stand-in for the graphs
    (with the CUDA code path forced, docs/gpu.md).

    Parameters
    ----------
    model : LlamaForCausalLM
    buffers : StepBuffers
        The persistent inputs; the largest bucket must fit ``buffers.capacity.max_tokens``.
    buckets : tuple of int
        Increasing token counts.
    step : callable, optional
        The forward over staged inputs (default :func:`forward_logits`).

    Raises
    ------
    ValueError
        A bucket larger than the buffers.
    """

    def __init__(self, model, buffers: StepBuffers, buckets: Tuple[int, ...],
                 step: Callable[[object, StepInputs], torch.Tensor] = forward_logits) -> None:
        if buckets and buckets[-1] > buffers.capacity.max_tokens:
            raise ValueError(f"bucket {buckets[-1]} exceeds the buffers' {buffers.capacity.max_tokens} tokens")
        self.model, self.buffers, self.buckets, self.step = model, buffers, buckets, step

    def bucket_for(self, num_tokens: int) -> Optional[int]:
        return bucket_for(num_tokens, self.buckets)

    def run(self, plan, bucket: int) -> Tuple[StepInputs, torch.Tensor]:
        """Stage ``plan`` padded to ``bucket`` tokens and run the forward: ``(inputs, logits [bucket, V_local])``."""
        inputs = self.buffers.stage(plan, bucket)
        return inputs, self.step(self.model, inputs)


class CudaGraphs(PaddedEager):
    """One captured :func:`forward_logits` per bucket, over ``buffers`` (parameters as :class:`PaddedEager`)."""

    def __init__(self, model, buffers: StepBuffers, buckets: Tuple[int, ...],
                 step: Callable[[object, StepInputs], torch.Tensor] = forward_logits) -> None:
        super().__init__(model, buffers, buckets, step)
        self.graphs: Dict[int, Tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        #: host seconds each capture took (warm-up run included), by bucket
        self.capture_seconds: Dict[int, float] = {}
        self._pool = None

    def run(self, plan, bucket: int) -> Tuple[StepInputs, torch.Tensor]:
        """Stage ``plan`` padded to ``bucket`` tokens and replay that bucket's graph (capturing it first if new).

        Returns
        -------
        (StepInputs, Tensor float32 [bucket, V_local])
            The staged views and the graph's logits (valid until the next replay).

        Raises
        ------
        GraphCaptureError
            The bucket was new and its capture failed.
        """
        if bucket not in self.graphs:
            self.capture(bucket)
        inputs = self.buffers.stage(plan, bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return inputs, logits

    def capture(self, bucket: int) -> None:
        """Capture ``bucket``'s graph on a padding-only step (the KV cache is neither read nor written).

        Raises
        ------
        GraphCaptureError
            The capture failed, or the eager warm-up before it ran out of
            memory; the bucket stays uncaptured.
        """
        start = time.perf_counter()
        warm = self.buffers.stage_padding(bucket)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # Triton compiles and the allocator warms up outside the capture
            try:
                self.step(self.model, warm)
            except torch.OutOfMemoryError as err:  # the graph's memory does not fit beside the KV pool
                raise GraphCaptureError(f"the CUDA graph of bucket {bucket} tokens does not fit in memory "
                                        f"(lower --kv-cache-memory-fraction or use --no-cuda-graphs): {err}") from err
        torch.cuda.current_stream().wait_stream(side)
        # fresh view objects: per-step caches keyed on the positions tensor (RoPE's cos/sin) must miss
        # during the capture, so their computation is recorded in the graph
        inputs = self.buffers.padding_views(bucket)
        graph = torch.cuda.CUDAGraph()
        # capture_begin/end rather than torch.cuda.graph(): that context also synchronizes, runs gc.collect()
        # and empties the allocator's cache at every capture (a full collection of the driver's heap, for
        # nothing; vLLM patches gc.collect out of its captures for the same reason).  thread_local: the
        # bitmask-fill and compile threads keep running during a lazy capture.
        failed: Optional[BaseException] = None
        with torch.cuda.stream(side):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                logits = self.step(self.model, inputs)
            except RuntimeError as err:  # an op the capture refuses (a host sync), memory, ...
                failed = err
            finally:
                try:
                    graph.capture_end()
                except RuntimeError as err:  # the capture was invalidated
                    failed = failed or err
        torch.cuda.current_stream().wait_stream(side)
        if failed is not None:
            raise GraphCaptureError(f"capturing the CUDA graph of bucket {bucket} tokens failed: "
                                    f"{type(failed).__name__}: {failed}") from failed
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[bucket] = (graph, logits)
        self.capture_seconds[bucket] = time.perf_counter() - start

    def capture_all(self, up_to: Optional[int] = None) -> None:
        """Capture every bucket (up to the one ``up_to`` tokens need) now, largest first (vLLM's start-up capture)."""
        last = self.buckets[-1] if up_to is None else (self.bucket_for(up_to) or self.buckets[-1])
        for bucket in reversed(self.buckets):
            if bucket <= last and bucket not in self.graphs:
                self.capture(bucket)

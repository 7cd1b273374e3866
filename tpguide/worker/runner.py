"""Every rank's step execution: a plan in, a result value out (docs/architecture.md §1).

**The step**, in two phases (as vLLM's ``execute_model`` / ``sample_tokens``)::

    StepRunner.execute_model(plan) -> ForwardOutput
        forward on this rank's weight shard               -> hidden [T, H] (replicated)
        prompt rows -> LM-head shard -> prompt logprobs    (if the plan asks)
        rows selected_token_indices -> LM-head shard       -> logits [R, V_pad / T] fp32
    StepRunner.sample_tokens(plan, forward, bitmask) -> StepResult, identical on every rank
        guided: broadcast token_mask, scatter word slices, apply own slice in place
        vocab-parallel sampling (all-gather of (value, token id) candidates)

It reads and writes no driver state: the driver's only input is the
:class:`~tpguide.worker.protocol.BitmaskSlices` value it hands to
:meth:`StepRunner.sample_tokens` (the rows it filled while the forward ran).
Non-driver ranks run :meth:`StepRunner.follow_driver`, acting on each
message of the plan channel until STOP; a STEP message is
:meth:`StepRunner.execute`, the two phases back to back with no bitmask of
their own, so they make the same collectives in the same order as the driver.

The plan, result and message types are :mod:`tpguide.worker.protocol`; the
sampler over the group is :mod:`tpguide.worker.group_sampling`.

**On CUDA** (docs/gpu.md "Speed on CUDA: graphs and host syncs") the step's
inputs go through persistent buffers (:mod:`tpguide.worker.step_inputs`:
one non-blocking copy from pinned memory), decode and draft-verify steps
replay a CUDA graph of the forward and the LM head
(:mod:`tpguide.worker.cuda_graphs`), and the host waits for the device once
per step, to read the sampled ids (:func:`read_to_host`).
On CPU the step runs as it always did.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.kernels import apply_token_bitmask_inplace
from tpguide.model.attention import AttentionMetadata
from tpguide.sampling.penalties import apply_penalties_inplace
from tpguide.sampling.prompt_logprobs import PromptLogprobs
from tpguide.sampling.sampler import SamplingMetadata
from tpguide.worker.cuda_graphs import BUCKETS, CudaGraphs, PaddedEager, bucket_for, capture_buckets, graphs_supported
from tpguide.worker.fast_path_check import CHECKED_STEPS, FastPathCheck, GraphCaptureError
from tpguide.worker.group_sampling import compute_prompt_logprobs, sample
from tpguide.worker.host_sync import allowed_host_sync
from tpguide.worker.protocol import BitmaskSlices, DriverAborted, Message, MessageKind, StepPlan, StepResult
from tpguide.worker.step_inputs import BitmaskBuffers, StepBuffers, StepCapacity

__all__ = ["ForwardOutput", "StepRunner", "DriverAborted", "read_to_host"]


@dataclass(frozen=True)
class ForwardOutput:
    """What :meth:`StepRunner.execute_model` hands to :meth:`StepRunner.sample_tokens` (this rank's device).

    Attributes
    ----------
    logits : torch.Tensor
        fp32 ``[R, V_pad / tp_size]``: this rank's logits shard of the sample
        rows, penalties applied, the bitmask not yet.
    sampling : SamplingMetadata
        The plan's, on this rank's device (the staged views on the persistent-buffer path).
    prompt : PromptLogprobs or None
        The rows of ``plan.selected_prompt_indices``, on the host.
    """

    logits: torch.Tensor
    sampling: SamplingMetadata
    prompt: Optional[PromptLogprobs]


#: Prompt rows per LM-head call: bounds the ``[rows, V_local]`` fp32/fp64 temporaries.
PROMPT_ROW_BLOCK = 256


class StepRunner:
    """This rank's model shard (and draft head) driven by plans.

    Parameters
    ----------
    model : LlamaForCausalLM
        This rank's shard, KV cache allocated.
    group : TPGroup
    draft_head : DraftHead, optional
        This rank's drafter (speculative method ``draft-head``).
    capacity : StepCapacity, optional
        The engine's step limits: the persistent buffers' size (needed with ``static_inputs``).
    cuda_graphs : bool
        Replay a CUDA graph per token-count bucket where :func:`graphs_supported` agrees.
    static_inputs : bool, optional
        The persistent-buffer (fast) path; default: on a CUDA device.
    check_steps : int
        Steps of each fast-path kind checked against the plain step (:mod:`tpguide.worker.fast_path_check`).

    Raises
    ------
    ValueError
        ``static_inputs`` without ``capacity``.
    """

    def __init__(self, model, group: TPGroup, draft_head=None, capacity: Optional[StepCapacity] = None,
                 cuda_graphs: bool = False, static_inputs: Optional[bool] = None,
                 check_steps: int = CHECKED_STEPS) -> None:
        self.model, self.group, self.draft_head = model, group, draft_head
        self.shard = model.vocab_shard
        #: called at the start of every step; ``launch/generate.py`` sets it to
        #: :func:`tpguide.dist.fault_inject.step_fault_hook` when ``TPGUIDE_FAULT_INJECT`` is set (tests only)
        self.on_step: Optional[Callable[[], None]] = None
        #: the persistent-buffer path (default on CUDA; the CPU path is unchanged)
        self.static_inputs = group.device.type == "cuda" if static_inputs is None else static_inputs
        self.buffers: Optional[StepBuffers] = None
        self.bitmask_buffers: Optional[BitmaskBuffers] = None
        self.graphs: Optional[PaddedEager] = None  # CudaGraphs on CUDA; tests may set a PaddedEager
        #: why CUDA graphs are off although asked for ("" when on or not asked for)
        self.graphs_off_reason = ""
        #: why the fast path was turned off during the run ("" while it has not been; :meth:`_fast_path_off`)
        self.fast_path_off_reason = ""
        #: the first steps of each fast-path kind checked against the plain step (:mod:`~tpguide.worker.fast_path_check`)
        self.fast_path_check = FastPathCheck(group, check_steps)
        self._want_graphs = cuda_graphs
        if self.static_inputs:
            if capacity is None:
                raise ValueError("static step inputs need a StepCapacity (the engine's limits)")
            self._allocate(capacity)

    def _allocate(self, capacity: StepCapacity) -> None:
        """(Re)build the persistent buffers for ``capacity``, and the graph set over them (dropping old graphs)."""
        dev = self.group.device
        self.buffers = StepBuffers(capacity, dev)
        self.bitmask_buffers = BitmaskBuffers(capacity.max_tokens, self.shard.bitmask_size, self.group.tp_size, dev)
        self.graphs = None
        if self._want_graphs:
            supported, self.graphs_off_reason = graphs_supported(self.model, self.group)
            if supported:
                self.graphs = CudaGraphs(self.model, self.buffers, capture_buckets(capacity))

    def execute(self, plan: StepPlan, bitmask: Optional[BitmaskSlices] = None) -> StepResult:
        """One whole step on this rank: :meth:`execute_model`, then :meth:`sample_tokens` (a collective).

        The non-driver ranks' step (:meth:`follow_driver`); the driver's engine
        calls the two phases itself, its bitmask fill between them.
        """
        return self.sample_tokens(plan, self.execute_model(plan), bitmask)

    def execute_model(self, plan: StepPlan) -> ForwardOutput:
        """The step's forward on this rank: logits of the sample rows, prompt logprobs (a collective).

        Every rank calls it with the same plan; :meth:`sample_tokens` follows.

        Parameters
        ----------
        plan : StepPlan

        Returns
        -------
        ForwardOutput
            The sample rows' logits shard (penalties applied, no bitmask yet),
            the sampling metadata on this rank's device, the prompt logprobs.
        """
        if self.on_step is not None:
            self.on_step()
        if self.static_inputs:
            return self._execute_model_fast(plan)
        return self._execute_model_plain(plan)

    def _execute_model_plain(self, plan: StepPlan) -> ForwardOutput:
        """:meth:`execute_model` on the plan's own tensors, unpadded (the CPU path; CUDA's without the fast path)."""
        dev = self.group.device
        meta = AttentionMetadata.from_block_tables(plan.block_tables, plan.query_lens, plan.context_lens, device=dev,
                                                   block_size=self.model.kv_block_size)
        hidden = self.model(plan.input_ids.to(dev), meta.token_positions, meta)  # [T, H]
        prompt = None
        if plan.selected_prompt_indices is not None:
            prompt = self._prompt_logprobs(hidden, plan)
        rows = plan.selected_token_indices.to(device=dev, dtype=torch.int64)
        logits = self.model.compute_logits(hidden[rows])  # [R, V_pad / tp] fp32
        if plan.sampling.penalties is not None:  # each rank its own shard: exact at every tp size
            apply_penalties_inplace(logits, plan.sampling.penalties.to(dev), self.shard.vocab_start_index)
        return ForwardOutput(logits, plan.sampling.to(dev), prompt)

    def _execute_model_fast(self, plan: StepPlan) -> ForwardOutput:
        """:meth:`execute_model` on the fast path, its first steps of each kind checked (docs/gpu.md).

        The first :data:`~tpguide.worker.fast_path_check.CHECKED_STEPS` steps
        of each kind (a bucket's graph; the eager step on the buffers, by the
        bucket its size would take) also
        run :meth:`_execute_model_plain` and compare the logits bit for bit
        over the group.  A difference, or a graph capture that fails, turns
        the fast path off for the run (:meth:`_fast_path_off`) and the step
        returns the plain step's output.
        """
        size, bucket = max(plan.input_ids.numel(), plan.selected_token_indices.numel()), None
        if self.graphs is not None and plan.selected_prompt_indices is None:
            bucket = self.graphs.bucket_for(size)
        kind = ("eager", bucket_for(size, BUCKETS)) if bucket is None else ("graph", bucket)  # None: above all buckets
        checked = self.fast_path_check.wants(kind)
        try:
            fast = self._execute_model_static(plan, bucket)
        except GraphCaptureError as err:
            self._fast_path_off(str(err))
            return self._execute_model_plain(plan)
        if not checked:
            return fast
        with allowed_host_sync():  # a checked step's plain twin waits on the host: deliberate, a few steps a run
            plain = self._execute_model_plain(plan)  # writes the same KV slots last: the plain bits stay
        why = self.fast_path_check.compare(kind, fast.logits, plain.logits)
        if why is None:
            return fast
        name = "the eager step on the persistent buffers" if bucket is None else f"the CUDA graph of bucket {bucket}"
        self._fast_path_off(f"{name} gave other logits than the plain eager step ({why})")
        return plain

    def _fast_path_off(self, reason: str) -> None:
        """Run every later step on the plain eager path, and say why on stderr (docs/gpu.md)."""
        self.static_inputs = False
        self.buffers = self.bitmask_buffers = self.graphs = None
        self.graphs_off_reason = self.fast_path_off_reason = reason
        print(f"[rank {getattr(self.group, 'rank', self.group.tp_rank)}] WARNING: CUDA fast path (persistent "
              f"buffers, CUDA graphs) off for the rest of this run: {reason}. Every step now runs the plain "
              "eager path; please report this with the output of `bash launch/gpu_check.sh`.",
              file=sys.stderr, flush=True)

    def _execute_model_static(self, plan: StepPlan, bucket: Optional[int]) -> ForwardOutput:
        """:meth:`execute_model` over the persistent buffers: no host sync before the sampled ids are read (docs/gpu.md).

        With a ``bucket`` (a step that fits one and asks no prompt logprobs)
        it replays that bucket's CUDA graph; else it runs the same forward
        eagerly, unpadded.

        Raises
        ------
        GraphCaptureError
            The bucket's graph was new and could not be captured.
        """
        num_rows = plan.selected_token_indices.numel()
        prompt = None
        if bucket is not None:
            inputs, logits = self.graphs.run(plan, bucket)  # [bucket, V_pad / tp] fp32
        else:
            self._fit(plan)
            inputs = self.buffers.stage(plan)
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)  # [T, H]
            if plan.selected_prompt_indices is not None:  # host reads: prompt-logprob steps are not sync-free
                prompt = self._prompt_logprobs(hidden, plan)
            logits = self.model.compute_logits(hidden[inputs.selected])  # [R, V_pad / tp] fp32
        logits = logits[:num_rows]
        if plan.sampling.penalties is not None:  # sparse entries, copied non-blocking (sampling/penalties.py)
            apply_penalties_inplace(logits, plan.sampling.penalties.to(self.group.device),
                                    self.shard.vocab_start_index)
        return ForwardOutput(logits, inputs.sampling, prompt)

    def sample_tokens(self, plan: StepPlan, forward: ForwardOutput,
                      bitmask: Optional[BitmaskSlices] = None) -> StepResult:
        """The step's sampling on this rank, after :meth:`execute_model` (a collective).

        For a guided plan the driver's ``token_mask`` is broadcast and its word
        slices scattered, and each rank applies its own slice to ``forward.logits``
        in place; then vocab-parallel sampling (as vLLM's ``sample_tokens``).

        Parameters
        ----------
        plan : StepPlan
        forward : ForwardOutput
            This rank's :meth:`execute_model` of ``plan``.
        bitmask : BitmaskSlices, optional
            Driver only, for a guided plan: the filled rows (the other ranks pass None).

        Returns
        -------
        StepResult
            Identical on every rank.

        Raises
        ------
        ValueError
            A guided plan on the driver without ``bitmask``.
        """
        if plan.guided and self.group.is_driver and bitmask is None:
            raise ValueError("a guided step needs the driver's bitmask slices, got None")
        if plan.guided and self.static_inputs:
            self._apply_bitmask_static(forward.logits, bitmask)
        elif plan.guided:
            self._apply_bitmask(forward.logits, bitmask)
        out = sample(forward.logits, forward.sampling, self.shard, self.group)
        return self._result(out, forward.logits, forward.prompt)

    def _fit(self, plan: StepPlan) -> None:
        """Grow the buffers (dropping the graphs) when ``plan`` is larger than they are."""
        cap = self.buffers.capacity
        tokens, rows = plan.input_ids.numel(), plan.selected_token_indices.numel()
        seqs, blocks = len(plan.block_tables), max(len(t) for t in plan.block_tables)
        if not cap.fits(tokens, rows, seqs, blocks):
            self._allocate(StepCapacity(max(cap.max_tokens, tokens, rows), max(cap.max_seqs, seqs),
                                        max(cap.max_blocks_per_seq, blocks), cap.block_size, cap.max_graph_tokens))

    def _result(self, out, logits: torch.Tensor, prompt: Optional[PromptLogprobs]) -> StepResult:
        """The :class:`StepResult` of sampler output ``out``: its one read to the host (:func:`read_to_host`)."""
        token_ids, bad_rows, logprobs, top_ids, top_logprobs = read_to_host(
            [out.token_ids, out.bad_rows, out.logprobs, out.top_logprob_ids, out.top_logprobs])
        bad = bad_rows.tolist()
        notes: Dict[int, str] = {}
        if any(bad):  # identical on every rank: a collective every rank makes
            from tpguide.worker.faults import describe_bad_rows, nonfinite_ranks

            notes = describe_bad_rows(nonfinite_ranks(logits, self.group))
        return StepResult(token_ids=token_ids.tolist(), logprobs=logprobs, top_logprob_ids=top_ids,
                          top_logprobs=top_logprobs, bad_rows=bad, bad_row_notes=notes, prompt_logprobs=prompt)

    def _apply_bitmask_static(self, logits: torch.Tensor, bitmask: Optional[BitmaskSlices]) -> None:
        """:meth:`_apply_bitmask` through the persistent bitmask buffers (one non-blocking copy on the driver)."""
        num_rows = logits.shape[0]
        buffers, group = self.bitmask_buffers, self.group
        slices = None
        if group.is_driver:
            token_mask, slices = buffers.send(*bitmask)
            local = slices[0]
        else:
            token_mask, local = buffers.receive_views(num_rows)
        if group.tp_size > 1:
            C.broadcast_tensor(token_mask, group)
            local = torch.empty((num_rows, buffers.words), dtype=torch.int32, device=group.device)
            C.scatter_tensor(local, slices, group)
        apply_token_bitmask_inplace(logits, local, token_mask=token_mask,
                                    vocab_start_index=self.shard.vocab_start_index)

    def _apply_bitmask(self, logits: torch.Tensor, bitmask: Optional[BitmaskSlices]) -> None:
        """Receive this rank's token_mask and word slice, apply it to ``logits`` in place."""
        num_rows = logits.shape[0]
        dev = self.group.device
        words = self.shard.bitmask_size // self.group.tp_size
        token_mask = torch.zeros(num_rows, dtype=torch.int32)
        slices = None
        if self.group.is_driver:
            token_mask, slices = bitmask
        token_mask = C.broadcast_tensor(token_mask.to(dev), self.group)
        local = torch.empty((num_rows, words), dtype=torch.int32, device=dev)
        C.scatter_tensor(local, None if slices is None else [s.to(dev) for s in slices], self.group)
        apply_token_bitmask_inplace(logits, local, token_mask=token_mask,
                                    vocab_start_index=self.shard.vocab_start_index)

    def _prompt_logprobs(self, hidden: torch.Tensor, plan: StepPlan) -> PromptLogprobs:
        """Prompt logprobs of ``plan.selected_prompt_indices``, in blocks of :data:`PROMPT_ROW_BLOCK` rows."""
        rows = plan.selected_prompt_indices.to(device=hidden.device, dtype=torch.int64)
        targets = plan.prompt_target_ids.to(hidden.device)
        parts = []
        for start in range(0, rows.numel(), PROMPT_ROW_BLOCK):
            block = slice(start, start + PROMPT_ROW_BLOCK)
            logits = self.model.compute_logits(hidden[rows[block]])  # [B, V_pad / tp] fp32
            out = compute_prompt_logprobs(logits, targets[block], plan.num_prompt_logprobs, self.shard, self.group)
            parts.append(PromptLogprobs(out.logprobs.cpu(), out.top_ids.cpu(), out.top_logprobs.cpu()))
        return PromptLogprobs.cat(parts, plan.num_prompt_logprobs)

    def draft(self, plan, token_bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One draft-head iteration (:func:`tpguide.speculative.draft_iteration.run_draft_iteration`)."""
        from tpguide.speculative.draft_iteration import run_draft_iteration

        return run_draft_iteration(self.draft_head, plan, self.group, token_bitmask)

    def follow_driver(self) -> None:
        """Act on the driver's messages until STOP (non-driver ranks).

        Raises
        ------
        DriverAborted
            The driver failed between steps (an ABORT message).
        """
        assert not self.group.is_driver
        while True:
            message: Message = C.broadcast_object(None, self.group)
            if message.kind is MessageKind.STEP:
                self.execute(message.step)
            elif message.kind is MessageKind.DRAFT:
                self.draft(message.draft)
            elif message.kind is MessageKind.STOP:
                return
            elif message.kind is MessageKind.ABORT:
                raise DriverAborted(f"rank {self.group.tp_rank}: the driver (rank 0) failed between steps "
                                    f"and aborted the group: {message.error}")
            # HEARTBEAT: nothing to do


def read_to_host(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Copy device tensors to the host with one wait: THE step's one host-device synchronization.

    On CUDA each tensor goes into pinned memory with a non-blocking copy and
    the host waits once, on an event recorded after the last copy (sync debug
    mode is lifted for that wait only: it is the allowed one, docs/gpu.md).
    On CPU the tensors are returned as they are.
    """
    if not tensors or not tensors[0].is_cuda:
        return list(tensors)
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for dst, src in zip(out, tensors):
        dst.copy_(src, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    with allowed_host_sync():
        done.synchronize()
    return [t.clone() for t in out]  # pageable copies: the pinned blocks go back to the allocator at once

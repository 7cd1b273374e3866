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

**On CUDA** the forward goes through the persistent buffers and CUDA graphs
of :mod:`tpguide.worker.fast_path` (docs/gpu.md "Speed on CUDA: graphs and
host syncs"): one branch of :meth:`StepRunner.execute_model` and of
:meth:`StepRunner._apply_bitmask`; penalties, the bitmask application and
sampling are the same code on both paths.  The host waits for the device
once per step, to read the sampled ids (:func:`read_to_host`).
"""

from __future__ import annotations

import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.kernels import apply_token_bitmask_inplace
from tpguide.sampling.penalties import apply_penalties_inplace
from tpguide.sampling.prompt_logprobs import PromptLogprobs
from tpguide.speculative.draft_iteration import DraftPlan, run_draft_iteration
from tpguide.worker.cuda_graphs import PaddedEager
from tpguide.worker.fast_path import FastPath
from tpguide.worker.fast_path_check import CHECKED_STEPS, FastPathCheck
from tpguide.worker.forward import ForwardOutput, eager_forward, plain_inputs
from tpguide.worker.group_sampling import sample
from tpguide.worker.host_sync import allowed_host_sync
from tpguide.worker.protocol import BitmaskSlices, DriverAborted, Message, MessageKind, StepPlan, StepResult
from tpguide.worker.step_inputs import StepBuffers, StepCapacity

__all__ = ["ForwardOutput", "StepRunner", "DriverAborted", "read_to_host"]


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
        Replay a CUDA graph per token-count bucket where
        :func:`~tpguide.worker.cuda_graphs.graphs_supported` agrees.
    static_inputs : bool, optional
        The persistent-buffer (fast) path, :mod:`tpguide.worker.fast_path`; default: on a CUDA device.
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
        #: the first steps of each fast-path kind checked against the plain step (:mod:`~tpguide.worker.fast_path_check`)
        self.fast_path_check = FastPathCheck(group, check_steps)
        #: why the fast path was turned off during the run ("" while it has not been; :meth:`_fast_path_off`)
        self.fast_path_off_reason = ""
        #: the persistent-buffer path (default on CUDA; None: the plain step, the CPU path)
        self.fast_path: Optional[FastPath] = None
        static = group.device.type == "cuda" if static_inputs is None else static_inputs
        if static:
            if capacity is None:
                raise ValueError("static step inputs need a StepCapacity (the engine's limits)")
            self.fast_path = FastPath(model, group, capacity, cuda_graphs, self.fast_path_check)

    @property
    def static_inputs(self) -> bool:
        """Whether steps run on the fast path (persistent buffers)."""
        return self.fast_path is not None

    @property
    def buffers(self) -> Optional[StepBuffers]:
        """The fast path's persistent input buffers (None without it)."""
        return None if self.fast_path is None else self.fast_path.buffers

    @property
    def graphs(self) -> Optional[PaddedEager]:
        """The fast path's CUDA graphs (None when off); tests may set a :class:`PaddedEager`."""
        return None if self.fast_path is None else self.fast_path.graphs

    @graphs.setter
    def graphs(self, graphs: Optional[PaddedEager]) -> None:
        self.fast_path.graphs = graphs

    @property
    def graphs_off_reason(self) -> str:
        """Why CUDA graphs are off although asked for ("" when on or not asked for)."""
        if self.fast_path_off_reason or self.fast_path is None:
            return self.fast_path_off_reason
        return self.fast_path.graphs_off_reason

    def execute(self, plan: StepPlan, bitmask: Optional[BitmaskSlices] = None) -> StepResult:
        """One whole step on this rank: :meth:`execute_model`, then :meth:`sample_tokens` (a collective).

        The non-driver ranks' step (:meth:`follow_driver`); the driver's engine
        calls the two phases itself, its bitmask fill between them.
        """
        return self.sample_tokens(plan, self.execute_model(plan), bitmask)

    def execute_model(self, plan: StepPlan) -> ForwardOutput:
        """The step's forward on this rank: logits of the sample rows, prompt logprobs (a collective).

        Every rank calls it with the same plan; :meth:`sample_tokens` follows.
        The forward is :func:`~tpguide.worker.forward.eager_forward` on the
        plan's own tensors, or the fast path's (:mod:`tpguide.worker.fast_path`);
        then the penalties, each rank on its own shard (exact at every tp size).

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
        if self.fast_path is None:
            forward = eager_forward(self.model, plain_inputs(plan, self.group.device, self.model.kv_block_size),
                                    plan, self.group)
        else:
            forward, off_reason = self.fast_path.execute_model(plan)
            if off_reason is not None:
                self._fast_path_off(off_reason)
        if plan.sampling.penalties is not None:  # sparse entries, copied non-blocking (sampling/penalties.py)
            apply_penalties_inplace(forward.logits, plan.sampling.penalties.to(self.group.device),
                                    self.shard.vocab_start_index)
        return forward

    def _fast_path_off(self, reason: str) -> None:
        """Run every later step on the plain eager path, and say why on stderr (docs/gpu.md)."""
        self.fast_path = None
        self.fast_path_off_reason = reason
        print(f"[rank {getattr(self.group, 'rank', self.group.tp_rank)}] WARNING: CUDA fast path (persistent "
              f"buffers, CUDA graphs) off for the rest of this run: {reason}. Every step now runs the plain "
              "eager path; please report this with the output of `bash launch/gpu_check.sh`.",
              file=sys.stderr, flush=True)

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
        if plan.guided:
            self._apply_bitmask(forward.logits, bitmask)
        out = sample(forward.logits, forward.sampling, self.shard, self.group)
        return self._result(out, forward.logits, forward.prompt)

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

    def _apply_bitmask(self, logits: torch.Tensor, bitmask: Optional[BitmaskSlices]) -> None:
        """Receive this rank's token_mask and word slice, apply it to ``logits`` ``[R, V_pad / tp]`` in place.

        The driver's ``bitmask`` reaches the device through the fast path's
        persistent buffers, or as it is (:meth:`_bitmask_on_device`); at
        tp > 1 the token_mask is broadcast and the word slices scattered.
        """
        num_rows = logits.shape[0]
        if self.fast_path is not None:
            token_mask, slices = self.fast_path.bitmask_on_device(bitmask, num_rows)
        else:
            token_mask, slices = self._bitmask_on_device(bitmask, num_rows)
        if self.group.tp_size > 1:
            token_mask = C.broadcast_tensor(token_mask, self.group)
            local = torch.empty((num_rows, self.shard.bitmask_size // self.group.tp_size), dtype=torch.int32,
                                device=self.group.device)
            C.scatter_tensor(local, slices, self.group)
        else:
            local = slices[0]
        apply_token_bitmask_inplace(logits, local, token_mask=token_mask,
                                    vocab_start_index=self.shard.vocab_start_index)

    def _bitmask_on_device(self, bitmask: Optional[BitmaskSlices],
                           num_rows: int) -> Tuple[torch.Tensor, Optional[List[torch.Tensor]]]:
        """The driver's ``(token_mask [R], word slices)`` on this rank's device; other ranks: a receive buffer, None."""
        dev = self.group.device
        if not self.group.is_driver:
            return torch.zeros(num_rows, dtype=torch.int32, device=dev), None
        token_mask, slices = bitmask
        return token_mask.to(dev), [s.to(dev) for s in slices]

    def draft(self, plan: DraftPlan, token_bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One draft-head iteration (:func:`tpguide.speculative.draft_iteration.run_draft_iteration`)."""
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

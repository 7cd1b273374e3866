"""Every rank's step execution: a plan in, a result value out (docs/architecture.md §1).

The file holds, in order, the plan channel's message type, the sampler bound
to the TP group, and the step runner.

**The plan channel: one tagged message type.**  The driver sends every rank
exactly one :class:`Message` per ``broadcast_object`` on the plan channel;
the other ranks wait in that broadcast between steps and act on
``message.kind``:

===========  =====================================================  ========================
kind         meaning                                                payload
===========  =====================================================  ========================
STEP         run one engine step (forward, LM head, bitmask,         ``step``: :class:`StepPlan`
             sampling)
DRAFT        run one draft-head drafting iteration                   ``draft``: DraftPlan
HEARTBEAT    nothing to do; keeps idle ranks inside the collective   none
             timeout (an idle server)
STOP         leave the loop (the driver shut down)                   none
ABORT        the driver failed between steps: raise                  ``error``: str
             :class:`DriverAborted` and exit non-zero
===========  =====================================================  ========================

A :class:`StepPlan` is ``O(num_tokens + num_sample_rows)`` integers; the
token bitmask travels separately (each rank receives only its word slice).

**The sampler over the TP group.**  :mod:`tpguide.sampling` holds the
mathematics and never imports ``torch.distributed``; :class:`GroupExchange`
binds its exchange protocol (:mod:`tpguide.sampling.exchange`) to the thin
collectives of :mod:`tpguide.dist.group` (:func:`sample`,
:func:`compute_prompt_logprobs`).

**The step.**  :meth:`StepRunner.execute` runs one :class:`StepPlan`::

    forward on this rank's weight shard       -> hidden [T, H] (replicated)
    prompt rows -> LM-head shard -> prompt logprobs       (if the plan asks)
    rows selected_token_indices -> LM-head shard          -> logits [R, V_pad / T] fp32
    guided: broadcast token_mask, scatter word slices, apply own slice in place
    vocab-parallel sampling (all-gather of (value, token id) candidates)
    -> StepResult, identical on every rank

It reads and writes no driver state: the driver's only input is the bitmask
callable it passes in (the rows it filled while the forward ran).  Non-driver
ranks run :meth:`StepRunner.follow_driver`, acting on each message of the
plan channel until STOP.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.kernels import apply_token_bitmask_inplace
from tpguide.model.attention import AttentionMetadata
from tpguide.model.vocab_shard import VocabShard
from tpguide.sampling.exchange import PerRank
from tpguide.sampling.penalties import apply_penalties_inplace
from tpguide.sampling.prompt_logprobs import PromptLogprobs, check_prompt_inputs, prompt_logprobs_with_exchange
from tpguide.sampling.sampler import SamplerOutput, SamplingMetadata, check_sampler_inputs, sample_with_exchange

# ---------------------------------------------------------------------- the plan channel

class DriverAborted(RuntimeError):
    """Raised on a non-driver rank that received an ABORT message."""


@dataclass
class StepPlan:
    """One engine step for every rank (built on the driver by :mod:`tpguide.engine.driver`).

    Token positions have ONE source, ``context_lens``: the model's positions
    (RoPE) and the KV-cache write positions are both
    ``context_lens[s] + i`` for the ``i``-th new token of sequence ``s``
    (``AttentionMetadata.token_positions`` of :mod:`tpguide.model.attention`).

    Attributes
    ----------
    input_ids : torch.Tensor
        int64 ``[num_tokens]``: the flattened new tokens, sequence after sequence.
    seq_slots, query_lens, context_lens : list of int
        Per scheduled sequence (batch order): KV slot, new tokens, tokens already cached.
    selected_token_indices : torch.Tensor
        int32 ``[num_sample_rows]``: hidden-state rows that go through the LM
        head (docs/architecture.md §4), the same on every rank.
    sampling : SamplingMetadata
        Per sample row: temperature, top-k, top-p, seed, sample position.
    guided : bool
        A bitmask (token_mask broadcast + word-slice scatter) follows the forward.
    selected_prompt_indices : torch.Tensor or None
        int32 ``[num_prompt_rows]``: rows whose log-softmax gives prompt
        logprobs; ``None`` when no request asks for them.
    prompt_target_ids : torch.Tensor or None
        int64 ``[num_prompt_rows]``: the prompt token each of those rows scores.
    num_prompt_logprobs : int
        Top-n prompt logprobs per row (max over the batch).

    Raises
    ------
    ValueError
        Per-sequence lists of different lengths, or ``input_ids`` not
        ``sum(query_lens)`` long.
    """

    input_ids: torch.Tensor
    seq_slots: List[int]
    query_lens: List[int]
    context_lens: List[int]
    selected_token_indices: torch.Tensor
    sampling: SamplingMetadata
    guided: bool = False
    selected_prompt_indices: Optional[torch.Tensor] = None
    prompt_target_ids: Optional[torch.Tensor] = None
    num_prompt_logprobs: int = 0

    def __post_init__(self) -> None:
        n = len(self.seq_slots)
        if len(self.query_lens) != n or len(self.context_lens) != n:
            raise ValueError(f"seq_slots ({n}), query_lens ({len(self.query_lens)}) and context_lens "
                             f"({len(self.context_lens)}) must have one entry per sequence")
        if self.input_ids.numel() != sum(self.query_lens):
            raise ValueError(f"input_ids has {self.input_ids.numel()} tokens, sum(query_lens) = "
                             f"{sum(self.query_lens)}")


class MessageKind(enum.Enum):
    STEP = "step"
    DRAFT = "draft"
    HEARTBEAT = "heartbeat"
    STOP = "stop"
    ABORT = "abort"


@dataclass(frozen=True)
class Message:
    """One message on the plan channel; build it with the class methods."""

    kind: MessageKind
    step: Optional[StepPlan] = None
    draft: Any = None  # tpguide.speculative.draft_iteration.DraftPlan
    error: Optional[str] = None

    @classmethod
    def for_step(cls, plan: StepPlan) -> "Message":
        return cls(MessageKind.STEP, step=plan)

    @classmethod
    def for_draft(cls, plan) -> "Message":
        return cls(MessageKind.DRAFT, draft=plan)

    @classmethod
    def heartbeat(cls) -> "Message":
        return cls(MessageKind.HEARTBEAT)

    @classmethod
    def stop(cls) -> "Message":
        return cls(MessageKind.STOP)

    @classmethod
    def abort(cls, exc: BaseException) -> "Message":
        """The ABORT message reporting ``exc`` (type and message) to the other ranks."""
        return cls(MessageKind.ABORT, error=f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------- sampling over the group

class GroupExchange:
    """``gather`` = all-gather, ``reduce_sum`` = all-reduce over ``group`` (identity at tp_size 1)."""

    def __init__(self, logits_shard: torch.Tensor, shard: VocabShard, group: TPGroup) -> None:
        if (shard.tp_rank, shard.tp_size) != (group.tp_rank, group.tp_size):
            raise ValueError(f"shard is rank {shard.tp_rank} of {shard.tp_size} but group is rank "
                             f"{group.tp_rank} of {group.tp_size}")
        self.logits_shard, self.shard, self.group = logits_shard, shard, group

    def gather(self, fn: PerRank) -> torch.Tensor:
        """``fn`` on this rank's shard, all-gathered: ``[tp_size, *shape]``."""
        return C.all_gather_stacked(fn(self.logits_shard, self.shard), self.group)

    def reduce_sum(self, fn: PerRank) -> torch.Tensor:
        return C.all_reduce(fn(self.logits_shard, self.shard), self.group, op="sum")


def sample(logits_shard: torch.Tensor, meta: SamplingMetadata, shard: VocabShard, group: TPGroup) -> SamplerOutput:
    """Sample one token per row from vocabulary-sharded logits; same result on every rank.

    Parameters
    ----------
    logits_shard : Tensor, float32 (or fp16/bf16, upcast exactly) [rows, V_local]
        This rank's logits, ``V_local = shard.num_embeddings_per_partition``,
        bitmask already applied, padded ids ``-inf``.  Not modified.
    meta : SamplingMetadata
        Identical on every rank.
    shard : VocabShard
        This rank's vocabulary slice (``shard.tp_rank == group.tp_rank``).
    group : TPGroup
        Called collectives: one all-gather, one all-reduce, more all-gathers
        only when a top-p nucleus outgrows the candidates.

    Returns
    -------
    SamplerOutput
        On ``logits_shard``'s device, identical on every rank and for every tp_size.

    Raises
    ------
    ValueError
        Shape mismatch, shard/group mismatch, ``num_logprobs > org_vocab_size``
        or a vocabulary above ``2**19`` tokens.
    TypeError
        Non-floating logits.
    """
    exchange = GroupExchange(logits_shard, shard, group)
    check_sampler_inputs(logits_shard, meta, shard)
    return sample_with_exchange(exchange, meta, shard)


def compute_prompt_logprobs(logits_shard: torch.Tensor, target_ids: torch.Tensor, num_top: int,
                            shard: VocabShard, group: TPGroup) -> PromptLogprobs:
    """Logprob of each row's target token and the top-``num_top`` logprobs; same on every rank.

    Parameters
    ----------
    logits_shard : Tensor, float32 [rows, V_local]
        This rank's raw logits of the prompt rows (padded ids ``-inf``).  Not modified.
    target_ids : Tensor, int64 [rows]
        Global id of the prompt token each row scores; the same on every rank.
    num_top : int
        Top logprobs per row, ``>= 0``.
    shard : VocabShard
    group : TPGroup
        Collectives: one all-gather, one all-reduce (nothing at tp_size 1).

    Raises
    ------
    ValueError
        Shapes that do not match, a negative ``num_top``, or a shard of another rank.
    """
    exchange = GroupExchange(logits_shard, shard, group)
    check_prompt_inputs(logits_shard, target_ids, num_top, shard)
    return prompt_logprobs_with_exchange(exchange, target_ids, num_top, shard.org_vocab_size)


# ---------------------------------------------------------------------- the step

#: On the driver: returns ``(token_mask int32 [R], word slices)`` once the rows are filled; slice
#: ``r`` is int32 ``[R, bitmask_size // tp_size]`` for rank ``r``; a row whose fill failed has
#: ``token_mask`` 0 (the driver discards its sample).
BitmaskSource = Callable[[], Tuple[torch.Tensor, Sequence[torch.Tensor]]]

#: Prompt rows per LM-head call: bounds the ``[rows, V_local]`` fp32/fp64 temporaries.
PROMPT_ROW_BLOCK = 256


@dataclass(frozen=True)
class StepResult:
    """What one step produced, identical on every rank (CPU).

    Attributes
    ----------
    token_ids : list of int
        ``[R]`` sampled global token ids per sample row (``-1`` on a bad row).
    logprobs : Tensor, float32 [R]
        Raw logprob of each sampled token (NaN when no row asked for logprobs).
    top_logprob_ids, top_logprobs : Tensor, int64 / float32 [R, n]
    bad_rows : list of bool
        ``[R]``: the row was all ``-inf``, held a NaN / ``+inf``, or a padded id won.
    bad_row_notes : dict of int to str
        Why each bad row is bad, naming the ranks whose shard held a NaN / ``+inf``.
    prompt_logprobs : PromptLogprobs or None
        Rows of ``plan.selected_prompt_indices``, in plan order.
    """

    token_ids: List[int]
    logprobs: torch.Tensor
    top_logprob_ids: torch.Tensor
    top_logprobs: torch.Tensor
    bad_rows: List[bool]
    bad_row_notes: Dict[int, str]
    prompt_logprobs: Optional[PromptLogprobs] = None


class StepRunner:
    """This rank's model shard (and draft head) driven by plans.

    Parameters
    ----------
    model : LlamaForCausalLM
        This rank's shard, KV cache allocated.
    group : TPGroup
    draft_head : DraftHead, optional
        This rank's drafter (speculative method ``draft-head``).
    """

    def __init__(self, model, group: TPGroup, draft_head=None) -> None:
        self.model, self.group, self.draft_head = model, group, draft_head
        self.shard = model.vocab_shard
        #: called at the start of every step; ``launch/generate.py`` sets it to
        #: :func:`tpguide.dist.fault_inject.step_fault_hook` when ``TPGUIDE_FAULT_INJECT`` is set (tests only)
        self.on_step: Optional[Callable[[], None]] = None

    def execute(self, plan: StepPlan, bitmask: Optional[BitmaskSource] = None) -> StepResult:
        """Run one step on this rank (a collective: every rank calls it with the same plan).

        Parameters
        ----------
        plan : StepPlan
        bitmask : callable, optional
            Driver only, for a guided plan: see :data:`BitmaskSource`.

        Returns
        -------
        StepResult
        """
        if self.on_step is not None:
            self.on_step()
        dev = self.group.device
        meta = AttentionMetadata.from_lists(plan.seq_slots, plan.query_lens, plan.context_lens, device=dev)
        hidden = self.model(plan.input_ids.to(dev), meta.token_positions, meta)  # [T, H]
        prompt = None
        if plan.selected_prompt_indices is not None:
            prompt = self._prompt_logprobs(hidden, plan)
        rows = plan.selected_token_indices.to(device=dev, dtype=torch.int64)
        logits = self.model.compute_logits(hidden[rows])  # [R, V_pad / tp] fp32
        if plan.sampling.penalties is not None:  # each rank its own shard: exact at every tp size
            apply_penalties_inplace(logits, plan.sampling.penalties.to(dev), self.shard.vocab_start_index)
        if plan.guided:
            self._apply_bitmask(logits, bitmask)
        out = sample(logits, plan.sampling.to(dev), self.shard, self.group)
        bad = out.bad_rows.cpu().tolist()
        notes: Dict[int, str] = {}
        if any(bad):  # identical on every rank: a collective every rank makes
            from tpguide.worker.faults import describe_bad_rows, nonfinite_ranks

            notes = describe_bad_rows(nonfinite_ranks(logits, self.group))
        return StepResult(token_ids=out.token_ids.cpu().tolist(), logprobs=out.logprobs.cpu(),
                          top_logprob_ids=out.top_logprob_ids.cpu(), top_logprobs=out.top_logprobs.cpu(),
                          bad_rows=bad, bad_row_notes=notes, prompt_logprobs=prompt)

    def _apply_bitmask(self, logits: torch.Tensor, bitmask: Optional[BitmaskSource]) -> None:
        """Receive this rank's token_mask and word slice, apply it to ``logits`` in place."""
        num_rows = logits.shape[0]
        dev = self.group.device
        words = self.shard.bitmask_size // self.group.tp_size
        token_mask = torch.zeros(num_rows, dtype=torch.int32)
        slices = None
        if self.group.is_driver:
            token_mask, slices = bitmask()
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

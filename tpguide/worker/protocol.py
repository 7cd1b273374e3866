"""The messages between the driver and the ranks: the step plan, the step result, the plan channel's Message.

docs/architecture.md §1.  Both sides import these types: the driver side
(:mod:`tpguide.engine`) builds plans and reads results, every rank
(:mod:`tpguide.worker.runner`) executes plans and returns results.

**The plan channel: one tagged message type.**  The driver sends every rank
exactly one :class:`Message` per ``broadcast_object`` on the plan channel;
the other ranks wait in that broadcast between steps and act on
``message.kind``:

===========  =====================================================  ========================
kind         meaning                                                payload
===========  =====================================================  ========================
STEP         run one engine step (forward, LM head, bitmask,         ``step``: :class:`StepPlan`
             sampling)
DRAFT        run one draft-head drafting iteration                   ``draft``: :class:`DraftPlan`
HEARTBEAT    nothing to do; keeps idle ranks inside the collective   none
             timeout (an idle server)
STOP         leave the loop (the driver shut down)                   none
ABORT        the driver failed between steps: raise                  ``error``: str
             :class:`DriverAborted` and exit non-zero
===========  =====================================================  ========================

A :class:`StepPlan` is ``O(num_tokens + num_sample_rows)`` integers; the
token bitmask travels separately (each rank receives only its word slice).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence

import torch

from tpguide.sampling.prompt_logprobs import PromptLogprobs
from tpguide.sampling.sampler import SamplingMetadata
from tpguide.speculative.draft_iteration import DraftPlan


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
    block_tables : list of list of int
        Per scheduled sequence (batch order): its KV blocks in position order
        (position ``j`` in block ``block_tables[s][j // block_size]``,
        docs/architecture.md §7 "KV cache"); the driver allocated them.
    query_lens, context_lens : list of int
        Per scheduled sequence: new tokens, tokens already cached.
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
    block_tables: List[List[int]]
    query_lens: List[int]
    context_lens: List[int]
    selected_token_indices: torch.Tensor
    sampling: SamplingMetadata
    guided: bool = False
    selected_prompt_indices: Optional[torch.Tensor] = None
    prompt_target_ids: Optional[torch.Tensor] = None
    num_prompt_logprobs: int = 0

    def __post_init__(self) -> None:
        n = len(self.block_tables)
        if len(self.query_lens) != n or len(self.context_lens) != n:
            raise ValueError(f"block_tables ({n}), query_lens ({len(self.query_lens)}) and context_lens "
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
    draft: Optional[DraftPlan] = None
    error: Optional[str] = None

    @classmethod
    def for_step(cls, plan: StepPlan) -> "Message":
        return cls(MessageKind.STEP, step=plan)

    @classmethod
    def for_draft(cls, plan: DraftPlan) -> "Message":
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


class BitmaskSlices(NamedTuple):
    """The driver's filled bitmask rows of one step, cut for the scatter (docs/architecture.md §2).

    Attributes
    ----------
    token_mask : torch.Tensor
        int32 ``[R]``: 0 leaves a row's logits untouched (an unguided row, or
        one whose fill failed: the driver discards its sample).
    word_slices : sequence of torch.Tensor
        Slice ``r`` is int32 ``[R, bitmask_size // tp_size]``, the words of rank ``r``.
    """

    token_mask: torch.Tensor
    word_slices: Sequence[torch.Tensor]


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

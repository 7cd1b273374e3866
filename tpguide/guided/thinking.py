"""The grammar gate of a thinking request: its phase, its budget, and the bitmask rows it gets while it thinks.

docs/reasoning.md, docs/architecture.md §5.  While a request
thinks (from its first output token, unless its prompt closed the think
block: :meth:`~tpguide.guided.reasoning.ReasoningParser.starts_thinking`)
its matcher does not advance, and its rows are::

    budget reached (thinking_token_budget)   only </think>            token_mask 1
    guided request                           all but the stop tokens  token_mask 1
    unguided request                         untouched                token_mask 0

so a guided request cannot end before its answer, and the budget forces
``</think>`` through the mask (with drafts: as a forced draft, no extra
step).  The token ``</think>`` ends the thinking; the grammar applies from
the next row on, also inside a verify window.  :class:`Thinking` is the
verified state (in the slot's record), :class:`ThinkingWalk` the state after
some drafts (the verify fill, n-gram drafts), a copy that never touches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from tpguide.kernels.bitmask_layout import BITS_PER_WORD
from tpguide.model.vocab_shard import get_bitmask_size


@dataclass
class Thinking:
    """The verified thinking state of one request.

    Attributes
    ----------
    end_token_id : int
        ``</think>``.
    budget : int or None
        Thinking tokens before ``</think>`` is forced (``thinking_token_budget``); None: no limit.
    num_tokens : int
        Thinking tokens so far (``</think>`` not counted).
    ended : bool
        ``</think>`` was accepted: the answer runs.
    """

    end_token_id: int
    budget: Optional[int] = None
    num_tokens: int = 0
    ended: bool = False

    def accept(self, token_id: int) -> None:
        """Advance by a verified output token of the thinking."""
        if token_id == self.end_token_id:
            self.ended = True
        else:
            self.num_tokens += 1

    @property
    def answer_start(self) -> Optional[int]:
        """Index of the answer's first output token (thinking started at the first), None while thinking."""
        return self.num_tokens + 1 if self.ended else None

    def walk(self) -> "ThinkingWalk":
        return ThinkingWalk(self.end_token_id, self.budget, self.num_tokens, self.ended)


@dataclass
class ThinkingWalk:
    """The thinking state after some drafts (a copy: the verified :class:`Thinking` is unchanged)."""

    end_token_id: int
    budget: Optional[int]
    num_tokens: int
    ended: bool

    @property
    def at_budget(self) -> bool:
        """Only ``</think>`` may come next."""
        return not self.ended and self.budget is not None and self.num_tokens >= self.budget

    def allows(self, token_id: int, stop_token_ids: Iterable[int], guided: bool) -> bool:
        """Whether a thinking row allows ``token_id`` (call only while not :attr:`ended`)."""
        if self.at_budget:
            return token_id == self.end_token_id
        return not guided or token_id not in stop_token_ids

    def advance(self, token_id: int) -> None:
        if token_id == self.end_token_id:
            self.ended = True
        else:
            self.num_tokens += 1


class ThinkingRows:
    """The two bitmask rows of thinking: all but the stop tokens, and ``</think>`` alone.

    Parameters
    ----------
    padded_vocab_size : int
        Bitmask width in tokens.
    stop_token_ids : iterable of int
        Masked for a guided request while it thinks.
    end_token_id : int
        ``</think>``.
    """

    def __init__(self, padded_vocab_size: int, stop_token_ids: Iterable[int], end_token_id: int) -> None:
        size = get_bitmask_size(padded_vocab_size)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.end_token_id = end_token_id
        self.no_stop = torch.full((size,), -1, dtype=torch.int32)
        for token_id in self.stop_token_ids:
            self.no_stop[token_id // BITS_PER_WORD] &= _signed(~(1 << token_id % BITS_PER_WORD) & 0xFFFFFFFF)
        self.only_end = torch.zeros(size, dtype=torch.int32)
        self.only_end[end_token_id // BITS_PER_WORD] = _signed(1 << end_token_id % BITS_PER_WORD)

    def fill(self, token_bitmask: torch.Tensor, row: int, walk: ThinkingWalk, guided: bool) -> int:
        """Write ``walk``'s thinking row into ``token_bitmask[row]`` (all ones on entry); its ``token_mask``."""
        if walk.at_budget:
            token_bitmask[row] = self.only_end
            return 1
        if guided:
            token_bitmask[row] = self.no_stop
            return 1
        return 0


def _signed(word: int) -> int:
    """A 32-bit word as the int32 value with the same bits."""
    return word - (1 << 32) if word >= 1 << 31 else word

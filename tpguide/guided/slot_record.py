"""One request's grammar state in its slot: matcher, failure, layout matchers, forced-draft flag, thinking (driver only).

docs/architecture.md §5.  :class:`~tpguide.guided.decoder.GuidedDecoder`
builds a fresh record when a request takes a slot and drops it when the
request leaves, so a request never sees a previous request's state.  The
drafters and the step finisher read and write a request's state here, and
nowhere else.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional

from tpguide.guided.matcher import GrammarMatcher
from tpguide.guided.thinking import Thinking


class GuideFailure(enum.Enum):
    """Why a request's grammar failed: what the step finisher branches on (the message says the rest)."""

    DEAD_END = "dead end"  # a filled row allows no token below padded_vocab_size
    MATCHER_ERROR = "matcher error"  # the matcher raised (filling a row, or accepting a token)
    REJECTED_TOKEN = "rejected token"  # the matcher refused a verified token


@dataclass
class SlotRecord:
    """The grammar state of the request in one slot.

    Attributes
    ----------
    matcher : GrammarMatcher or None
        None for an unguided request that thinks under a budget.  Holds the request's verified output tokens (docs/architecture.md §5,
        the rollback discipline of :mod:`tpguide.guided.draft_cursor`).
    failure : str or None
        Why the request failed, as a message (names the slot, the token or the matcher's error).
    failure_kind : GuideFailure or None
        The kind of that failure (set with it, by :meth:`fail`).
    layouts : list of GrammarMatcher or None
        The grammar drafter's JSON layout matchers still in the race
        (:mod:`tpguide.speculative.grammar_draft`); None until it first drafts.
    num_layout_tokens : int
        Output tokens the layout matchers have followed.
    forced : bool
        The drafts of this step are the grammar's forced text (the speculator's statistics).
    thinking : Thinking or None
        The reasoning phase (:mod:`tpguide.guided.thinking`); None: the
        request answers from its first output token.
    """

    matcher: Optional[GrammarMatcher]
    failure: Optional[str] = None
    failure_kind: Optional[GuideFailure] = None
    layouts: Optional[List[GrammarMatcher]] = None
    num_layout_tokens: int = 0
    forced: bool = False
    thinking: Optional[Thinking] = None

    def fail(self, kind: GuideFailure, message: str) -> None:
        """Record the request's grammar failure: its kind and its message."""
        self.failure_kind, self.failure = kind, message

    @property
    def is_thinking(self) -> bool:
        """The request thinks: its matcher waits for ``</think>``."""
        return self.thinking is not None and not self.thinking.ended

    @property
    def answer_start(self) -> Optional[int]:
        """Index of the answer's first output token; None while thinking."""
        return self.thinking.answer_start if self.thinking is not None else 0

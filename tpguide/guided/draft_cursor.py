"""The one rollback discipline of speculative decoding: advance a matcher through drafts, roll it all back at once.

docs/architecture.md §5.  Between steps a matcher holds exactly the
verified tokens of its request.  Whatever advances it through tokens that
are *not* verified does so through a :class:`DraftCursor` inside
:func:`drafting`, and the matcher is back where it started when the block
ends, whatever happened inside:

* a drafter asking the grammar about its drafts (the grammar drafter's
  forced tokens, the n-gram drafts' grammar check, the draft head's
  per-iteration masks);
* the bitmask fill of a verify pass (row ``j`` is the state after
  ``d_1 .. d_j``).

The tokens the target model verifies are then accepted by the one path
every output token takes (:class:`tpguide.engine.finisher.StepFinisher`),
so nothing is rolled back after verification and no counter has to say how
far.  vLLM's structured-output manager does the same (fill, accept, roll
back at once).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from tpguide.guided.matcher import GrammarMatcher


class DraftCursor:
    """A matcher advanced through draft tokens; :func:`drafting` rolls it back.

    Parameters
    ----------
    matcher : GrammarMatcher

    Attributes
    ----------
    num_advanced : int
        Drafts accepted so far (the rollback at the end).
    """

    def __init__(self, matcher: GrammarMatcher) -> None:
        self.matcher = matcher
        self.num_advanced = 0

    def accept(self, token_id: int) -> bool:
        """Advance by a draft; False (state unchanged) if the grammar rejects it or the matcher raises."""
        try:
            ok = bool(self.matcher.accept_token(int(token_id)))
        except Exception:  # noqa: BLE001 - a draft never fails a request; verification reports errors
            ok = False
        self.num_advanced += ok
        return ok

    def rollback(self) -> None:
        """Undo every draft accepted so far.

        Raises
        ------
        ValueError
            The matcher cannot roll back that far (an engine bug).
        """
        n, self.num_advanced = self.num_advanced, 0
        if n:
            self.matcher.rollback(n)


@contextlib.contextmanager
def drafting(matcher: GrammarMatcher) -> Iterator[DraftCursor]:
    """A :class:`DraftCursor` on ``matcher``, rolled back to the state it started in when the block ends.

    Raises
    ------
    ValueError
        The rollback failed (an engine bug; the step fails).
    """
    cursor = DraftCursor(matcher)
    try:
        yield cursor
    finally:
        cursor.rollback()

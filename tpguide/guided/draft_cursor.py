"""The rollback discipline of drafts: a matcher advanced through unverified tokens is back where it started.

docs/architecture.md §5.  Between steps a matcher holds exactly the verified
tokens of its request.  Whatever advances it through tokens that are *not*
verified (the verify fill, n-gram drafts, grammar drafts, the draft head's
masks) does so through a :class:`DraftCursor` inside :func:`drafting`, and
the matcher is back where it started when the block ends, whatever happened
inside.  vLLM's structured-output manager does the same (fill, accept, roll
back at once).
"""

from __future__ import annotations

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

    def __enter__(self) -> "DraftCursor":
        return self

    def __exit__(self, *exc_info) -> None:
        self.rollback()  # whatever happened in the block


def drafting(matcher: GrammarMatcher) -> DraftCursor:
    """A :class:`DraftCursor` on ``matcher``, rolled back to the state it started in when the ``with`` block ends.

    The cursor is its own context manager (entered for every guided row of
    every step: a generator-based one costs a few microseconds more).

    Raises
    ------
    ValueError
        The rollback failed (an engine bug; the step fails).
    """
    return DraftCursor(matcher)

"""The matchers of speculative decoding, asked about drafts under one rollback discipline (docs/architecture.md §5).

**The discipline.**  Between steps a matcher holds exactly the verified
tokens of its request.  Whatever advances it through tokens that are *not*
verified does so through a :class:`DraftCursor` inside :func:`drafting`,
and the matcher is back where it started when the block ends, whatever
happened inside.  The tokens the target model verifies are then accepted
by the one path every output token takes
(:class:`tpguide.engine.finisher.StepFinisher`), so nothing is rolled back
after verification and no counter has to say how far.  vLLM's
structured-output manager does the same (fill, accept, roll back at once).
Every drafter and the fill follow it:

* the bitmask fill of a verify pass (:meth:`SpeculativeGuidedDecoder.fill_bitmask_with_drafts`),
  ``1 + k`` consecutive rows per request::

      row 0   state after the verified tokens          (fill)
      row j   state after d_1 .. d_j                   (accept d_j, fill)
              stop at the first draft the grammar rejects, at a stop token
              or at a dead end: the later rows are unguided
      then    roll the matcher back at once

  Rows past the last filled one are unguided: the target can never reach
  them as its bonus row, because row ``m`` forbids ``d_{m+1}`` (or the
  request stopped at ``d_m``);
* the drafts a grammar accepts (:meth:`~SpeculativeGuidedDecoder.accepted_prefix`: n-gram drafts);
* the grammar drafter's forced tokens (:mod:`tpguide.speculative.grammar_draft`);
* the draft head's masks (:meth:`~SpeculativeGuidedDecoder.fill_draft_bitmask`,
  one full row per drafting request from its state after ``d_1 .. d_j``,
  with a cursor per request for the whole drafting loop;
  :mod:`tpguide.speculative.draft_loop`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from tpguide.guided.bitmask import find_dead_end_rows
from tpguide.guided.decoder import GuidedDecoder
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


class SpeculativeGuidedDecoder(GuidedDecoder):
    """Guided decoder that fills verify rows and answers drafters; the matchers hold verified tokens only.

    Parameters are those of :class:`GuidedDecoder`; size ``max_num_rows`` as
    ``max_num_seqs * (num_speculative_tokens + 1)``.
    """

    @contextlib.contextmanager
    def drafting(self, slot: int) -> Iterator[DraftCursor]:
        """A cursor on ``slot``'s matcher, rolled back when the block ends (:func:`drafting`).

        Raises
        ------
        KeyError
            ``slot`` is not guided.
        ValueError
            The rollback failed (an engine bug).
        """
        with drafting(self._matchers[slot]) as cursor:
            yield cursor

    def accepted_prefix(self, slot: int, drafts: Sequence[int]) -> List[int]:
        """The longest prefix of ``drafts`` the grammar accepts from ``slot``'s state, ending at a stop token.

        The matcher is unchanged afterwards; an unguided slot accepts every draft.
        """
        if not self.is_guided(slot):
            return list(drafts)
        accepted: List[int] = []
        with self.drafting(slot) as cursor:
            for token in drafts:
                if not cursor.accept(token):
                    break
                accepted.append(int(token))
                if cursor.matcher.is_terminated():
                    break
        return accepted

    def fill_bitmask_with_drafts(
        self, entries: Sequence[Tuple[Optional[int], Sequence[int]]]
    ) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
        """Fill ``1 + len(drafts)`` rows per entry (fill, accept, roll back at once).

        Parameters
        ----------
        entries : sequence of (slot or None, drafts)
            One per scheduled request, in sample-row order; ``slot`` None (or
            unguided) gives all-ones rows with ``token_mask`` 0.

        Returns
        -------
        token_bitmask : torch.Tensor
            int32 ``[num_rows, bitmask_size]``, CPU, ``num_rows = sum(1 + k)``
            (a view of the reused buffer).
        token_mask : torch.Tensor
            int32 ``[num_rows]``; 1 on rows filled with a grammar mask.
        dead_rows : list of int
            Rows ``0`` of requests whose current state is a dead end or whose
            matcher raised (the engine fails those requests).  A dead end after a
            draft only ends guidance for the rest of the window.

        Raises
        ------
        ValueError
            More than ``max_num_rows`` rows; a matcher that cannot roll its drafts back.
        """
        num_rows = sum(1 + len(d) for _, d in entries)
        token_bitmask, token_mask = self._reset_rows(num_rows)
        jobs, row = [], 0
        for slot, drafts in entries:
            if slot is not None and self.is_guided(slot):
                jobs.append((slot, list(drafts), row))
            row += 1 + len(drafts)

        def fill(job: tuple) -> tuple:
            slot, drafts, first = job
            return slot, first, self._fill_slot(slot, drafts, token_bitmask, token_mask, first)

        dead_rows: List[int] = []
        for slot, first, error in self._map(fill, jobs, num_rows):
            if error is not None:
                self._failures[slot] = error
                token_bitmask[first] = -1
                token_mask[first] = 0
                dead_rows.append(first)
        return token_bitmask, token_mask, sorted(dead_rows)

    def _fill_slot(self, slot: int, drafts: List[int], token_bitmask: torch.Tensor,
                   token_mask: torch.Tensor, first: int) -> Optional[str]:
        """Fill rows ``first .. first + len(drafts)`` of ``slot``; the error message of row 0, else None."""
        with self.drafting(slot) as cursor:
            matcher = cursor.matcher
            for j in range(len(drafts) + 1):
                row = first + j
                if j > 0 and (not cursor.accept(drafts[j - 1]) or matcher.is_terminated()):
                    return None  # a rejected draft, or a stop token drafted: the request ends there if accepted
                try:
                    matcher.fill_next_token_bitmask(token_bitmask, row)
                except Exception as exc:
                    token_bitmask[row] = -1
                    return f"slot {slot}: matcher error while filling the bitmask: {exc}" if j == 0 else None
                token_mask[row] = 1
                if bool(find_dead_end_rows(token_bitmask[row : row + 1], self.padded_vocab_size)[0]):
                    token_mask[row] = 0
                    token_bitmask[row] = -1
                    if j == 0:
                        return (f"slot {slot}: grammar dead end, no allowed token below "
                                f"padded_vocab_size={self.padded_vocab_size}")
                    return None
        return None

    def fill_draft_bitmask(self, slots: Sequence[Optional[int]]) -> Tuple[torch.Tensor, torch.Tensor]:
        """One full row per drafting request from its matcher's current state (draft head).

        Parameters
        ----------
        slots : sequence of int or None
            Row ``i`` belongs to ``slots[i]``; None or unguided: all ones,
            ``token_mask`` 0.

        Returns
        -------
        token_bitmask : torch.Tensor
            int32 ``[len(slots), bitmask_size]``, CPU (a view of the reused
            buffer: broadcast it before the next fill).  A row whose matcher
            is terminated, dead or raised allows **nothing** (``token_mask`` 1),
            so the drafter proposes no token there and the request stops
            drafting; nothing is recorded as a failure (verification decides).
        token_mask : torch.Tensor
            int32 ``[len(slots)]``.
        """
        token_bitmask, token_mask = self._reset_rows(len(slots))
        for row, slot in enumerate(slots):
            if slot is None or not self.is_guided(slot):
                continue
            token_mask[row] = 1
            matcher = self._matchers[slot]
            try:
                if matcher.is_terminated():
                    raise RuntimeError("terminated")
                matcher.fill_next_token_bitmask(token_bitmask, row)
            except Exception:  # noqa: BLE001 - no draft for this row; verification reports errors
                token_bitmask[row] = 0
        return token_bitmask, token_mask

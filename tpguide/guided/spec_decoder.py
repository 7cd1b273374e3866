"""``SpeculativeGuidedDecoder``: bitmask rows for draft-token verification (docs/architecture.md §5).

A :class:`~tpguide.guided.bitmask.GuidedDecoder` whose fill takes, per
scheduled request, the drafts it verifies this step and fills ``1 + k``
consecutive rows by advancing the matcher through the drafts (see
:mod:`tpguide.guided.spec_counters` for the row layout and the rollback
formula).  Rows are filled on one thread, request by request: row ``j`` of a
request needs the matcher state after ``d_1 .. d_j``.

A model drafter (``draft-head``) drafts under the grammar too: before each
drafting iteration :meth:`fill_draft_bitmask` fills one full row per drafting
request from the matcher state after ``golden d_1 .. d_j``,
:meth:`advance_draft` moves the matcher by the new draft, and at the end of
the drafting loop :meth:`rollback_drafts` undoes them all (draft-side
rollback), so verification starts from the state after ``golden`` again.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from tpguide.guided.bitmask import find_dead_end_rows
from tpguide.guided.decoder import GuidedDecoder
from tpguide.guided.params import StructuredOutputsParams
from tpguide.guided.spec_counters import SlotCounters


class SpeculativeGuidedDecoder(GuidedDecoder):
    """Guided decoder with per-slot speculative counters.

    Parameters are those of :class:`GuidedDecoder`; size ``max_num_rows`` as
    ``max_num_seqs * (num_speculative_tokens + 1)``.

    Attributes
    ----------
    counters : dict of int to SlotCounters
        Per guided slot, reset by :meth:`add_request` and :meth:`begin_step`.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.counters: Dict[int, SlotCounters] = {}

    def add_request(self, slot: int, params: Optional[StructuredOutputsParams]) -> None:
        super().add_request(slot, params)
        if self.is_guided(slot):
            self.counters[slot] = SlotCounters()

    def remove_request(self, slot: int) -> None:
        super().remove_request(slot)
        self.counters.pop(slot, None)

    def accept_token(self, slot: int, token_id: int) -> bool:
        """Accept a *verified* token (the golden one); it opens the slot's next window.

        Drafts are advanced inside :meth:`fill_bitmask_with_drafts`, never here.
        """
        ok = super().accept_token(slot, token_id)
        if ok:
            self.begin_step(slot)
        return ok

    def begin_step(self, slot: int) -> None:
        """The slot's golden token (last sampled) was accepted: start a new window."""
        if slot in self.counters:
            self.counters[slot].begin_step()

    def rollback_rejected(self, slot: int, num_accepted_by_target: int) -> int:
        """Roll ``slot``'s matcher back to the state after the accepted drafts.

        Returns
        -------
        int
            Drafts that count for the grammar (``accepted`` of the formula).

        Raises
        ------
        SpecAccountingError
            Negative rollback (an engine bug; see :mod:`tpguide.guided.spec_counters`).
        ValueError
            The matcher raised.
        """
        c = self.counters.get(slot)
        if c is None:
            return num_accepted_by_target
        n = c.rollback_count(num_accepted_by_target)
        self.rollback(slot, n)
        accepted = c.accepted_drafts(num_accepted_by_target)
        c.num_advanced_tokens -= n
        c.num_advanced_draft_tokens -= n
        return accepted

    def fill_bitmask_with_drafts(
        self, entries: Sequence[Tuple[Optional[int], Sequence[int]]]
    ) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
        """Fill ``1 + len(drafts)`` rows per entry, advancing matchers through the drafts.

        Parameters
        ----------
        entries : sequence of (slot or None, drafts)
            One per scheduled request, in sample-row order; ``slot`` None (or
            unguided) gives all-ones rows with ``token_mask`` 0.

        Returns
        -------
        token_bitmask : torch.Tensor
            int32 ``[num_rows, bitmask_size]``, CPU, ``num_rows = sum(1 + k)``.
        token_mask : torch.Tensor
            int32 ``[num_rows]``; 1 on rows filled with a grammar mask.
        dead_rows : list of int
            Rows ``0`` of requests whose current state is a dead end or whose
            matcher raised (the engine fails those requests).  A dead end after a
            draft only ends guidance for the rest of the window.

        Raises
        ------
        ValueError
            More than ``max_num_rows`` rows.
        """
        token_bitmask, token_mask = self._reset_rows(sum(1 + len(d) for _, d in entries))
        dead_rows: List[int] = []
        row = 0
        for slot, drafts in entries:
            first = row
            row += 1 + len(drafts)
            if slot is None or not self.is_guided(slot):
                continue
            error = self._fill_slot(slot, list(drafts), token_bitmask, token_mask, first)
            if error is not None:
                self._failures[slot] = error
                token_bitmask[first] = -1
                token_mask[first] = 0
                dead_rows.append(first)
        return token_bitmask, token_mask, dead_rows

    def _fill_slot(self, slot: int, drafts: List[int], token_bitmask: torch.Tensor,
                   token_mask: torch.Tensor, first: int) -> Optional[str]:
        """Fill rows ``first .. first + len(drafts)`` of ``slot``; error message of row 0, else None."""
        matcher = self._matchers[slot]
        c = self.counters[slot]
        c.num_guided_tokens = 0
        for j in range(len(drafts) + 1):
            row = first + j
            if j > 0:
                try:
                    ok = matcher.accept_token(drafts[j - 1])
                except Exception:  # a draft that breaks the matcher only ends guidance
                    ok = False
                if not ok:
                    c.is_draft_terminated = True
                    return None
                c.advance_draft()
                if matcher.is_terminated():  # a stop token drafted: the request ends here if accepted
                    c.is_draft_terminated = c.matcher_terminated = True
                    return None
            try:
                matcher.fill_next_token_bitmask(token_bitmask, row)
            except Exception as exc:
                if j == 0:
                    return f"slot {slot}: matcher error while filling the bitmask: {exc}"
                c.is_draft_terminated = True
                token_bitmask[row] = -1
                return None
            token_mask[row] = 1
            dead = find_dead_end_rows(token_bitmask[row : row + 1], self.padded_vocab_size, token_mask[row : row + 1])
            if bool(dead[0]):
                token_mask[row] = 0
                token_bitmask[row] = -1
                if j == 0:
                    return (f"slot {slot}: grammar dead end, no allowed token below "
                            f"padded_vocab_size={self.padded_vocab_size}")
                c.is_draft_terminated = True
                return None
            c.num_guided_tokens += 1
        return None

    # ---- drafting under the grammar (draft-head) ---------------------------------

    def fill_draft_bitmask(self, slots: Sequence[Optional[int]]) -> Tuple[torch.Tensor, torch.Tensor]:
        """One full row per drafting request from its matcher's current state.

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

    def advance_draft(self, slot: int, token_id: int) -> bool:
        """Advance ``slot``'s matcher by a drafted token (not counted as verified).

        Returns
        -------
        bool
            False if the matcher rejected or raised (the token was not taken:
            drafting of that request must stop); True for an unguided slot.
        """
        matcher = self._matchers.get(slot)
        if matcher is None:
            return True
        try:
            return bool(matcher.accept_token(token_id))
        except Exception:  # noqa: BLE001 - a draft never fails a request
            return False

    def rollback_drafts(self, slot: int, num_tokens: int) -> None:
        """Undo ``num_tokens`` drafts taken by :meth:`advance_draft` (end of the drafting loop).

        Raises
        ------
        ValueError
            The matcher cannot roll back that far, or raised.
        """
        if num_tokens:
            self.rollback(slot, num_tokens)

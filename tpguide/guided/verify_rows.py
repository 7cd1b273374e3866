"""The rows of one request's verify window: thinking rows up to ``</think>``, then its grammar's rows (driver only).

docs/architecture.md §5, docs/reasoning.md.  ``1 + k`` consecutive rows per
request (``k`` drafts, 0 in a plain step), under the rollback discipline of
:mod:`tpguide.guided.draft_cursor`::

    row 0   state after the verified tokens          (fill)
    row j   state after d_1 .. d_j                   (accept d_j, fill)
            stop at the first draft its row forbids, at a stop token
            or at a dead end: the later rows are unguided
    then    roll the matcher back at once

While the request thinks, its rows are thinking rows
(:mod:`tpguide.guided.thinking`) and the drafts walk a copy of its thinking
state; after a drafted ``</think>`` the drafts go to the matcher and the
rows are the grammar's.  Rows past the last filled one are unguided: the
target can never reach them as its bonus row, because row ``m`` forbids
``d_{m+1}`` (or the request stopped at ``d_m``).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch

from tpguide.guided.bitmask import row_is_dead_end
from tpguide.guided.draft_cursor import drafting
from tpguide.guided.slot_record import GuideFailure, SlotRecord
from tpguide.guided.thinking import ThinkingRows


def record_cursor(record: SlotRecord):
    """A cursor on ``record``'s matcher (rolled back when the block ends); None inside for an unguided record."""
    return drafting(record.matcher) if record.matcher is not None else contextlib.nullcontext()


def fill_window_rows(record: SlotRecord, slot: int, drafts: List[int], token_bitmask: torch.Tensor,
                     token_mask: torch.Tensor, first: int, thinking_rows: Dict[int, ThinkingRows],
                     padded_vocab_size: int) -> Optional[Tuple[GuideFailure, str]]:
    """Fill rows ``first .. first + len(drafts)`` of the request in ``slot``; row 0's failure, else None.

    Parameters
    ----------
    record : SlotRecord
        The request's state (unchanged afterwards).
    drafts : list of int
        ``d_1 .. d_k``.
    token_bitmask : torch.Tensor
        int32 ``[num_rows, bitmask_size]``, CPU, all ones on the request's rows on entry; written in place.
    token_mask : torch.Tensor
        int32 ``[num_rows]``, 0 on entry; 1 written on each masked row.
    thinking_rows : dict of int to ThinkingRows
        By ``</think>`` id.
    padded_vocab_size : int
        The dead-end check's width.

    Returns
    -------
    (GuideFailure, str) or None
        Why row 0 failed, its kind and message (a dead end, or a matcher
        that raised): the request fails.  A later row that fails only ends guidance for the rest of the window.

    Raises
    ------
    ValueError
        The matcher cannot roll its drafts back (an engine bug).
    """
    walk = record.thinking.walk() if record.is_thinking else None
    rows = thinking_rows.get(walk.end_token_id) if walk is not None else None
    words, masked = token_bitmask.numpy(), token_mask.numpy()  # views: a row's check and flag cost microseconds
    with record_cursor(record) as cursor:
        for j in range(len(drafts) + 1):
            row = first + j
            if j > 0 and walk is not None and not walk.ended:
                if not walk.allows(drafts[j - 1], rows.stop_token_ids, guided=cursor is not None):
                    return None
                walk.advance(drafts[j - 1])
            elif j > 0 and (cursor is None or not cursor.accept(drafts[j - 1]) or cursor.matcher.is_terminated()):
                return None  # a rejected draft, or a stop token drafted: the request ends there if accepted
            if walk is not None and not walk.ended:
                masked[row] = rows.fill(token_bitmask, row, walk, guided=cursor is not None)
                continue
            if cursor is None:
                return None  # an unguided answer
            try:
                cursor.matcher.fill_next_token_bitmask(token_bitmask, row)
            except Exception as exc:
                token_bitmask[row] = -1
                if j == 0:
                    return GuideFailure.MATCHER_ERROR, f"slot {slot}: matcher error while filling the bitmask: {exc}"
                return None
            if row_is_dead_end(words, row, padded_vocab_size):
                token_bitmask[row] = -1
                if j == 0:
                    return GuideFailure.DEAD_END, (f"slot {slot}: grammar dead end, no allowed token below "
                                                   f"padded_vocab_size={padded_vocab_size}")
                return None
            masked[row] = 1
    return None

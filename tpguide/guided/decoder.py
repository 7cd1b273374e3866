"""The matchers of the guided slots, one record per slot, filling ``1 + k`` bitmask rows per request (driver only).

docs/architecture.md §5.  The plain step is the speculative one with no
drafts.  A request that thinks (docs/reasoning.md) gets its thinking rows
from :mod:`tpguide.guided.thinking` until ``</think>``, also inside a
verify window, and grammar rows from the next row on.  Each step the engine (on the driver, tp_rank 0)::

    token_bitmask, token_mask, dead_rows = decoder.fill_bitmask_with_drafts(entries)
    fail requests of dead_rows (decoder.failure_kind(slot), failure_reason(slot)); split_bitmask; scatter
    decoder.accept_token(slot, token)      # each verified output token (engine/finisher.py)

The verify fill gives ``1 + k`` consecutive rows per request (``k``
drafts, 0 in a plain step): :mod:`tpguide.guided.verify_rows`.  The
drafters ask through :meth:`GuidedDecoder.drafting` (grammar drafts, :mod:`tpguide.speculative.grammar_draft`),
:meth:`~GuidedDecoder.accepted_prefix` (n-gram drafts) and
:meth:`~GuidedDecoder.fill_draft_bitmask` (the draft head,
:mod:`tpguide.speculative.draft_loop`).

A slot is the engine's batch slot, reused by later requests:
:meth:`GuidedDecoder.add_request` always starts a fresh
:class:`~tpguide.guided.slot_record.SlotRecord`.  Compiled grammars are
shared through the backend's cache.  Requests are filled in a thread pool
when more than ``parallel_threshold`` rows are filled (both backends release
the GIL while filling); one row costs tens of microseconds, so the default
threshold is 32 rows: the pool is for big batches and costly grammars on
many-core drivers.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional, Sequence, Tuple

import torch

from tpguide.guided.bitmask import allocate_token_bitmask
from tpguide.guided.draft_cursor import DraftCursor, drafting
from tpguide.guided.matcher import GuidedBackend
from tpguide.guided.params import StructuredOutputsParams
from tpguide.guided.slot_record import GuideFailure, SlotRecord
from tpguide.guided.thinking import Thinking, ThinkingRows
from tpguide.guided.verify_rows import fill_window_rows, record_cursor


class GuidedDecoder:
    """The guided slots' records and the bitmask they fill.

    Parameters
    ----------
    backend : GuidedBackend
        Built for ``padded_vocab_size`` (see :func:`tpguide.guided.make_backend`).
    padded_vocab_size : int
        Bitmask width in tokens.
    max_num_rows : int
        Most rows one fill may ask for: ``max_num_seqs * (1 + num_speculative_tokens)``.
    num_threads : int, optional
        Fill threads; default ``min(8, os.cpu_count())``.  1 disables the pool.
    parallel_threshold : int
        Use the pool when more rows than this are filled (default 32).
    pin_memory : bool
        Allocate the returned bitmask in page-locked memory.

    Raises
    ------
    ValueError
        ``padded_vocab_size`` differs from the backend's, or a size is not positive.
    """

    def __init__(
        self,
        backend: GuidedBackend,
        padded_vocab_size: int,
        max_num_rows: int,
        *,
        num_threads: Optional[int] = None,
        parallel_threshold: int = 32,
        pin_memory: bool = False,
    ) -> None:
        if padded_vocab_size != backend.padded_vocab_size:
            raise ValueError(
                f"padded_vocab_size={padded_vocab_size} != backend.padded_vocab_size="
                f"{backend.padded_vocab_size}"
            )
        if max_num_rows < 1:
            raise ValueError(f"max_num_rows must be >= 1, got {max_num_rows}")
        self.backend = backend
        self.padded_vocab_size = padded_vocab_size
        self.max_num_rows = max_num_rows
        self.num_threads = num_threads or min(8, os.cpu_count() or 1)
        self.parallel_threshold = parallel_threshold
        self._token_bitmask = allocate_token_bitmask(max_num_rows, padded_vocab_size, pin_memory=pin_memory)
        self._token_mask = torch.zeros(max_num_rows, dtype=torch.int32, pin_memory=pin_memory)
        self._records: dict[int, SlotRecord] = {}
        self._thinking_rows: dict[int, ThinkingRows] = {}  # by end token id
        self._pool: Optional[ThreadPoolExecutor] = None

    # ---- slots -----------------------------------------------------------------

    def add_request(self, slot: int, params: Optional[StructuredOutputsParams],
                    thinking: Optional[Thinking] = None, compiled: Any = None) -> None:
        """Start ``slot``'s request from its grammar's initial state (``None``: unguided).

        ``thinking``: the request starts thinking (docs/reasoning.md); its
        grammar applies after ``</think>``.  An unguided request gets a
        record only with ``thinking`` (its budget's rows).  ``compiled``: the
        guide as admission returned it (:func:`~tpguide.guided.admission.admit`);
        None: ``backend.compile(params)`` (its cache; ``auto`` holds admitted guides only).

        Raises
        ------
        ValueError
            The guide does not compile (message names the slot and the backend's reason);
            the slot is then unguided.
        """
        self.remove_request(slot)
        if params is None and thinking is None:
            return
        matcher = None
        if params is not None:
            try:
                matcher = self.backend.matcher(compiled if compiled is not None else self.backend.compile(params))
            except Exception as exc:
                raise ValueError(f"slot {slot}: {exc}") from exc
        if thinking is not None and thinking.end_token_id not in self._thinking_rows:
            self._thinking_rows[thinking.end_token_id] = ThinkingRows(
                self.padded_vocab_size, self.backend.stop_token_ids, thinking.end_token_id)
        self._records[slot] = SlotRecord(matcher, thinking=thinking)

    def remove_request(self, slot: int) -> None:
        """Forget ``slot``'s record; no-op for an unguided slot."""
        self._records.pop(slot, None)

    def record(self, slot: int) -> Optional[SlotRecord]:
        """``slot``'s record, None for an unguided slot."""
        return self._records.get(slot)

    def is_guided(self, slot: int) -> bool:
        """``slot`` holds a request with a grammar (it may still be thinking)."""
        record = self._records.get(slot)
        return record is not None and record.matcher is not None

    def failure_reason(self, slot: int) -> Optional[str]:
        """Why ``slot``'s request failed (dead end, rejected token, matcher error), else None."""
        record = self._records.get(slot)
        return record.failure if record is not None else None

    def failure_kind(self, slot: int) -> Optional[GuideFailure]:
        """The kind of ``slot``'s request's failure (:class:`GuideFailure`), else None."""
        record = self._records.get(slot)
        return record.failure_kind if record is not None else None

    # ---- verified tokens ---------------------------------------------------------

    def accept_token(self, slot: int, token_id: int) -> bool:
        """Advance ``slot``'s record by a verified token (its thinking, else its matcher); True for an unguided slot.

        Returns
        -------
        bool
            False: the grammar rejected the token (the engine fails that request;
            :meth:`failure_reason` says why).

        Raises
        ------
        ValueError
            The matcher raised; the message names the slot.
        """
        record = self._records.get(slot)
        if record is not None and record.is_thinking:
            record.thinking.accept(token_id)
            return True
        if record is None or record.matcher is None:
            return True
        try:
            ok = record.matcher.accept_token(token_id)
        except Exception as exc:
            record.fail(GuideFailure.MATCHER_ERROR, f"slot {slot}: matcher error on token {token_id}: {exc}")
            raise ValueError(record.failure) from exc
        if not ok:
            record.fail(GuideFailure.REJECTED_TOKEN, f"slot {slot}: grammar rejected token {token_id}")
        return ok

    def rollback(self, slot: int, num_tokens: int) -> None:
        """Undo ``slot``'s last ``num_tokens`` accepted tokens.

        Raises
        ------
        ValueError
            ``num_tokens`` negative or more than accepted, or the matcher raised.
        """
        record = self._records.get(slot)
        if record is None or record.matcher is None:
            return
        try:
            record.matcher.rollback(num_tokens)
        except Exception as exc:
            raise ValueError(f"slot {slot}: {exc}") from exc

    def is_terminated(self, slot: int) -> bool:
        """True once ``slot``'s answer's matcher accepted a stop token; False for unguided slots."""
        record = self._records.get(slot)
        return (record is not None and record.matcher is not None and not record.is_thinking
                and record.matcher.is_terminated())

    # ---- drafts ------------------------------------------------------------------

    def drafting(self, slot: int) -> DraftCursor:
        """A cursor on ``slot``'s matcher, rolled back when its ``with`` block ends (:func:`~tpguide.guided.draft_cursor.drafting`).

        Raises
        ------
        KeyError
            ``slot`` is not guided.
        ValueError
            The rollback failed, at the block's end (an engine bug).
        """
        return drafting(self._records[slot].matcher)

    def accepted_prefix(self, slot: int, drafts: Sequence[int]) -> List[int]:
        """The longest prefix of ``drafts`` the rows allow from ``slot``'s state, ending at a stop token.

        Thinking drafts pass the thinking rows (:mod:`tpguide.guided.thinking`),
        the drafts after a drafted ``</think>`` the grammar.  The record is
        unchanged afterwards; a slot without a record accepts every draft.
        """
        record = self._records.get(slot)
        if record is None:
            return list(drafts)
        accepted: List[int] = []
        walk = record.thinking.walk() if record.is_thinking else None
        rows = self._thinking_rows.get(walk.end_token_id) if walk is not None else None
        with record_cursor(record) as cursor:
            for token in drafts:
                if walk is not None and not walk.ended:
                    if not walk.allows(token, rows.stop_token_ids, guided=cursor is not None):
                        break
                    walk.advance(token)
                elif cursor is not None:
                    if not cursor.accept(token):
                        break
                    if cursor.matcher.is_terminated():
                        accepted.append(int(token))
                        break
                accepted.append(int(token))
        return accepted

    # ---- the fill ----------------------------------------------------------------

    def fill_bitmask(self, slots: Sequence[Optional[int]]) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
        """One row per entry of ``slots``: :meth:`fill_bitmask_with_drafts` with no drafts."""
        return self.fill_bitmask_with_drafts([(slot, ()) for slot in slots])

    def fill_bitmask_with_drafts(
        self, entries: Sequence[Tuple[Optional[int], Sequence[int]]]
    ) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
        """Fill ``1 + len(drafts)`` rows per entry (fill, accept, roll back at once: the module docstring).

        Parameters
        ----------
        entries : sequence of (slot or None, drafts)
            One per scheduled request, in sample-row order; ``slot`` None (or
            unguided) gives all-ones rows with ``token_mask`` 0.

        Returns
        -------
        token_bitmask : torch.Tensor
            int32 ``[num_rows, bitmask_size]``, CPU, ``num_rows = sum(1 + k)``.
            A terminated matcher's row allows only the stop tokens.
        token_mask : torch.Tensor
            int32 ``[num_rows]``; 1 on rows filled with a grammar mask.
        dead_rows : list of int
            Rows ``0`` of requests whose current state is a dead end (no
            allowed token below ``padded_vocab_size``, checked on full rows)
            or whose matcher raised; they are returned reset to all ones with
            ``token_mask`` 0, so no all ``-inf`` row reaches softmax, and the
            engine fails those requests (:meth:`failure_reason`).  A dead end
            after a draft only ends guidance for the rest of the window.

        Both tensors are views of buffers reused by the next call: scatter or
        copy them before calling again.

        Raises
        ------
        ValueError
            More than ``max_num_rows`` rows; a matcher that cannot roll its drafts back.
        """
        num_rows = sum(1 + len(d) for _, d in entries)
        token_bitmask, token_mask = self._reset_rows(num_rows)
        jobs, row = [], 0
        for slot, drafts in entries:
            if slot is not None and slot in self._records:
                jobs.append((slot, list(drafts), row))
            row += 1 + len(drafts)

        dead_rows: List[int] = []
        for slot, first, failure in self._fill_windows(jobs, token_bitmask, token_mask, num_rows):
            if failure is not None:
                self._records[slot].fail(*failure)
                token_bitmask[first] = -1
                token_mask[first] = 0
                dead_rows.append(first)
        return token_bitmask, token_mask, sorted(dead_rows)

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
            record = self._records.get(slot) if slot is not None else None
            if record is None or record.matcher is None or record.is_thinking:
                continue
            token_mask[row] = 1
            try:
                if record.matcher.is_terminated():
                    raise RuntimeError("terminated")
                record.matcher.fill_next_token_bitmask(token_bitmask, row)
            except Exception:  # noqa: BLE001 - no draft for this row; verification reports errors
                token_bitmask[row] = 0
        return token_bitmask, token_mask

    def _reset_rows(self, num_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The first ``num_rows`` rows of the reused buffers, all allowed and unguided.

        Raises
        ------
        ValueError
            More than ``max_num_rows`` rows.
        """
        if num_rows > self.max_num_rows:
            raise ValueError(f"{num_rows} rows requested, max_num_rows={self.max_num_rows}")
        token_bitmask = self._token_bitmask[:num_rows]
        token_mask = self._token_mask[:num_rows]
        token_bitmask.fill_(-1)
        token_mask.zero_()
        return token_bitmask, token_mask

    def _fill_windows(self, jobs: list, token_bitmask: torch.Tensor, token_mask: torch.Tensor,
                      num_rows: int) -> list:
        """``(slot, first row, failure)`` of each ``(slot, drafts, first row)`` job's window rows.

        In the fill threads when more than ``parallel_threshold`` rows are
        filled: each job touches its own matchers and rows only; results come
        back in no particular order.
        """
        if self.num_threads <= 1 or num_rows <= self.parallel_threshold:
            return self._fill_chunk(jobs, token_bitmask, token_mask)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="tpguide-bitmask")
        chunks = [jobs[i :: self.num_threads] for i in range(self.num_threads)]
        futures = [self._pool.submit(self._fill_chunk, chunk, token_bitmask, token_mask) for chunk in chunks]
        return [r for future in futures for r in future.result()]

    def _fill_chunk(self, jobs: list, token_bitmask: torch.Tensor, token_mask: torch.Tensor) -> list:
        """:meth:`_fill_windows` of ``jobs``, one after the other."""
        results = []
        for slot, drafts, first in jobs:
            failure = fill_window_rows(self._records[slot], slot, drafts, token_bitmask, token_mask, first,
                                       self._thinking_rows, self.padded_vocab_size)
            results.append((slot, first, failure))
        return results

    def close(self) -> None:
        """Stop the fill threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

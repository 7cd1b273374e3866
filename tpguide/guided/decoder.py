"""The matchers of the guided slots: one fresh matcher per slot, filling the bitmask rows (driver only).

docs/architecture.md §5.  Each step the engine (on the driver, tp_rank 0)::

    decoder.accept_token(slot, last_token)           # advance by last step's token
    token_bitmask, token_mask, dead_rows = decoder.fill_bitmask(slots)
    fail requests of dead_rows (decoder.failure_reason(slot)); split_bitmask; scatter

Row ``i`` belongs to ``slots[i]``.  A slot is the engine's batch slot, reused
by later requests: :meth:`GuidedDecoder.add_request` always starts from a
fresh matcher, so a request never sees a previous request's grammar state.
Compiled grammars are shared through the backend's cache.

Rows are filled in a thread pool when more than ``parallel_threshold`` rows
are guided (both backends release the GIL while filling).  One row costs tens
of microseconds, so the default threshold is 32 rows: the pool is for big
batches and costly grammars on many-core drivers.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import torch

from tpguide.guided.bitmask import allocate_token_bitmask, find_dead_end_rows
from tpguide.guided.matcher import GrammarMatcher, GuidedBackend
from tpguide.guided.params import StructuredOutputsParams


class GuidedDecoder:
    """Matchers of the guided slots and the bitmask they fill.

    Parameters
    ----------
    backend : GuidedBackend
        Built for ``padded_vocab_size`` (see :func:`tpguide.guided.make_backend`).
    padded_vocab_size : int
        Bitmask width in tokens.
    max_num_rows : int
        Most rows one :meth:`fill_bitmask` call may ask for.
    num_threads : int, optional
        Fill threads; default ``min(8, os.cpu_count())``.  1 disables the pool.
    parallel_threshold : int
        Use the pool when more rows than this are guided (default 32).
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
        self._matchers: dict[int, GrammarMatcher] = {}
        self._failures: dict[int, str] = {}
        self._pool: Optional[ThreadPoolExecutor] = None

    # ---- slots -----------------------------------------------------------------

    def add_request(self, slot: int, params: Optional[StructuredOutputsParams]) -> None:
        """Start ``slot``'s request from its grammar's initial state (``None``: unguided).

        Raises
        ------
        ValueError
            The guide does not compile (message names the slot and the backend's reason);
            the slot is then unguided.
        """
        self.remove_request(slot)
        if params is None:
            return
        try:
            matcher = self.backend.matcher(self.backend.compile(params))
        except Exception as exc:
            raise ValueError(f"slot {slot}: {exc}") from exc
        self._matchers[slot] = matcher

    def remove_request(self, slot: int) -> None:
        """Forget ``slot``'s matcher and failure; no-op for an unguided slot."""
        self._matchers.pop(slot, None)
        self._failures.pop(slot, None)

    def is_guided(self, slot: int) -> bool:
        return slot in self._matchers

    def failure_reason(self, slot: int) -> Optional[str]:
        """Why ``slot``'s request failed (dead end, rejected token, matcher error), else None."""
        return self._failures.get(slot)

    # ---- per step --------------------------------------------------------------

    def accept_token(self, slot: int, token_id: int) -> bool:
        """Advance ``slot``'s matcher by ``token_id``; True for an unguided slot.

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
        matcher = self._matchers.get(slot)
        if matcher is None:
            return True
        try:
            ok = matcher.accept_token(token_id)
        except Exception as exc:
            self._failures[slot] = f"slot {slot}: matcher error on token {token_id}: {exc}"
            raise ValueError(self._failures[slot]) from exc
        if not ok:
            self._failures[slot] = f"slot {slot}: grammar rejected token {token_id}"
        return ok

    def rollback(self, slot: int, num_tokens: int) -> None:
        """Undo ``slot``'s last ``num_tokens`` accepted tokens (speculative decoding).

        Raises
        ------
        ValueError
            ``num_tokens`` negative or more than accepted, or the matcher raised.
        """
        matcher = self._matchers.get(slot)
        if matcher is None:
            return
        try:
            matcher.rollback(num_tokens)
        except Exception as exc:
            raise ValueError(f"slot {slot}: {exc}") from exc

    def is_terminated(self, slot: int) -> bool:
        """True once ``slot``'s matcher accepted a stop token; False for unguided slots."""
        matcher = self._matchers.get(slot)
        return matcher is not None and matcher.is_terminated()

    def _reset_rows(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
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

    def fill_bitmask(self, slots: Sequence[Optional[int]]) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Fill one bitmask row per entry of ``slots``.

        Parameters
        ----------
        slots : sequence of int or None
            ``slots[i]`` owns row ``i``; ``None`` or an unguided slot gives an
            all-ones row with ``token_mask`` 0.

        Returns
        -------
        token_bitmask : torch.Tensor
            int32 ``[len(slots), bitmask_size]``, CPU.  A terminated matcher's row
            allows only the stop tokens.
        token_mask : torch.Tensor
            int32 ``[len(slots)]``, 1 for guided rows.
        dead_rows : list of int
            Guided rows with no allowed token below ``padded_vocab_size`` (checked
            on full rows) or whose matcher raised.  These rows are returned reset
            to all ones with ``token_mask`` 0, so no all ``-inf`` row reaches
            softmax; the engine fails their requests (:meth:`failure_reason`)
            and discards what they sample.

        Both tensors are views of buffers reused by the next call: scatter or
        copy them before calling again.

        Raises
        ------
        ValueError
            More than ``max_num_rows`` rows.
        """
        token_bitmask, token_mask = self._reset_rows(len(slots))
        jobs = [
            (row, slot, self._matchers[slot])
            for row, slot in enumerate(slots)
            if slot is not None and slot in self._matchers
        ]
        for row, _, _ in jobs:
            token_mask[row] = 1
        errors = self._fill_rows(token_bitmask, jobs)
        dead = find_dead_end_rows(token_bitmask, self.padded_vocab_size, token_mask)
        dead_rows = sorted(set(dead.nonzero().flatten().tolist()) | set(errors))
        for row in dead_rows:
            slot = slots[row]
            self._failures[slot] = errors.get(row) or (
                f"slot {slot}: grammar dead end, no allowed token below "
                f"padded_vocab_size={self.padded_vocab_size}"
            )
            token_bitmask[row] = -1
            token_mask[row] = 0
        return token_bitmask, token_mask, dead_rows

    def _fill_rows(self, token_bitmask: torch.Tensor, jobs: list) -> dict:
        """Fill the rows of ``jobs`` ``(row, slot, matcher)``; returns ``{row: error message}``."""

        def fill(job: tuple) -> tuple:
            row, slot, matcher = job
            try:
                matcher.fill_next_token_bitmask(token_bitmask, row)
            except Exception as exc:
                return row, f"slot {slot}: matcher error while filling the bitmask: {exc}"
            return row, None

        return {row: error for row, error in self._map(fill, jobs, len(jobs)) if error is not None}

    def _map(self, fn: Callable, jobs: list, num_rows: int) -> list:
        """``[fn(job) for job in jobs]``, in the fill threads when more than ``parallel_threshold`` rows are filled.

        Each job must touch its own matchers and rows only; results come back in no particular order.
        """
        if self.num_threads <= 1 or num_rows <= self.parallel_threshold:
            return [fn(job) for job in jobs]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="tpguide-bitmask")
        chunks = [jobs[i :: self.num_threads] for i in range(self.num_threads)]
        return [r for results in self._pool.map(lambda chunk: [fn(job) for job in chunk], chunks) for r in results]

    def close(self) -> None:
        """Stop the fill threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

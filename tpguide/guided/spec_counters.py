"""Per-slot grammar accounting for speculative decoding (docs/architecture.md §5).

A verification step of a guided request feeds ``[golden, d_1 .. d_k]`` to the
target model: ``golden`` is the token sampled last step (already accepted by
the matcher when it was sampled), ``d_j`` are draft tokens.  While filling the
``1 + k`` bitmask rows the driver advances the matcher through the drafts::

    row 0   state after golden                 (fill)
    row 1   state after golden d_1             (accept d_1, fill)
    ...
    row m   state after golden d_1 .. d_m      (stop at the first draft the
                                                grammar rejects, at a stop
                                                token, or at a dead end)

Rows past the last filled one are unguided: the target can never reach them
as its bonus row, because row ``m`` forbids ``d_{m+1}`` (or the request
stopped at ``d_m``).  After verification the target accepted ``a`` drafts and
the matcher must be rolled back to the state after ``golden d_1 .. d_a``::

    rollback = num_advanced_tokens - (1 + accepted)
    num_advanced_tokens = 1 + num_advanced_draft_tokens   (golden + drafts)

with ``accepted = min(a, num_advanced_draft_tokens)`` **only** when the matcher
terminated inside the window (a stop token drafted and accepted: the target may
accept drafts past it, but the request ends there).  Otherwise ``a`` can never
exceed the drafts the matcher advanced, so a negative rollback is an
accounting bug and raises :class:`SpecAccountingError` rather than being
clamped away.

Counter names and the clamp follow TensorRT-LLM's ``GuidedDecoder``
(``num_advanced_tokens``, ``num_guided_tokens``, ``num_advanced_draft_tokens``,
``is_draft_terminated``; see the walkthrough in ``seeds/``).  Pure Python: no
torch, no matcher; :mod:`tpguide.guided.spec_decoder` drives it.
"""

from __future__ import annotations

from dataclasses import dataclass


class SpecAccountingError(ValueError):
    """The speculative counters of a slot are inconsistent (an engine bug)."""


@dataclass
class SlotCounters:
    """One slot's counters for the current verification step.

    Attributes
    ----------
    num_advanced_tokens : int
        Tokens the matcher accepted since the last verified state: the golden
        token (1) plus the drafts accepted while filling.
    num_guided_tokens : int
        Bitmask rows filled with a real grammar mask this step (token_mask 1).
    num_advanced_draft_tokens : int
        Drafts the matcher accepted while filling (``num_advanced_tokens - 1``
        once the golden token is counted).
    is_draft_terminated : bool
        Guided filling stopped before the end of the draft window (a draft
        the grammar rejects, a stop token, a dead end); later rows are unguided.
    matcher_terminated : bool
        The matcher accepted a stop token among the drafts (the clamp case).
    """

    num_advanced_tokens: int = 0
    num_guided_tokens: int = 0
    num_advanced_draft_tokens: int = 0
    is_draft_terminated: bool = False
    matcher_terminated: bool = False

    def begin_step(self) -> None:
        """The golden token was just accepted: a new verification window starts."""
        self.num_advanced_tokens = 1
        self.num_guided_tokens = 0
        self.num_advanced_draft_tokens = 0
        self.is_draft_terminated = False
        self.matcher_terminated = False

    def advance_draft(self) -> None:
        """The matcher accepted one more draft token."""
        self.num_advanced_tokens += 1
        self.num_advanced_draft_tokens += 1

    def accepted_drafts(self, num_accepted_by_target: int) -> int:
        """Drafts that count for the grammar, clamped only in the stop-token case."""
        if num_accepted_by_target < 0:
            raise SpecAccountingError(f"num_accepted_by_target must be >= 0, got {num_accepted_by_target}")
        if self.matcher_terminated:
            return min(num_accepted_by_target, self.num_advanced_draft_tokens)
        return num_accepted_by_target

    def rollback_count(self, num_accepted_by_target: int) -> int:
        """Tokens to roll the matcher back after verification.

        Parameters
        ----------
        num_accepted_by_target : int
            Longest prefix of drafts equal to the target's tokens (``a``).

        Returns
        -------
        int
            ``num_advanced_tokens - (1 + accepted)``, ``>= 0``.

        Raises
        ------
        SpecAccountingError
            The result would be negative (the target accepted drafts the
            matcher never advanced through, outside the stop-token case), or
            the golden token was never counted.
        """
        if self.num_advanced_tokens < 1:
            raise SpecAccountingError(
                f"num_advanced_tokens={self.num_advanced_tokens}: the golden token was not counted "
                f"(begin_step not called)"
            )
        accepted = self.accepted_drafts(num_accepted_by_target)
        rollback = self.num_advanced_tokens - (1 + accepted)
        if rollback < 0:
            raise SpecAccountingError(
                f"negative rollback {rollback}: num_advanced_tokens={self.num_advanced_tokens}, "
                f"accepted drafts={accepted} (target accepted {num_accepted_by_target}, "
                f"matcher advanced {self.num_advanced_draft_tokens} drafts, "
                f"terminated={self.matcher_terminated})"
            )
        return rollback


def num_accepted_drafts(draft_token_ids, target_token_ids) -> int:
    """Longest prefix of drafts the target agrees with.

    ``draft_token_ids`` ``[k]``; ``target_token_ids`` ``[k + 1]`` (the target's
    token at each verification row).  Draft ``d_j`` is accepted iff every
    earlier draft was and the target's token at row ``j - 1`` equals ``d_j``
    (the exact rule for a deterministic draft: with greedy or with the same
    ``(seed, position)`` noise the output equals non-speculative decoding).
    """
    if len(target_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(
            f"need 1 + k target tokens for k drafts, got {len(target_token_ids)} for {len(draft_token_ids)}"
        )
    a = 0
    for d, t in zip(draft_token_ids, target_token_ids):
        if d != t:
            break
        a += 1
    return a

"""Speculative decoding on the driver: the verification of a draft window, and the counts (docs/architecture.md §5).

Per decode step of a request with ``k`` drafts (``k`` may be 0; the drafts
come from :meth:`tpguide.speculative.propose.Speculator.propose`)::

    scheduler  token_ids = [golden, d_1 .. d_k]         (query_len 1 + k)
    sampler    rows 0..k: target token y_j at position p + j + 1
               (row j masked with the grammar state after d_1 .. d_j)
    driver     a = longest prefix with d_j == y_{j-1}
               output += d_1 .. d_a, y_a                 (y_a is the bonus; each
                                                          accepted by the matcher as
                                                          any output token is)
               num_computed_tokens += 1 + a               (rejected KV positions
                                                           are overwritten later)

The acceptance rule is exact for a deterministic draft: greedy rows take the
argmax, sampled rows draw with noise keyed by ``(seed, position)``, so a token
is produced by the same computation as without drafts and speculative output
equals non-speculative output for every request: bit for bit in the default
TP-invariant mode, whose rows do not depend on the batch nor on being rows
of a verify pass (docs/architecture.md §6); up to floating-point
differences between batch shapes with ``--no-tp-invariant``.  Stop conditions (stop token, grammar end,
``max_tokens``, ``max_model_len``) are checked token by token when the
driver appends the verified tokens (:class:`tpguide.engine.finisher.StepFinisher`), so
the accepted window is truncated at the first one: a stop token, or the
first token after which the grammar matcher is terminated (also with
``ignore_eos``), exactly as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List


@dataclass
class SpecStats:
    """Counts over the engine's life (reset by assigning a fresh one).

    Attributes
    ----------
    num_drafted : int
        Draft tokens sent for verification (every drafter).
    num_accepted : int
        Drafts the target agreed with (before truncation at a stop).
    num_forced_drafted, num_forced_accepted : int
        The same for the grammar drafter's drafts alone (forced text and JSON layouts).
    num_verify_steps : int
        Decode steps that carried at least one draft.
    num_decode_steps : int
        Decode rows processed (with or without drafts).
    num_sample_passes : int
        Forward passes whose sample a request used (its last prefill chunk, each decode).
    num_generated_tokens : int
        Output tokens those passes appended.
    """

    num_drafted: int = 0
    num_accepted: int = 0
    num_forced_drafted: int = 0
    num_forced_accepted: int = 0
    num_verify_steps: int = 0
    num_decode_steps: int = 0
    num_sample_passes: int = 0
    num_generated_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def passes_per_token(self) -> float:
        """Forward passes per generated token, per request (1.0 without drafts)."""
        return self.num_sample_passes / self.num_generated_tokens if self.num_generated_tokens else 0.0

    def record_pass(self, num_tokens: int) -> None:
        """One request's pass appended ``num_tokens`` output tokens (0 when it failed or stopped at once)."""
        self.num_sample_passes += 1
        self.num_generated_tokens += num_tokens

    def summary(self, method: str, k: int) -> str:
        return (f"speculative {method} k={k}: drafted {self.num_drafted}, accepted {self.num_accepted} "
                f"(rate {100 * self.acceptance_rate:.1f}%); grammar drafts {self.num_forced_drafted}, "
                f"accepted {self.num_forced_accepted}; {self.num_verify_steps} of {self.num_decode_steps} "
                f"decode steps carried drafts; {self.num_sample_passes} forward passes for "
                f"{self.num_generated_tokens} generated tokens ({self.passes_per_token:.3f} per token)")


def num_accepted_drafts(draft_token_ids, target_token_ids) -> int:
    """Longest prefix of drafts the target agrees with.

    ``draft_token_ids`` ``[k]``; ``target_token_ids`` ``[k + 1]`` (the target's
    token at each verification row).  Draft ``d_j`` is accepted iff every
    earlier draft was and the target's token at row ``j - 1`` equals ``d_j``
    (the exact rule for a deterministic draft: with greedy or with the same
    ``(seed, position)`` noise the output equals non-speculative decoding).

    Raises
    ------
    ValueError
        ``len(target_token_ids) != len(draft_token_ids) + 1``.
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


@dataclass(frozen=True)
class Verification:
    """What the target accepted of one request's draft window.

    Attributes
    ----------
    num_accepted : int
        ``a``: drafts equal to the target's token at the row before them.
    token_ids : list of int
        ``[d_1 .. d_a, y_a]``: the output tokens in order (``y_a`` is the bonus).
    rows : list of int
        The sample row of each token (its logprobs).
    """

    num_accepted: int
    token_ids: List[int]
    rows: List[int]


def verify_drafts(drafts: List[int], token_ids: List[int], first_row: int, stats: SpecStats,
                  forced: bool = False) -> Verification:
    """Longest accepted prefix of one request's drafts (pure apart from ``stats``, which counts it).

    Parameters
    ----------
    drafts : list of int
        ``d_1 .. d_k`` fed after the golden token (``k`` may be 0).
    token_ids : list of int
        The step's sampled tokens, all sample rows.
    first_row : int
        The request's first sample row (rows ``first_row .. first_row + k``).
    stats : SpecStats
        The engine's counts (:attr:`~tpguide.speculative.propose.Speculator.stats`).
    forced : bool
        The drafts are forced text (``Speculator.propose`` drafted them from the
        grammar this step: the request's ``SlotRecord.forced``).

    Returns
    -------
    Verification
        ``a`` and the ``1 + a`` candidate output tokens ``d_1 .. d_a, y_a``
        with their rows; the driver appends them token by token and stops
        at the first stop condition (:class:`tpguide.engine.finisher.StepFinisher`).
    """
    k = len(drafts)
    targets = token_ids[first_row : first_row + k + 1]
    a = num_accepted_drafts(drafts, targets)
    stats.num_decode_steps += 1
    if k:
        stats.num_verify_steps += 1
        stats.num_drafted += k
        stats.num_accepted += a
        if forced:
            stats.num_forced_drafted += k
            stats.num_forced_accepted += a
    return Verification(num_accepted=a, token_ids=list(drafts[:a]) + [targets[a]],
                        rows=list(range(first_row, first_row + a + 1)))

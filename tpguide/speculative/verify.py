"""Speculative decoding on the driver: propose drafts, verify, accept (docs/architecture.md §5).

Per decode step of a request with ``k`` drafts (``k`` may be 0)::

    scheduler  token_ids = [golden, d_1 .. d_k]         (query_len 1 + k)
    sampler    rows 0..k: target token y_j at position p + j + 1
               (row j masked with the grammar state after d_1 .. d_j)
    driver     a = longest prefix with d_j == y_{j-1}
               output += d_1 .. d_a, y_a                 (y_a is the bonus)
               matcher rollback = advanced - (1 + a)      (spec_counters)
               num_computed_tokens += 1 + a               (rejected KV positions
                                                           are overwritten later)

The acceptance rule is exact for a deterministic draft: greedy rows take the
argmax, sampled rows draw with noise keyed by ``(seed, position)``, so a token
is produced by the same computation as without drafts and speculative output
equals non-speculative output for every request (up to floating-point
differences between batch shapes).  Stop conditions (stop token, grammar end,
``max_tokens``, ``max_model_len``) are checked token by token when the
driver appends the verified tokens (:class:`tpguide.engine.driver.StepFinisher`), so
the accepted window is truncated at the first one: a stop token, or the
first token after which the grammar matcher is terminated (also with
``ignore_eos``), exactly as without speculation.

Draft lengths are capped so that a verification never writes past
``max_model_len`` nor produces more than ``max_tokens`` tokens, and by the
step's token budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from tpguide.guided.spec_counters import num_accepted_drafts
from tpguide.speculative.ngram import NgramProposer

#: Values of ``EngineConfig.speculative_method`` (None = off).
SPECULATIVE_METHODS = ("ngram", "draft-head")

#: A reserved draft position until the ``draft-head`` drafting loop fills it.
DRAFT_PENDING = -1


@dataclass
class SpecStats:
    """Counts over one :meth:`Engine.generate` call.

    Attributes
    ----------
    num_drafted : int
        Draft tokens sent for verification.
    num_accepted : int
        Drafts the target agreed with (before truncation at a stop).
    num_verify_steps : int
        Decode steps that carried at least one draft.
    num_decode_steps : int
        Decode rows processed (with or without drafts).
    """

    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    num_decode_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    def summary(self, method: str, k: int) -> str:
        return (f"speculative {method} k={k}: drafted {self.num_drafted}, accepted {self.num_accepted} "
                f"(rate {100 * self.acceptance_rate:.1f}%), {self.num_verify_steps} of "
                f"{self.num_decode_steps} decode steps carried drafts")


class Speculator:
    """Driver-side drafting and verification for one engine.

    Parameters
    ----------
    method : {"ngram", "draft-head"}
        ``ngram`` drafts on the driver while scheduling; ``draft-head``
        reserves :data:`DRAFT_PENDING` positions
        that the engine's drafting loop fills on every rank
        (:mod:`tpguide.speculative.draft_loop`).
    num_speculative_tokens : int
        ``K``, the most drafts per request per step (``>= 1``).
    max_model_len : int

    Raises
    ------
    ValueError
        Unknown method, ``K < 1``.
    """

    def __init__(self, method: str, num_speculative_tokens: int, max_model_len: int) -> None:
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {list(SPECULATIVE_METHODS)}, got {method!r}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.method = method
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = NgramProposer() if method == "ngram" else None
        self.stats = SpecStats()

    def max_num_drafts(self, req, budget: int) -> int:
        """Drafts ``req`` may carry this step with ``budget`` tokens left (golden included)."""
        left = req.sampling_params.max_tokens - len(req.output_token_ids)
        return max(0, min(self.num_speculative_tokens, budget - 1, left - 1,
                          self.max_model_len - req.num_tokens))

    def propose(self, req, budget: int) -> List[int]:
        """Drafts for ``req``'s next decode step (the scheduler's hook); placeholders for ``draft-head``."""
        k = self.max_num_drafts(req, budget)
        if not k:
            return []
        if self.proposer is None:
            return [DRAFT_PENDING] * k
        return self.proposer.propose(req.all_token_ids, k)[:k]

    def verify(self, drafts: List[int], token_ids: List[int], first_row: int) -> "Verification":
        """Longest accepted prefix of one request's drafts (pure apart from :attr:`stats`).

        Parameters
        ----------
        drafts : list of int
            ``d_1 .. d_k`` fed after the golden token (``k`` may be 0).
        token_ids : list of int
            The step's sampled tokens, all sample rows.
        first_row : int
            The request's first sample row (rows ``first_row .. first_row + k``).

        Returns
        -------
        Verification
            ``a`` and the ``1 + a`` candidate output tokens ``d_1 .. d_a, y_a``
            with their rows; the driver appends them token by token and stops
            at the first stop condition (:class:`tpguide.engine.driver.StepFinisher`).
        """
        k = len(drafts)
        targets = token_ids[first_row : first_row + k + 1]
        a = num_accepted_drafts(drafts, targets)
        self.stats.num_decode_steps += 1
        if k:
            self.stats.num_verify_steps += 1
            self.stats.num_drafted += k
            self.stats.num_accepted += a
        return Verification(num_accepted=a, token_ids=list(drafts[:a]) + [targets[a]],
                            rows=list(range(first_row, first_row + a + 1)))


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

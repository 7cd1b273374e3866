"""Speculative decoding on the driver: draft, verify, accept (issue 4).

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
``max_tokens``, ``max_model_len``) are checked token by token through
:meth:`Driver._append`, so the accepted window is truncated at the first one.

Draft lengths are capped so that a verification never writes past
``max_model_len`` nor produces more than ``max_tokens`` tokens, and by the
step's token budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional

from tpguide.engine.ngram_proposer import NgramProposer
from tpguide.engine.request import Request
from tpguide.guided.spec_counters import SpecAccountingError, num_accepted_drafts

logger = logging.getLogger(__name__)

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
        (:mod:`tpguide.engine.draft_loop`).
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

    def max_num_drafts(self, req: Request, budget: int) -> int:
        """Drafts ``req`` may carry this step with ``budget`` tokens left (golden included)."""
        left = req.sampling_params.max_tokens - len(req.output_token_ids)
        return max(0, min(self.num_speculative_tokens, budget - 1, left - 1,
                          self.max_model_len - req.num_tokens))

    def propose(self, req: Request, budget: int) -> List[int]:
        """Drafts for ``req``'s next decode step (the scheduler's hook); placeholders for ``draft-head``."""
        k = self.max_num_drafts(req, budget)
        if not k:
            return []
        if self.proposer is None:
            return [DRAFT_PENDING] * k
        return self.proposer.propose(req.all_token_ids, k)[:k]

    def verify(self, driver, req: Request, drafts: List[int], token_ids: List[int], bad: List[bool],
               first_row: int, out) -> None:
        """Accept drafts of one decode step and append the output tokens.

        Parameters
        ----------
        driver : Driver
        req : Request
            Not finished, past its prompt; ``num_computed_tokens`` already
            advanced by ``1 + len(drafts)``.
        drafts : list of int
        token_ids, bad : list
            The step's sampled tokens and bad-row flags, all sample rows.
        first_row : int
            ``req``'s first sample row (rows ``first_row .. first_row + k``).
        out : SamplerOutput
        """
        k = len(drafts)
        targets = token_ids[first_row : first_row + k + 1]
        a = num_accepted_drafts(drafts, targets)
        self.stats.num_decode_steps += 1
        if k:
            self.stats.num_verify_steps += 1
            self.stats.num_drafted += k
            self.stats.num_accepted += a
        req.num_computed_tokens -= k - a  # rejected positions: overwritten by later steps
        accepted = a
        guided = driver.guided if req.structured_output is not None else None
        if guided is not None and hasattr(guided, "rollback_rejected"):
            try:
                accepted = guided.rollback_rejected(req.slot, a)
            except SpecAccountingError as exc:  # a bug: report it loudly, fail this request only
                logger.error("speculative accounting bug for request %s: %s", req.request_id, exc)
                req.fail(f"internal error (speculative accounting): {exc}")
                return
            except ValueError as exc:
                req.fail(str(exc))
                return
        for j in range(accepted + 1):
            row = first_row + j
            if bad[row]:
                req.fail(f"non-finite logits at step {driver.step} (all -inf or NaN)")
                return
            if j < accepted:  # the matcher already advanced through this draft
                driver._append(req, drafts[j], out, row, advance_matcher=False)
            else:
                driver._append(req, targets[j], out, row)
            if req.is_finished:
                return


def make_speculator(config) -> Optional[Speculator]:
    """The :class:`Speculator` of an ``EngineConfig``, or None when speculation is off."""
    if getattr(config, "speculative_method", None) is None:
        return None
    return Speculator(config.speculative_method, config.num_speculative_tokens, config.max_model_len)

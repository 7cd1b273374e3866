"""Speculative decoding on the driver: propose drafts, verify, accept (docs/architecture.md §5).

Per decode step of a request with ``k`` drafts (``k`` may be 0)::

    scheduler  token_ids = [golden, d_1 .. d_k]         (query_len 1 + k)
    sampler    rows 0..k: target token y_j at position p + j + 1
               (row j masked with the grammar state after d_1 .. d_j)
    driver     a = longest prefix with d_j == y_{j-1}
               output += d_1 .. d_a, y_a                 (y_a is the bonus; each
                                                          accepted by the matcher as
                                                          any output token is)
               num_computed_tokens += 1 + a               (rejected KV positions
                                                           are overwritten later)

The drafts come from the grammar drafter (forced text of a guided request,
:mod:`tpguide.speculative.grammar_draft`), else from the configured
fallback (n-gram lookup, the draft head), else there are none.  Every
drafter and the bitmask fill advance the matcher through drafts only inside
a cursor rolled back at once (:mod:`tpguide.guided.draft_cursor`), so the
matcher holds the verified tokens between steps.

The acceptance rule is exact for a deterministic draft: greedy rows take the
argmax, sampled rows draw with noise keyed by ``(seed, position)``, so a token
is produced by the same computation as without drafts and speculative output
equals non-speculative output for every request: bit for bit in the default
TP-invariant mode, whose rows do not depend on the batch nor on being rows
of a verify pass (docs/architecture.md §6); up to floating-point
differences between batch shapes with ``--no-tp-invariant``.  Stop conditions (stop token, grammar end,
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
from typing import Any, List, Sequence

from tpguide.speculative.ngram import NgramProposer

#: Values of ``EngineConfig.speculative_method`` (None = off).
SPECULATIVE_METHODS = ("grammar", "ngram", "draft-head")

#: A reserved draft position until the ``draft-head`` drafting loop fills it.
DRAFT_PENDING = -1


@dataclass(frozen=True)
class DraftInput:
    """One decoding request as the drafters see it: plain values the driver reads off its request.

    Attributes
    ----------
    slot : int
        Its request slot (the grammar record's key).
    prompt_token_ids, output_token_ids : sequence of int
        Its tokens so far (the n-gram history; the grammar layouts follow the output).
    max_tokens : int
        Its output limit.
    has_penalties : bool
        Penalties or ``logit_bias`` set: no grammar drafts.
    structured_output : StructuredOutputsParams or None
        Its guide (the grammar drafter's JSON layouts).
    """

    slot: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    max_tokens: int
    has_penalties: bool = False
    structured_output: Any = None


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


class Speculator:
    """Driver-side drafting and verification for one engine.

    Parameters
    ----------
    method : {"grammar", "ngram", "draft-head"}
        ``grammar``: guided requests draft their forced text, nothing else
        drafts.  ``ngram`` drafts on the driver while scheduling;
        ``draft-head`` reserves :data:`DRAFT_PENDING` positions that the
        engine's drafting loop fills on every rank
        (:mod:`tpguide.speculative.draft_loop`).  With a ``grammar_drafter``
        those two are the fallback where the grammar forces nothing.
    num_speculative_tokens : int
        ``K``, the most drafts per request per step (``>= 1``).
    max_model_len : int
    grammar_drafter : GrammarDrafter, optional
        Drafts the forced text of guided requests
        (:mod:`tpguide.speculative.grammar_draft`); required with ``grammar``.

    Raises
    ------
    ValueError
        Unknown method, ``K < 1``, ``grammar`` without a grammar drafter.
    """

    def __init__(self, method: str, num_speculative_tokens: int, max_model_len: int,
                 grammar_drafter=None) -> None:
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {list(SPECULATIVE_METHODS)}, got {method!r}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if method == "grammar" and grammar_drafter is None:
            raise ValueError("speculative method 'grammar' needs a grammar drafter")
        self.method = method
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = NgramProposer() if method == "ngram" else None
        self.grammar_drafter = grammar_drafter
        self.stats = SpecStats()

    def max_num_drafts(self, seq: "DraftInput", budget: int) -> int:
        """Drafts ``seq`` may carry this step with ``budget`` tokens left (golden included)."""
        left = seq.max_tokens - len(seq.output_token_ids)
        num_tokens = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        return max(0, min(self.num_speculative_tokens, budget - 1, left - 1, self.max_model_len - num_tokens))

    def propose(self, seq: "DraftInput", budget: int, guided=None) -> List[int]:
        """Drafts for ``seq``'s next decode step; placeholders for ``draft-head``.

        The drafting phase of the step (docs/architecture.md §1) calls it for
        every decoding request before the scheduler runs; the scheduler keeps
        the prefix its token budget allows.  Each drafter's drafts with a
        smaller budget are a prefix of those with a larger one.

        Parameters
        ----------
        seq : DraftInput
            A running request past its prompt.
        budget : int
            Tokens left in the step, its golden token included.
        guided : GuidedDecoder, optional
            The driver's records; a guided (or budget-thinking) request's
            drafts come from its forced text first, and n-gram drafts are
            cut where its rows reject one.  A request with penalties or ``logit_bias`` gets no
            grammar drafts (its rows would need the drafts in its history).

        Returns
        -------
        list of int
            At most :meth:`max_num_drafts` tokens, or as many :data:`DRAFT_PENDING`.
        """
        k = self.max_num_drafts(seq, budget)
        record = guided.record(seq.slot) if guided is not None else None
        if record is not None:
            record.forced = False
        if not k:
            return []
        if self.grammar_drafter is not None and record is not None and not seq.has_penalties:
            drafts = self.grammar_drafter.propose(guided, seq.slot, k, seq)
            if drafts:
                record.forced = True
                return drafts
        if self.method == "draft-head":
            return [DRAFT_PENDING] * k
        if self.proposer is None:
            return []
        drafts = self.proposer.propose(list(seq.prompt_token_ids) + list(seq.output_token_ids), k)[:k]
        return guided.accepted_prefix(seq.slot, drafts) if record is not None else drafts

    def verify(self, drafts: List[int], token_ids: List[int], first_row: int,
               forced: bool = False) -> "Verification":
        """Longest accepted prefix of one request's drafts (pure apart from :attr:`stats`).

        Parameters
        ----------
        drafts : list of int
            ``d_1 .. d_k`` fed after the golden token (``k`` may be 0).
        token_ids : list of int
            The step's sampled tokens, all sample rows.
        first_row : int
            The request's first sample row (rows ``first_row .. first_row + k``).
        forced : bool
            The drafts are forced text (:meth:`propose` drafted them from the
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
        self.stats.num_decode_steps += 1
        if k:
            self.stats.num_verify_steps += 1
            self.stats.num_drafted += k
            self.stats.num_accepted += a
            if forced:
                self.stats.num_forced_drafted += k
                self.stats.num_forced_accepted += a
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

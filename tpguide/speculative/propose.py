"""Speculative decoding on the driver: which drafter proposes a request's drafts, and how many.

docs/architecture.md §5.

The drafts come from the grammar drafter (forced text of a guided request,
:mod:`tpguide.speculative.grammar_draft`), else from the configured
fallback (n-gram lookup, the draft head), else there are none.  Every
drafter and the bitmask fill advance the matcher through drafts only inside
a cursor rolled back at once (:mod:`tpguide.guided.draft_cursor`), so the
matcher holds the verified tokens between steps.  The step verifies them
(:mod:`tpguide.speculative.verify`): output equals non-speculative output.

Draft lengths are capped so that a verification never writes past
``max_model_len`` nor produces more than ``max_tokens`` tokens, and by the
step's token budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence

from tpguide.speculative.ngram import NgramProposer
from tpguide.speculative.verify import SpecStats, Verification, verify_drafts

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
               forced: bool = False) -> Verification:
        """Longest accepted prefix of one request's drafts, counted in :attr:`stats`.

        :func:`~tpguide.speculative.verify.verify_drafts` (its parameters);
        ``forced``: :meth:`propose` drafted them from the grammar this step
        (the request's ``SlotRecord.forced``).
        """
        return verify_drafts(drafts, token_ids, first_row, self.stats, forced)

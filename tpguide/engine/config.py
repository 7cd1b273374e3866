"""``EngineConfig``: the engine's limits and choices (driver and every rank alike)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tpguide.guided.params import check_whitespace_mode


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits and choices (validated, never mutated).

    Attributes
    ----------
    max_num_seqs : int
        Requests running at once (KV-cache slots, guided bitmask rows).
    max_num_batched_tokens : int
        Token budget per step; longer prompts are prefilled in chunks.
    max_model_len : int
        Prompt plus generated tokens per request (KV-cache length).
    guided_backend : {"auto", "xgrammar", "llguidance"}
        ``auto``: per request, xgrammar if it enforces the guide, else llguidance
        (:mod:`tpguide.guided.admission`).
    json_whitespace : {"compact", "bounded", "any"}
        Whitespace between JSON tokens (:mod:`tpguide.guided.params`); a
        request's ``structured_output.json_whitespace`` overrides it.
    grammar_compile_timeout_s : float or None
        A guide whose admission (checks + compile, in a worker thread) takes
        longer fails its request; None = no limit.
    seed : int
        Run seed; a request without ``seed`` uses ``seed * 1_000_003 + index``.
    dtype : torch.dtype
        Weights and activations (logits are fp32).
    tp_invariant : bool
        TP-invariant row-parallel reductions: logits, tokens and logprobs
        bit-identical at tp 1..4 in every dtype (docs/architecture.md §6);
        False: plain all-reduce.
    speculative_method : {None, "ngram", "draft-head"}
        Draft tokens verified by the target model each decode step
        (:mod:`tpguide.speculative.verify`); None = off.  ``"draft-head"``
        needs the engine built with a draft head (:func:`tpguide.engine.engine.build_engine`).
    num_speculative_tokens : int
        ``K``, the most drafts per request per step (``>= 1`` with a method, 0 without).
    draft_num_layers : int or None
        ``draft-head``: target layers the drafter runs; None = a third of the
        layers (rounded up).
    draft_vocab_size : int
        ``draft-head``: target ids the draft LM head predicts (the first ids
        of the vocabulary plus the stop tokens; :func:`~tpguide.speculative.draft_head.select_draft_vocab`).
    draft_lens : bool
        ``draft-head`` with fewer layers than the target: put a tuned-lens
        translator between the drafter's last layer and the final norm,
        fitted once on built-in calibration text and cached
        (:mod:`tpguide.speculative.draft_lens`); False = the raw early exit.
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 1024
    max_model_len: int = 2048
    guided_backend: str = "auto"
    json_whitespace: str = "bounded"
    grammar_compile_timeout_s: Optional[float] = 60.0
    seed: int = 0
    dtype: torch.dtype = torch.float32
    tp_invariant: bool = True
    speculative_method: Optional[str] = None
    num_speculative_tokens: int = 0
    draft_num_layers: Optional[int] = None
    draft_vocab_size: int = 8192
    draft_lens: bool = True

    def __post_init__(self) -> None:
        _check_speculative(self.speculative_method, self.num_speculative_tokens)
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ValueError(f"draft_num_layers must be >= 1, got {self.draft_num_layers}")
        if self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.guided_backend not in ("auto", "xgrammar", "llguidance"):
            raise ValueError(f"guided_backend must be 'auto', 'xgrammar' or 'llguidance', got {self.guided_backend!r}")
        check_whitespace_mode(self.json_whitespace)
        if self.grammar_compile_timeout_s is not None and self.grammar_compile_timeout_s <= 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0 or None, got {self.grammar_compile_timeout_s}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


def _check_speculative(method: Optional[str], k: int) -> None:
    from tpguide.speculative.verify import SPECULATIVE_METHODS

    if method is not None and method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_method must be None or one of {list(SPECULATIVE_METHODS)}, got {method!r}")
    if method is None and k != 0:
        raise ValueError(f"num_speculative_tokens={k} needs a speculative_method")
    if method is not None and not 1 <= k <= 16:
        raise ValueError(f"num_speculative_tokens must be in [1, 16] with speculative_method={method!r}, got {k}")

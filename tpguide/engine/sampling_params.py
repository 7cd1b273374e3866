"""Per-request sampling parameters, validated like vLLM's ``SamplingParams``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples.

    Attributes
    ----------
    max_tokens : int
        Generated tokens at most (the stop token counts), >= 1.
    temperature : float
        0 = greedy; > 0 = Gumbel-max sampling from ``softmax(logits / T)``.
    top_k : int
        Keep the ``top_k`` most likely tokens; 0 or -1 = off.
    top_p : float
        Nucleus mass in (0, 1]; 1 = off.
    seed : int or None
        Random stream key; the engine derives one from the run seed and the
        request's index when ``None`` (outputs stay reproducible).
    logprobs : int
        Return the top-``logprobs`` log-probabilities per generated token (0 = none).
    prompt_logprobs : int or None
        ``None`` = off; ``n`` = per prompt token after the first, its logprob
        given the prefix plus the top-``n`` (vLLM semantics; 0 = the token only).
    ignore_eos : bool
        Keep generating after a stop token (it is still output) until
        ``max_tokens``, as vLLM's ``ignore_eos``; for benchmarks with fixed
        output lengths.  A guided request still ends when its grammar does.

    Raises
    ------
    ValueError
        On any value out of range; the message names the field and value.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    logprobs: int = 0
    prompt_logprobs: Optional[int] = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative int or null, got {self.seed!r}")
        if not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be an int in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
                isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, int)
                or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be null or an int in [0, 20], got {self.prompt_logprobs!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

"""Per-request sampling parameters, validated like vLLM's ``SamplingParams``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

#: Most stop strings per request, and their longest length in characters.
MAX_STOP_STRINGS, MAX_STOP_LEN = 16, 256


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
    stop : tuple of str
        Stop strings (OpenAI semantics): the request finishes with ``"stop"``
        as soon as its output text contains one, even across tokens, and
        the output text is cut before it (a list is accepted).
    presence_penalty, frequency_penalty : float
        In [-2, 2]; subtracted from the logit of every token already
        generated, once / per occurrence (OpenAI's definition).
    repetition_penalty : float
        > 0; the logit of every token in the prompt or the output is divided
        by it when positive, multiplied when negative (CTRL, as vLLM); 1 = off.
    logit_bias : tuple of (int, float)
        ``(token_id, bias)`` pairs, bias in [-100, 100], added to the logits
        (a ``{"token_id": bias}`` dict is accepted).

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
    stop: Tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Any = ()

    @property
    def has_penalties(self) -> bool:
        """Any of the penalties or ``logit_bias`` is set (the step plan then carries them)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def __post_init__(self) -> None:
        self._check_stop_and_penalties()
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

    def _check_stop_and_penalties(self) -> None:
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if len(stop) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_LEN for x in stop):
            raise ValueError(f"stop allows at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LEN} "
                             f"characters, got {len(stop)} strings, longest {max(map(len, stop))}")
        object.__setattr__(self, "stop", tuple(stop))
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not (math.isfinite(rp) and rp > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {rp!r}")
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, dict) else bias
        pairs = []
        try:
            for k, v in items:
                tid = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k
                if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
                    raise ValueError(f"logit_bias keys must be token ids (non-negative ints), got {k!r}")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {v!r} for {k!r}")
                pairs.append((tid, float(v)))
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"logit_bias must be an object {{token_id: bias}}, got {bias!r}") from exc
        if len({t for t, _ in pairs}) != len(pairs):
            raise ValueError(f"logit_bias names a token id twice: {bias!r}")
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs)))

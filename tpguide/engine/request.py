"""A generation request: its sampling parameters, its state on the driver, and its output.

:class:`SamplingParams` (validated like vLLM's), :class:`Request` (what the
user asked for and its state on the driver), :class:`RequestOutput` (what
:meth:`Engine.step` reports: a delta plus the running totals, and the output
line).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from tpguide.engine.detokenize import DetokenizeState

#: Most stop strings per request, and their longest length in characters.
MAX_STOP_STRINGS, MAX_STOP_LEN = 16, 256
#: The largest seed: seeds travel to every rank as int64 tensor values.
MAX_SEED = 2**63 - 1
#: temperature, top_p and repetition_penalty travel as float32 tensor values: the largest finite one, and the
#: smallest normal one (smaller ones round to 0 or lose precision; larger ones become inf).
FLOAT32_MAX, FLOAT32_MIN_NORMAL = 3.4028234663852886e38, 1.1754943508222875e-38
_TOKEN_ID = re.compile(r"[0-9]+")


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
    thinking_token_budget : int or None
        A reasoning request (docs/reasoning.md) thinks at most this many
        tokens, then ``</think>`` is forced; None = no limit.  ``max_tokens``
        counts every token.

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
    thinking_token_budget: Optional[int] = None

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
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
                or not (self.temperature == 0 or FLOAT32_MIN_NORMAL <= self.temperature <= FLOAT32_MAX)):
            raise ValueError(f"temperature must be 0 or a number in [{FLOAT32_MIN_NORMAL:.4g}, {FLOAT32_MAX:.4g}] "
                             f"(a normal float32 value: the step holds it as one), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not -1 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be an int in [-1, 2**31) (0 or -1 = off), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not FLOAT32_MIN_NORMAL <= self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] and at least {FLOAT32_MIN_NORMAL:.4g} (a normal float32 value), "
                             f"got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be null or an int in [0, 2**63 - 1] (a signed 64-bit tensor value), "
                             f"got {self.seed!r}")
        if not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be an int in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
                isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, int)
                or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be null or an int in [0, 20], got {self.prompt_logprobs!r}")
        budget = self.thinking_token_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"thinking_token_budget must be null or an int >= 0, got {budget!r}")
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
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not FLOAT32_MIN_NORMAL <= rp <= FLOAT32_MAX:
            raise ValueError(f"repetition_penalty must be a number in [{FLOAT32_MIN_NORMAL:.4g}, {FLOAT32_MAX:.4g}] "
                             f"(a normal float32 value > 0), got {rp!r}")
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, dict) else bias
        pairs = []
        try:
            for k, v in items:
                tid = int(k) if isinstance(k, str) and _TOKEN_ID.fullmatch(k) else k
                if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
                    raise ValueError(f"logit_bias keys must be token ids (non-negative ints, ASCII digits in a "
                                     f"string key), got {k!r}")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {v!r} for {k!r}")
                pairs.append((tid, float(v)))
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"logit_bias must be an object {{token_id: bias}}, got {bias!r}") from exc
        if len({t for t, _ in pairs}) != len(pairs):
            raise ValueError(f"logit_bias names a token id twice: {bias!r}")
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs)))


@dataclass
class Request:
    """One request as the driver tracks it.

    ``prompt_token_ids`` is filled at admission (chat template + tokenizer,
    :mod:`tpguide.engine.driver`).  ``finish_reason`` is ``None`` while the
    request runs, then ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``
    (with ``error`` set).  ``num_reported_tokens`` counts the output tokens
    already returned by :meth:`Engine.step` (the next delta starts there).
    """

    request_id: str
    index: int
    sampling_params: SamplingParams
    prompt: Optional[str] = None
    messages: Optional[List[Dict[str, Any]]] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None  # extra chat-template variables (vLLM's field)
    structured_output: Any = None  # tpguide.guided.StructuredOutputsParams or None
    prompt_token_ids: List[int] = field(default_factory=list)
    output_token_ids: List[int] = field(default_factory=list)
    output_logprobs: List[Dict[str, Any]] = field(default_factory=list)
    prompt_logprobs: List[Optional[Dict[str, Any]]] = field(default_factory=list)  # [None, {...}, ...]
    num_computed_tokens: int = 0
    slot: Optional[int] = None  # request row: its matcher and bitmask rows (not its KV, see block_ids)
    block_ids: List[int] = field(default_factory=list)  # KV block table, position order (kv_cache_manager.py)
    block_hashes: List[bytes] = field(default_factory=list)  # prefix keys of its full blocks (prefix_hash.py)
    num_cached_blocks: int = 0  # first blocks registered in the prefix cache
    num_prefill_tokens: Optional[int] = None  # set while recomputing after a preemption: all its tokens
    admit_order: int = -1  # when it first got a slot; the newest running request is preempted first
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    server_fault: bool = False  # the error is the server's (500), not the request's (tpguide/engine/request_faults.py)
    seed: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_reported_tokens: int = 0
    stop_text_cut: Optional[int] = None  # output text length when a stop string finished the request
    guided_backend: Optional[str] = None  # the backend admission chose (tpguide/guided/admission.py)
    compiled_guide: Any = None  # and the guide as it admitted it: what the decoder's matchers are made from
    thinks: bool = False  # set at admission: it starts inside a think block (docs/reasoning.md)
    detokenized: Optional[DetokenizeState] = None  # the unfinished output's text so far (engine/outputs.py)
    post_check: Optional[str] = None  # "passed" / "failed": the guided "stop" output's validation (engine/outputs.py)
    num_draft_tokens: int = 0  # drafts verified for it, and accepted (the receipt, tpguide/engine/receipt.py)
    num_accepted_draft_tokens: int = 0
    num_grammar_draft_tokens: int = 0  # of those, the grammar drafter's (forced text, JSON layouts)
    num_accepted_grammar_draft_tokens: int = 0
    num_forced_tokens: int = 0  # output tokens whose mask allowed that one token id (engine/finisher.py)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def has_grammar_state(self) -> bool:
        """Its rows are masked: a guide, or thinking under a budget (a record in the guided decoder)."""
        return self.structured_output is not None or (
            self.thinks and self.sampling_params.thinking_token_budget is not None)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> List[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def prefill_len(self) -> int:
        """Tokens to compute before decoding: the prompt, or every token when recomputing after a preemption."""
        return self.num_prefill_tokens if self.num_prefill_tokens is not None else len(self.prompt_token_ids)

    @property
    def is_prefill(self) -> bool:
        """True while prompt (or, after a preemption, recomputed) tokens remain to be computed."""
        return self.num_computed_tokens < self.prefill_len

    def fail(self, message: str, server_fault: bool = False) -> None:
        """Finish with ``finish_reason="error"`` (first message wins).

        ``server_fault``: the server failed, not the request (an exception in
        the driver's work for it): a server answers 500 rather than 400, and
        it replaces a finish other than ``"error"`` (an output that could not
        be built after ``"stop"`` is an error).
        """
        if self.finish_reason is None or (server_fault and self.finish_reason != "error"):
            self.finish_reason = "error"
            self.error = message
            self.server_fault = server_fault
            self.finish_time = time.perf_counter()

    def finish(self, reason: str) -> None:
        """Finish with ``reason`` (``"stop"``, ``"length"``, ``"abort"``); the first reason wins."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finish_time = time.perf_counter()


@dataclass
class RequestOutput:
    """One request's state as :meth:`Engine.step` reports it (a delta plus the running totals).

    Attributes
    ----------
    request_id : str
    index : int
        The request's place in its input (output files are written in this order).
    new_token_ids : list of int
        Tokens appended in this step.
    token_ids : list of int
        Every generated token so far.
    text : str
        ``token_ids`` detokenized (special tokens skipped); for a request that
        thinks, the answer after ``</think>`` only.
    reasoning : str or None
        The text inside the think block (docs/reasoning.md); None for a
        request that does not think.
    finish_reason : str or None
        None while running, then ``"stop"``, ``"length"``, ``"error"`` or ``"abort"``.
    error : str or None
        Why the request failed (``finish_reason == "error"``).
    server_fault : bool
        The failure was the server's (an exception in the driver's work for
        this request), not the request's input: the server answers 500.
    num_prompt_tokens : int
    new_logprobs, logprobs : list of dict or None
        Per-token logprobs of ``new_token_ids`` / ``token_ids`` (None unless
        the request asked for ``logprobs``); entries
        ``{"token_id", "logprob", "top": [[id, logprob], ...]}``.
    prompt_logprobs : list or None
        ``[None, {...}, ...]``, one entry per prompt token, once the prompt is
        done (None unless asked for, or when the request failed).
    elapsed_s : float
        Seconds from ``add_request`` to now (or to the finish).
    receipt : dict or None
        A finished output's receipt (docs/receipts.md); None while running.
    request : dict or None
        The request line that reproduces it (:func:`tpguide.engine.receipt.request_line`),
        set with ``receipt``.
    """

    request_id: str
    index: int = 0
    new_token_ids: List[int] = field(default_factory=list)
    token_ids: List[int] = field(default_factory=list)
    text: str = ""
    reasoning: Optional[str] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    server_fault: bool = False
    num_prompt_tokens: int = 0
    new_logprobs: Optional[List[Dict[str, Any]]] = None
    logprobs: Optional[List[Dict[str, Any]]] = None
    prompt_logprobs: Optional[List[Optional[Dict[str, Any]]]] = None
    elapsed_s: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def id(self) -> str:
        """The request id under its output-line key."""
        return self.request_id
    guided_backend: Optional[str] = None

    receipt: Optional[Dict[str, Any]] = None
    request: Optional[Dict[str, Any]] = None

    def to_json(self) -> Dict[str, Any]:
        """The output line: ``{"id", "text", "token_ids", "finish_reason", "error", "num_prompt_tokens"}``
        (+ ``"logprobs"`` / ``"prompt_logprobs"`` when asked, ``"reasoning"`` for a request that thinks,
        ``"request"`` and ``"receipt"`` once finished, docs/receipts.md)."""
        out = {
            "id": self.request_id,
            **({"reasoning": self.reasoning} if self.reasoning is not None else {}),
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "num_prompt_tokens": self.num_prompt_tokens,
        }
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs
        if self.guided_backend is not None:
            out["guided_backend"] = self.guided_backend
        if self.server_fault:
            out["server_fault"] = True
        if self.request is not None:
            out["request"] = self.request
        if self.receipt is not None:
            out["receipt"] = self.receipt
        return out

    @classmethod
    def from_json(cls, obj: Dict[str, Any], index: int = 0) -> "RequestOutput":
        """The output of one stored line (``--resume``); unknown keys are dropped."""
        return cls(request_id=str(obj["id"]), index=index, token_ids=list(obj.get("token_ids", [])),
                   text=obj.get("text", ""), reasoning=obj.get("reasoning"), finish_reason=obj.get("finish_reason"), error=obj.get("error"),
                   num_prompt_tokens=obj.get("num_prompt_tokens", 0), logprobs=obj.get("logprobs"),
                   prompt_logprobs=obj.get("prompt_logprobs"), guided_backend=obj.get("guided_backend"),
                   receipt=obj.get("receipt"), request=obj.get("request"))

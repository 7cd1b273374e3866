"""A generation request: what the user asked for, and its state on the driver."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from tpguide.engine.sampling_params import SamplingParams


@dataclass
class Request:
    """One request as the driver tracks it.

    ``prompt_token_ids`` is filled at admission (chat template + tokenizer,
    :mod:`tpguide.engine.admission`).  ``finish_reason`` is ``None`` while the
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
    slot: Optional[int] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    seed: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_reported_tokens: int = 0
    stop_text_cut: Optional[int] = None  # output text length when a stop string finished the request
    guided_backend: Optional[str] = None  # the backend admission chose (tpguide/guided/admission.py)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> List[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_prefill(self) -> bool:
        """True while prompt tokens remain to be computed."""
        return self.num_computed_tokens < len(self.prompt_token_ids)

    def fail(self, message: str) -> None:
        """Finish with ``finish_reason="error"`` (first message wins)."""
        if self.finish_reason is None:
            self.finish_reason = "error"
            self.error = message
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
        ``token_ids`` detokenized (special tokens skipped).
    finish_reason : str or None
        None while running, then ``"stop"``, ``"length"``, ``"error"`` or ``"abort"``.
    error : str or None
        Why the request failed (``finish_reason == "error"``).
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
    """

    request_id: str
    index: int = 0
    new_token_ids: List[int] = field(default_factory=list)
    token_ids: List[int] = field(default_factory=list)
    text: str = ""
    finish_reason: Optional[str] = None
    error: Optional[str] = None
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

    def to_json(self) -> Dict[str, Any]:
        """The output line: ``{"id", "text", "token_ids", "finish_reason", "error", "num_prompt_tokens"}``
        (+ ``"logprobs"`` / ``"prompt_logprobs"`` when asked)."""
        out = {
            "id": self.request_id,
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
        return out

    @classmethod
    def from_json(cls, obj: Dict[str, Any], index: int = 0) -> "RequestOutput":
        """The output of one stored line (``--resume``); unknown keys are dropped."""
        return cls(request_id=str(obj["id"]), index=index, token_ids=list(obj.get("token_ids", [])),
                   text=obj.get("text", ""), finish_reason=obj.get("finish_reason"), error=obj.get("error"),
                   num_prompt_tokens=obj.get("num_prompt_tokens", 0), logprobs=obj.get("logprobs"),
                   prompt_logprobs=obj.get("prompt_logprobs"))

"""A generation request: what the user asked for, and its state on the driver."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from tpguide.engine.sampling_params import SamplingParams


@dataclass
class Request:
    """One request as the driver tracks it.

    ``prompt_token_ids`` is filled by the engine (chat template + tokenizer)
    before scheduling.  ``finish_reason`` is ``None`` while the request runs,
    then ``"stop"``, ``"length"`` or ``"error"`` (with ``error`` set).
    """

    request_id: str
    index: int
    sampling_params: SamplingParams
    prompt: Optional[str] = None
    messages: Optional[List[Dict[str, Any]]] = None
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
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finish_time = time.perf_counter()


@dataclass
class RequestOutput:
    """What the driver writes for one request (one JSON line)."""

    id: str
    text: str
    token_ids: List[int]
    finish_reason: str
    error: Optional[str]
    num_prompt_tokens: int = 0
    logprobs: Optional[List[Dict[str, Any]]] = None
    elapsed_s: float = 0.0
    prompt_logprobs: Optional[List[Optional[Dict[str, Any]]]] = None
    guided_backend: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        out = {
            "id": self.id,
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

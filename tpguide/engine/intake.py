"""Intake: every check a request passes before it runs, and its guide's compile, in arrival order (driver).

The ONE place where a request is checked before it runs (fail closed,
docs/architecture.md §5).  :func:`admit_request` tokenizes the prompt (chat
template for ``messages``), checks its length against ``max_model_len`` (the
sampling values are checked when :class:`~tpguide.engine.request.SamplingParams`
is built), stop strings, penalties and ``thinking_token_budget``;
:class:`Intake` adds the KV fit check, submits a guide's checks and compile to
a worker thread (:class:`~tpguide.guided.compile_service.CompileService`) and
hands the scheduler the requests whose guides are admitted, in arrival order.
Any failure finishes that request with ``finish_reason="error"`` and a message
naming the values; the rest go on.
"""

from __future__ import annotations

import time
from collections import deque
from typing import List, Optional, Tuple

from tpguide.engine.kv_cache_manager import KVCacheManager
from tpguide.engine.request import Request
from tpguide.engine.request_faults import contained
from tpguide.guided.admission import admit
from tpguide.guided.compile_service import CompileService

__all__ = ["Intake", "admit_request", "tokenize_prompt"]


def tokenize_prompt(tokenizer, req: Request) -> List[int]:
    """Prompt token ids: chat template for ``messages``, plain encoding for ``prompt``.

    ``chat_template_kwargs`` become template variables (Qwen3's
    ``enable_thinking``).  A template that rejects the messages (Gemma 2:
    no system role) raises ``ValueError`` naming its reason: that request fails.
    """
    if req.messages is not None:
        from jinja2 import TemplateError

        try:
            text = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False,
                                                 **(req.chat_template_kwargs or {}))
        except TemplateError as exc:
            raise ValueError(f"the model's chat template rejected the messages: {exc}") from exc
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(req.prompt)["input_ids"])


def admit_request(req: Request, tokenizer, config, reasoning=None) -> None:
    """Check ``req`` and prepare it to run: prompt ids, seed, whether it thinks (its guide compiles later).

    Parameters
    ----------
    req : Request
        Not finished.  On return ``prompt_token_ids`` and ``seed`` are set
        (``prompt_token_ids`` also when a later check fails, for the report).
    tokenizer : transformers tokenizer
    config : EngineConfig
        ``max_model_len`` and the run ``seed`` (a request without a seed uses
        ``seed * 1_000_003 + index``).
    reasoning : ReasoningParser, optional
        The engine's (docs/reasoning.md); ``req.thinks`` is set unless the
        prompt closes the think block.

    Raises
    ------
    ValueError
        Empty prompt, prompt + ``max_tokens`` over ``max_model_len``, bad
        sampling values, ``thinking_token_budget`` without a reasoning parser
        (the message names the values).  A guide that does not compile fails
        its request later, through :class:`Intake`.
    """
    if req.prompt is not None and not req.prompt.strip():
        raise ValueError(f"the prompt is empty or whitespace only: {req.prompt!r}")
    ids = tokenize_prompt(tokenizer, req)
    if not ids:
        raise ValueError("the prompt is empty (0 tokens)")
    req.prompt_token_ids = ids  # reported in the output even if a later check fails
    limit = config.max_model_len
    total = len(ids) + req.sampling_params.max_tokens
    if total > limit:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({req.sampling_params.max_tokens}) = "
            f"{total} exceeds max_model_len={limit}"
        )
    _check_stop_and_penalties(req, len(tokenizer), config)
    if reasoning is None and req.sampling_params.thinking_token_budget is not None:
        raise ValueError(f"thinking_token_budget={req.sampling_params.thinking_token_budget} needs a reasoning "
                         f"model (reasoning_parser={config.reasoning_parser!r} found no think tokens)")
    req.thinks = reasoning is not None and reasoning.starts_thinking(ids)
    if req.sampling_params.seed is not None:
        req.seed = req.sampling_params.seed
    else:
        req.seed = (config.seed * 1_000_003 + req.index) % (2**63 - 1)


def _check_stop_and_penalties(req: Request, tokenizer_vocab_size: int, config) -> None:
    """Refuse what could not be honoured: a stop string cutting a guided output, penalties with drafts.

    Grammar drafts skip a request with penalties (:meth:`Speculator.propose`);
    the n-gram and draft-head drafters would draft every request.
    """
    sp = req.sampling_params
    if sp.stop and req.structured_output is not None:
        raise ValueError(f"stop strings {list(sp.stop)} cannot be combined with structured_output: the output "
                         "cut at a stop string would not satisfy its guide")
    if sp.has_penalties and config.speculative_method in ("ngram", "draft-head"):
        raise ValueError("presence/frequency/repetition penalties and logit_bias are not supported with "
                         f"speculative decoding (speculative_method={config.speculative_method!r})")
    bad = [t for t, _ in sp.logit_bias if t >= tokenizer_vocab_size]
    if bad:
        raise ValueError(f"logit_bias token ids {bad} are outside the tokenizer's vocabulary "
                         f"[0, {tokenizer_vocab_size})")


#: JSON layouts of grammar drafts are compiled only for a guide admitted within this share of
#: ``grammar_compile_timeout_s`` (docs/architecture.md §5 "JSON layouts").
LAYOUT_COMPILE_BUDGET = 0.1


class Intake:
    """Requests from ``add`` until they may be scheduled: checked, their guides compiled off the loop, in order.

    Parameters
    ----------
    tokenizer : transformers tokenizer
    config : EngineConfig
    kv : KVCacheManager
        The pool a request must fit alone (prompt + ``max_tokens`` + the
        speculative lookahead).
    reasoning : ReasoningParser, optional
        The engine's think-block tokens (docs/reasoning.md); None: off.
    """

    def __init__(self, tokenizer, config, kv: KVCacheManager, reasoning=None) -> None:
        self.tokenizer, self.config, self.kv, self.reasoning = tokenizer, config, kv, reasoning
        self._compiles = CompileService(config.grammar_compile_timeout_s)  # guide checks + compile, off the loop
        self._arrivals: deque = deque()  # checked, waiting for their guide to compile (FIFO into the scheduler)
        self._compiled: dict = {}  # request index -> (result, error) of its guide's admission

    def add(self, req: Request, backend=None, drafter=None) -> None:
        """Check ``req`` and queue it; a failed check finishes it ``"error"`` (never raises for bad input).

        Parameters
        ----------
        req : Request
            Not finished.
        backend : GuidedBackend, optional
            Compiles ``req``'s guide; needed when it has one.
        drafter : GrammarDrafter, optional
            Compiles the guide's JSON layouts beside it (grammar drafts).
        """
        with contained(req, "admit"):  # anything but a ValueError is the server's fault, this request's alone
            try:
                admit_request(req, self.tokenizer, self.config, self.reasoning)
                self._check_fits_kv_cache(req)
            except ValueError as exc:
                req.fail(str(exc))
        if req.is_finished:
            return
        if req.structured_output is not None:
            self._compiles.submit(req.index, _compile_job(backend, drafter, req.structured_output,
                                                          self.config.grammar_compile_timeout_s or 60.0))
        self._arrivals.append(req)

    def _check_fits_kv_cache(self, req: Request) -> None:
        """Refuse a request the KV pool could not hold even alone (ValueError naming the numbers)."""
        k = self.config.num_speculative_tokens
        what = (f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens ({req.sampling_params.max_tokens})"
                + (f" + {k} speculative lookahead" if k else ""))
        self.kv.check_fits(len(req.prompt_token_ids) + req.sampling_params.max_tokens + k, what)

    def has_arrivals(self) -> bool:
        """True while some checked request waits for its guide or for its turn."""
        return bool(self._arrivals)

    def wait(self, max_wait_s: Optional[float] = None) -> None:
        """Block until some pending compile finishes (at most ``max_wait_s`` seconds; None: no limit)."""
        self._compiles.wait(max_wait_s)

    def take_admitted(self) -> Tuple[List[Request], List[Request]]:
        """``(admitted, refused)``: the arrivals whose guides are ready, in arrival order, and those refused.

        The admitted prefix of the arrivals stops at the first request whose
        guide still compiles, so requests join the scheduler in arrival order.
        A refused request is finished ``"error"`` with its compile error.
        """
        waiting = {r.index for r in self._arrivals}  # results of aborted arrivals are dropped
        self._compiled.update((index, (result, error)) for index, result, error in self._compiles.collect()
                              if index in waiting)
        admitted, refused = [], []
        while self._arrivals and (self._arrivals[0].structured_output is None
                                  or self._arrivals[0].index in self._compiled):
            req = self._arrivals.popleft()
            result, error = self._compiled.pop(req.index, (None, None))
            if error is None:
                if result is not None:  # (backend name, compiled) from admit()
                    req.guided_backend, req.compiled_guide = result
                admitted.append(req)
            else:
                req.fail(str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}")
                refused.append(req)
        return admitted, refused

    def abort(self, request_ids) -> List[Request]:
        """Finish the arrivals named in ``request_ids`` with ``"abort"``; return them (their compiles are dropped)."""
        aborted = [r for r in self._arrivals if r.request_id in request_ids]
        for req in aborted:
            req.finish("abort")
        kept = [r for r in self._arrivals if not r.is_finished]
        self._arrivals.clear()
        self._arrivals.extend(kept)
        return aborted


def _compile_job(backend, drafter, params, timeout_s: float):
    """The worker-thread job of one guide: its admission (checks + compile), then the drafter's JSON layouts.

    The layouts are compiled only where the guide itself was quick (a layout
    compiles over a byte vocabulary, faster than its guide, so the four stay
    far inside the timeout).
    """
    def job():
        start = time.perf_counter()
        admitted = admit(backend, params)
        if drafter is not None and time.perf_counter() - start < LAYOUT_COMPILE_BUDGET * timeout_s:
            drafter.prepare(backend, params)
        return admitted
    return job

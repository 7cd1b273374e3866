"""A request's output: the token delta since its last report plus the totals, detokenized (driver).

:func:`request_output` splits a reasoning model's think block from the answer
(docs/reasoning.md), applies a stop string's cut, and validates a guided
``"stop"`` output against its guide once more (fail closed,
docs/guarantees.md): an output that does not validate is reported as an error.
"""

from __future__ import annotations

import time
from typing import Optional, Tuple

from tpguide.engine.detokenize import DetokenizeState, detokenize_incrementally
from tpguide.engine.request import Request, RequestOutput
from tpguide.guided.schema_check import validate_output

__all__ = ["failed_output", "request_output"]


def _texts(req: Request, tokenizer, reasoning_parser) -> Tuple[Optional[str], str]:
    """``(reasoning, text)`` of ``req`` now: the think block and the answer (docs/reasoning.md), or (None, all).

    A stop string's cut (an offset in the whole output's text) cuts the answer, the reasoning kept whole.
    An unfinished output that does not think is detokenized incrementally
    (:mod:`tpguide.engine.detokenize`: a window per step, a character cut
    by the last token held back); a finished one is decoded whole.
    """
    def decode(ids) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    ids = req.output_token_ids
    if not req.is_finished and not req.thinks:
        if req.detokenized is None:
            req.detokenized = DetokenizeState()
        detokenize_incrementally(tokenizer, ids, req.detokenized)
        return None, req.detokenized.text
    reasoning, answer = (None, ids) if not req.thinks else reasoning_parser.split(ids)
    text = decode(answer or [])
    if req.stop_text_cut is not None:  # finished at a stop string: the text ends before it
        before = len(decode(ids)) - len(text)  # the whole output's text up to the answer
        text = text[:max(0, req.stop_text_cut - before)]
    return (decode(reasoning) if reasoning is not None else None), text


def request_output(req: Request, tokenizer, reasoning_parser=None) -> RequestOutput:
    """``req``'s output now: the delta since the last report plus the totals; marks the delta reported.

    Parameters
    ----------
    req : Request
        ``num_reported_tokens`` is advanced to the output's length.
    tokenizer : transformers tokenizer
        Detokenizes (special tokens skipped).
    reasoning_parser : ReasoningParser, optional
        Splits a thinking request's output into reasoning and answer.

    Returns
    -------
    RequestOutput
        A guided ``"stop"`` output whose text does not validate against its
        guide has ``finish_reason="error"`` and the validator's message.
    """
    ids = req.output_token_ids
    start = req.num_reported_tokens
    req.num_reported_tokens = len(ids)
    reasoning, text = _texts(req, tokenizer, reasoning_parser)
    if req.finish_reason == "stop" and req.structured_output is not None:
        invalid = validate_output(req.structured_output, text)  # the last line of defence (fail closed)
        req.post_check = "passed" if invalid is None else "failed"
        if invalid is not None:
            req.finish_reason, req.error = "error", invalid
    elapsed = (req.finish_time or time.perf_counter()) - req.arrival_time
    want_logprobs = bool(req.sampling_params.logprobs)
    return RequestOutput(
        request_id=req.request_id, index=req.index,
        new_token_ids=list(ids[start:]), token_ids=list(ids), text=text, reasoning=reasoning,
        finish_reason=req.finish_reason, error=req.error, server_fault=req.server_fault,
        num_prompt_tokens=len(req.prompt_token_ids),
        new_logprobs=list(req.output_logprobs[start:]) if want_logprobs else None,
        logprobs=list(req.output_logprobs) if want_logprobs else None,
        prompt_logprobs=([None] + req.prompt_logprobs
                         if req.sampling_params.prompt_logprobs is not None and req.prompt_token_ids
                         and req.finish_reason != "error"
                         else None),
        elapsed_s=elapsed, guided_backend=req.guided_backend,
    )


def failed_output(req: Request) -> RequestOutput:
    """The output of a request whose output could not be built (:func:`request_output` raised): no text.

    ``req`` has failed (:func:`tpguide.engine.request_faults.contained`); its
    tokens and error are reported, and its delta is marked reported.
    """
    start, req.num_reported_tokens = req.num_reported_tokens, len(req.output_token_ids)
    return RequestOutput(
        request_id=req.request_id, index=req.index, new_token_ids=list(req.output_token_ids[start:]),
        token_ids=list(req.output_token_ids), finish_reason=req.finish_reason, error=req.error,
        server_fault=req.server_fault, num_prompt_tokens=len(req.prompt_token_ids),
        elapsed_s=(req.finish_time or time.perf_counter()) - req.arrival_time, guided_backend=req.guided_backend,
    )

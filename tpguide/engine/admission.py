"""Admission of a request on the driver: the ONE place where a request is checked before it runs.

:func:`admit_request` tokenizes the prompt (chat template for ``messages``),
checks its length against ``max_model_len`` (the sampling values are checked when
:class:`~tpguide.engine.request.SamplingParams` is built) and
compiles the structured-output guide.  Any failure raises ``ValueError``
naming the values; :meth:`tpguide.engine.driver.Driver.add_request` turns it
into ``finish_reason="error"`` for that request only.  Checks that refuse a
request up front (fail closed, docs/architecture.md §5) belong here.
"""

from __future__ import annotations

from typing import Callable, List

from tpguide.engine.request import Request


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


def admit_request(req: Request, tokenizer, config, compile_guide: Callable) -> None:
    """Prepare ``req`` to run: prompt ids, seed, compiled guide.

    Parameters
    ----------
    req : Request
        Not finished.  On return ``prompt_token_ids`` and ``seed`` are set
        (``prompt_token_ids`` also when a later check fails, for the report).
    tokenizer : transformers tokenizer
    config : EngineConfig
        ``max_model_len`` and the run ``seed`` (a request without a seed uses
        ``seed * 1_000_003 + index``).
    compile_guide : callable
        ``compile_guide(StructuredOutputsParams)``: compiles (and caches) the
        guide; raises ``ValueError`` for one that does not compile.

    Raises
    ------
    ValueError
        Empty prompt, prompt + ``max_tokens`` over ``max_model_len``, bad
        sampling values, a guide that does not compile (the message names
        the values).
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
    if req.structured_output is not None:
        compile_guide(req.structured_output)
    if req.sampling_params.seed is not None:
        req.seed = req.sampling_params.seed
    else:
        req.seed = (config.seed * 1_000_003 + req.index) % (2**63 - 1)


def _check_stop_and_penalties(req: Request, tokenizer_vocab_size: int, config) -> None:
    """Refuse what could not be honoured: a stop string cutting a guided output, penalties with drafts."""
    sp = req.sampling_params
    if sp.stop and req.structured_output is not None:
        raise ValueError(f"stop strings {list(sp.stop)} cannot be combined with structured_output: the output "
                         "cut at a stop string would not satisfy its guide")
    if sp.has_penalties and config.speculative_method is not None:
        raise ValueError("presence/frequency/repetition penalties and logit_bias are not supported with "
                         f"speculative decoding (speculative_method={config.speculative_method!r})")
    bad = [t for t, _ in sp.logit_bias if t >= tokenizer_vocab_size]
    if bad:
        raise ValueError(f"logit_bias token ids {bad} are outside the tokenizer's vocabulary "
                         f"[0, {tokenizer_vocab_size})")

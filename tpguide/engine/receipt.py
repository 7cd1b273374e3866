"""The receipt of an output: what fixed its bits, how its guide was enforced, and hashes of what came out.

docs/receipts.md explains every field.  The driver builds one per finished
request (:func:`build_receipt`) from the run's constant part
(:class:`ReceiptContext`, built once at start-up: the model's content
fingerprint and the engine's facts) and the request's own state.  Every
offline output line carries it with the request that produced it
(:func:`request_line`), so ``launch/replay.py`` can run the request again and
compare the bits; the server returns it when asked.

Fields under the paths of :data:`NOT_AFFECTING_BITS` are recorded but do not
change an output's bits (tp size, batch limits, threads, speculation); every
other field does, or identifies the output.  A receipt holds no time stamps:
the same request on the same model and class gives the same receipt apart
from those fields.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

import tpguide
from tpguide.engine.request import Request, RequestOutput
from tpguide.guided.guide_hash import guide_hash
from tpguide.guided.schema_keywords import unenforced_keywords

__all__ = ["NOT_AFFECTING_BITS", "RECEIPT_VERSION", "ReceiptContext", "build_receipt", "engine_section",
           "logprobs_hash", "request_line", "strip_not_affecting", "token_ids_hash"]

RECEIPT_VERSION = 1
#: Dotted paths of receipt fields that are recorded but do not change an output's bits.
NOT_AFFECTING_BITS = ("engine.not_affecting_bits", "enforcement.speculation")
#: Guide kinds the post-generation check validates independently (the others: the matcher's termination).
_CHECKED_KINDS = frozenset({"json_schema", "json", "regex", "choice"})


@functools.lru_cache(maxsize=None)
def git_commit() -> Optional[str]:
    """The commit of the tpguide source tree in use, or None outside a git checkout."""
    root = Path(tpguide.__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) == 40 else None


@functools.lru_cache(maxsize=None)
def package_version(name: str) -> Optional[str]:
    """The installed version of ``name``, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def engine_section(config, tp_size: int, device: torch.device, dp_size: int = 1) -> Dict[str, Any]:
    """The receipt's ``engine`` object for an engine built with ``config`` (driver, once at start-up).

    Parameters
    ----------
    config : EngineConfig
    tp_size, dp_size : int
    device : torch.device
        Where the model runs (the exactness class depends on it).
    """
    from tpguide.kernels.exactness_class import exactness_class

    dtype = str(config.dtype).removeprefix("torch.")
    isa = None
    if device.type == "cpu":
        from tpguide.kernels.fixed_order_cpu import kernel_isa

        isa = kernel_isa()
    return {
        "tpguide": tpguide.__version__, "commit": git_commit(), "torch": torch.__version__,
        "libc": " ".join(platform.libc_ver()).strip() or None,  # expf / tanhf come from it (docs/exactness.md)
        "dtype": dtype, "tp_invariant": config.tp_invariant,
        "exactness_class": exactness_class(device, config.dtype, config.tp_invariant, tp_size, isa=isa),
        "guided_backend": config.guided_backend, "json_whitespace": config.json_whitespace,
        "reasoning_parser": config.reasoning_parser, "max_model_len": config.max_model_len,
        "not_affecting_bits": {
            "tp_size": tp_size, "dp_size": dp_size, "isa": isa, "threads": torch.get_num_threads(),
            "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
            "enable_prefix_caching": config.enable_prefix_caching,
            "speculative_method": config.speculative_method,
            "num_speculative_tokens": config.num_speculative_tokens,
        },
    }


@dataclass
class ReceiptContext:
    """The constant part of every receipt of one engine: ``model`` (fingerprint) and ``engine`` sections."""

    model: Dict[str, Any]
    engine: Dict[str, Any]
    _post_checked: Dict[Any, List[Dict[str, str]]] = field(default_factory=dict, repr=False)
    _hashes: Dict[Any, str] = field(default_factory=dict, repr=False)

    def guide_hash(self, params) -> str:
        """:func:`~tpguide.guided.guide_hash.guide_hash`, cached per guide."""
        key = params.cache_key()
        if key not in self._hashes:
            if len(self._hashes) > 1024:
                self._hashes.clear()
            self._hashes[key] = guide_hash(params)
        return self._hashes[key]

    def checked_after_generation(self, params, backend_name: Optional[str]) -> List[Dict[str, str]]:
        """Keyword uses admitted but not enforced by ``backend_name`` (``strict: false``), cached per guide."""
        if params.strict or backend_name is None or params.guide_type not in ("json_schema", "regex"):
            return []
        key = (params.cache_key(), backend_name)
        if key not in self._post_checked:
            schema = (json.loads(params.guide_text) if params.guide_type == "json_schema"
                      else {"type": "string", "pattern": params.regex})
            if len(self._post_checked) > 1024:
                self._post_checked.clear()
            self._post_checked[key] = [{"pointer": p, "reason": why}
                                       for p, why in unenforced_keywords(schema, backend_name)]
        return self._post_checked[key]


def token_ids_hash(token_ids: Sequence[int]) -> str:
    """``"sha256:<hex>"`` of the ids as little-endian int64."""
    return "sha256:" + hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


def logprobs_hash(logprobs: Optional[Sequence[Dict[str, Any]]]) -> Optional[str]:
    """``"sha256:<hex>"`` of each position's token id, logprob bits and top ``(id, logprob bits)`` pairs.

    Logprobs are fp32 values carried as Python floats (exact), hashed as
    their IEEE-754 float64 bits, so one flipped bit changes the hash.  None
    when no logprobs were recorded.
    """
    if logprobs is None:
        return None
    h = hashlib.sha256()
    for entry in logprobs:
        top = entry.get("top") or []
        h.update(struct.pack("<qdq", entry["token_id"], entry["logprob"], len(top)))
        for tid, lp in top:
            h.update(struct.pack("<qd", tid, lp))
    return "sha256:" + h.hexdigest()


def structured_output_line(params) -> Optional[Dict[str, Any]]:
    """A request line's ``structured_output`` object for ``params`` (None: unguided)."""
    if params is None:
        return None
    kind = params.guide_key
    value: Any = getattr(params, kind)
    if kind in ("json", "structural_tag"):
        value = json.loads(params.guide_text)
    elif kind == "choice":
        value = list(value)
    out: Dict[str, Any] = {kind: value}
    if not params.strict:
        out["strict"] = False
    if params.json_whitespace is not None:
        out["json_whitespace"] = params.json_whitespace
    return out


def _sampling(req: Request) -> Dict[str, Any]:
    sp = req.sampling_params
    return {"max_tokens": sp.max_tokens, "temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p,
            "seed": req.seed, "seed_given": sp.seed is not None, "logprobs": sp.logprobs,
            "prompt_logprobs": sp.prompt_logprobs, "ignore_eos": sp.ignore_eos, "stop": list(sp.stop),
            "presence_penalty": sp.presence_penalty, "frequency_penalty": sp.frequency_penalty,
            "repetition_penalty": sp.repetition_penalty,
            "logit_bias": {str(t): b for t, b in sp.logit_bias},
            "thinking_token_budget": sp.thinking_token_budget}


def request_line(req: Request) -> Dict[str, Any]:
    """``req`` as a request line (:mod:`tpguide.engine.request_io`) that parses back to the same request.

    The seed is the one given (None stays absent); the receipt's
    ``sampling.seed`` holds the one used.
    """
    sampling = _sampling(req)
    line: Dict[str, Any] = {"id": req.request_id}
    if req.messages is not None:
        line["messages"] = req.messages
        if req.chat_template_kwargs is not None:
            line["chat_template_kwargs"] = req.chat_template_kwargs
    else:
        line["prompt"] = req.prompt
    guide = structured_output_line(req.structured_output)
    if guide is not None:
        line["structured_output"] = guide
    for name, value in sampling.items():
        if name == "seed_given" or (name == "seed" and not sampling["seed_given"]):
            continue
        if value is not None:
            line[name] = value
    return line


def _guide(req: Request, ctx: ReceiptContext) -> Optional[Dict[str, Any]]:
    params = req.structured_output
    if params is None:
        return None
    backend = req.guided_backend
    return {"kind": params.guide_type, "hash": ctx.guide_hash(params), "strict": params.strict,
            "backend": backend, "backend_version": package_version(backend) if backend else None,
            "json_whitespace": params.json_whitespace_or(ctx.engine["json_whitespace"])}


def _post_check(req: Request, out: RequestOutput) -> str:
    if req.structured_output is None:
        return "unguided"
    if req.post_check is not None:
        if req.post_check == "passed" and req.structured_output.guide_type not in _CHECKED_KINDS:
            return "matcher-terminated"  # no independent checker for a grammar or structural tag
        return req.post_check
    return f"not run (finish_reason {out.finish_reason})"


def _enforcement(req: Request, out: RequestOutput, ctx: ReceiptContext, reasoning_parser) -> Dict[str, Any]:
    ids = req.output_token_ids
    answer = ids
    if req.thinks and reasoning_parser is not None:
        answer = reasoning_parser.split(ids)[1] or []
    guided = req.structured_output is not None
    return {
        "generated_tokens": len(ids),
        "reasoning_tokens": len(ids) - len(answer),  # inside the think block: no guide (docs/reasoning.md)
        "masked_tokens": len(answer) if guided else 0,
        "forced_tokens": req.num_forced_tokens,  # the mask allowed that one token id
        "post_check": _post_check(req, out),
        "checked_after_generation": (ctx.checked_after_generation(req.structured_output, req.guided_backend)
                                     if guided else []),
        "speculation": {"drafts_proposed": req.num_draft_tokens, "drafts_accepted": req.num_accepted_draft_tokens,
                        "grammar_drafts_proposed": req.num_grammar_draft_tokens,
                        "grammar_drafts_accepted": req.num_accepted_grammar_draft_tokens},
    }


def build_receipt(req: Request, out: RequestOutput, ctx: ReceiptContext, reasoning_parser=None) -> Dict[str, Any]:
    """The receipt of a finished request (see the module docstring and docs/receipts.md).

    Parameters
    ----------
    req : Request
        Finished; its output tokens, seed, backend and counters are read.
    out : RequestOutput
        Its final output (``finish_reason`` after the post-generation check).
    ctx : ReceiptContext
    reasoning_parser : ReasoningParser, optional
        Splits a thinking request's output (reasoning tokens are unconstrained).
    """
    return {
        "version": RECEIPT_VERSION,
        "model": ctx.model,
        "engine": ctx.engine,
        "input": {"num_prompt_tokens": len(req.prompt_token_ids),
                  "prompt_token_ids": token_ids_hash(req.prompt_token_ids)},
        "sampling": _sampling(req),
        "guide": _guide(req, ctx),
        "enforcement": _enforcement(req, out, ctx, reasoning_parser),
        "output": {"finish_reason": out.finish_reason, "num_tokens": len(out.token_ids),
                   "token_ids": token_ids_hash(out.token_ids), "logprobs": logprobs_hash(out.logprobs)},
    }


def strip_not_affecting(receipt: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of ``receipt`` without the fields of :data:`NOT_AFFECTING_BITS` (what must match across tp and batch)."""
    out = json.loads(json.dumps(receipt))
    for path in NOT_AFFECTING_BITS:
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return out

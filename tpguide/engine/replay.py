"""Replay: run the requests of an output file again and compare the bits (docs/receipts.md, ``launch/replay.py``).

An output line carries its request (``"request"``) and its receipt
(``"receipt"``).  :func:`replay_requests` turns the lines back into request
lines, each with the seed its receipt says was used (a request without a seed
was given one derived from its place in the file, which a replay in another
order would change).  :func:`check_compatible` refuses a replay whose model
fingerprint or exactness class differs from the receipt's, naming both
values: bits are promised only within one model and one class
(docs/exactness.md).  :func:`first_difference` compares a recorded line with
its replay position by position, token id and logprob bits.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["BITS_FIELDS", "Mismatch", "check_compatible", "config_overrides", "first_difference",
           "float_bits", "replay_requests"]

#: ``(receipt section, field)`` pairs a replay must match: the model's content and the kernel class.
BITS_FIELDS = (("model", "sha256"), ("engine", "exactness_class"))
#: Engine settings that change bits, taken from the receipt for the replay's engine.
_CONFIG_FIELDS = ("tp_invariant", "guided_backend", "json_whitespace", "reasoning_parser", "max_model_len")


@dataclass(frozen=True)
class Mismatch:
    """A field the receipt and this replay disagree on."""

    field: str
    recorded: Any
    here: Any

    def __str__(self) -> str:
        return f"{self.field} differs: recorded {self.recorded!r}, here {self.here!r}"


def float_bits(value: Optional[float]) -> Optional[str]:
    """The IEEE-754 float64 bits of ``value`` as 16 hex digits (None stays None)."""
    return None if value is None else struct.pack(">d", value).hex()


def replay_requests(lines: Sequence[Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], List[Tuple[str, str]]]:
    """The request lines to run again, and ``(id, why)`` of the output lines that cannot be replayed.

    Each request gets ``seed`` = its receipt's ``sampling.seed`` (the seed used).

    Raises
    ------
    ValueError
        Two replayable lines with the same id (a replay is matched by id).
    """
    requests, skipped, seen = [], [], set()
    for line in lines:
        rid = str(line.get("id"))
        request, receipt = line.get("request"), line.get("receipt")
        if not isinstance(request, dict) or not isinstance(receipt, dict):
            skipped.append((rid, "no request or receipt in the line (a request line that did not parse, or an "
                                 "output written before receipts)"))
            continue
        if rid in seen:
            raise ValueError(f"request id {rid!r} appears twice in the output file; replay matches lines by id")
        seen.add(rid)
        requests.append({**request, "seed": receipt["sampling"]["seed"]})
    return requests, skipped


def _get(receipt: Dict[str, Any], section: str, name: str) -> Any:
    part = receipt.get(section)
    return part.get(name) if isinstance(part, dict) else None


def check_compatible(receipts: Sequence[Dict[str, Any]], here: Dict[str, Dict[str, Any]]) -> List[Mismatch]:
    """Each :data:`BITS_FIELDS` value where a receipt differs from ``here`` (each distinct pair once).

    Parameters
    ----------
    receipts : sequence of dict
        The recorded receipts.
    here : dict
        ``{"model": {"sha256": ...}, "engine": {"exactness_class": ...}}`` of this replay.
    """
    found: List[Mismatch] = []
    for receipt in receipts:
        for section, name in BITS_FIELDS:
            m = Mismatch(f"{section}.{name}", _get(receipt, section, name), _get(here, section, name))
            if m.recorded != m.here and m not in found:
                found.append(m)
    return found


def config_overrides(receipts: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Engine settings that change bits, as :class:`~tpguide.engine.config.EngineConfig` keywords.

    Raises
    ------
    ValueError
        The receipts disagree on one (the file mixes runs of different engines).
    """
    import torch

    out: Dict[str, Any] = {}
    for name in ("dtype", *_CONFIG_FIELDS):
        values = {repr(_get(r, "engine", name)) for r in receipts}
        if len(values) > 1:
            raise ValueError(f"the receipts disagree on engine.{name}: {sorted(values)}; replay one run at a time")
    if receipts:
        engine = receipts[0]["engine"]
        out = {name: engine[name] for name in _CONFIG_FIELDS if name in engine}
        out["dtype"] = getattr(torch, engine["dtype"])
    return out


def _logprob(line: Dict[str, Any], i: int) -> Optional[float]:
    logprobs = line.get("logprobs")
    return logprobs[i]["logprob"] if logprobs is not None and i < len(logprobs) else None


def _entry_bits(line: Dict[str, Any], i: int) -> Optional[tuple]:
    logprobs = line.get("logprobs")
    if logprobs is None or i >= len(logprobs):
        return None
    e = logprobs[i]
    return (float_bits(e["logprob"]),) + tuple((tid, float_bits(lp)) for tid, lp in e.get("top") or [])


def first_difference(recorded: Dict[str, Any], replayed: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The first position where ``replayed`` differs from ``recorded``, or None when they are identical.

    Compared per position: the token id, then (where the recording has
    logprobs) the logprob's bits and the top entries' ids and bits.  A
    length difference differs at the shorter one's end (its token None).
    Identical tokens with another ``finish_reason`` differ at position -1.

    Returns
    -------
    dict or None
        ``{"index", "recorded_token", "replayed_token", "recorded_logprob",
        "replayed_logprob", "recorded_bits", "replayed_bits"}`` (bits as 16 hex
        digits of the float64), plus ``"recorded_top"`` / ``"replayed_top"``
        (``[[id, bits], ...]``) when only a top alternative differs.
    """
    a, b = recorded.get("token_ids") or [], replayed.get("token_ids") or []
    for i in range(max(len(a), len(b))):
        ta = a[i] if i < len(a) else None
        tb = b[i] if i < len(b) else None
        if ta != tb or (recorded.get("logprobs") is not None and _entry_bits(recorded, i) != _entry_bits(replayed, i)):
            la, lb = _logprob(recorded, i), _logprob(replayed, i)
            found = {"index": i, "recorded_token": ta, "replayed_token": tb, "recorded_logprob": la,
                     "replayed_logprob": lb, "recorded_bits": float_bits(la), "replayed_bits": float_bits(lb)}
            top_a, top_b = (_entry_bits(line, i) for line in (recorded, replayed))
            if ta == tb and found["recorded_bits"] == found["replayed_bits"] and top_a != top_b:
                # only a top alternative differs: name it (id and bits on both sides)
                found["recorded_top"], found["replayed_top"] = (list(t[1:]) if t else None for t in (top_a, top_b))
            return found
    if recorded.get("finish_reason") != replayed.get("finish_reason"):
        return {"index": -1, "recorded_token": None, "replayed_token": None, "recorded_logprob": None,
                "replayed_logprob": None, "recorded_bits": None, "replayed_bits": None,
                "recorded_finish_reason": recorded.get("finish_reason"),
                "replayed_finish_reason": replayed.get("finish_reason")}
    return None


# ------------------------------------------------------------------ the whole replay

#: Batch compositions of a replay: the requests' order, and ``one`` request at a time.
BATCH_MODES = ("input", "reverse", "shuffle", "one")


def _flatten(node: Any, prefix: str = "") -> Dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix: node}
    out: Dict[str, Any] = {}
    for key, value in node.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


def receipt_differences(recorded: Dict[str, Any], replayed: Dict[str, Any]) -> List[str]:
    """Dotted paths where two receipts differ, the fields of ``NOT_AFFECTING_BITS`` left out.

    ``sampling.seed_given`` is left out too: a replay always gives the seed the recording used.
    """
    from tpguide.engine.receipt import strip_not_affecting

    a, b = _flatten(strip_not_affecting(recorded)), _flatten(strip_not_affecting(replayed))
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k != "sampling.seed_given")


def order_requests(requests: List[Dict[str, Any]], batch: str) -> List[Dict[str, Any]]:
    """``requests`` in the order of ``batch`` (:data:`BATCH_MODES`; ``shuffle`` is seeded, the same every time)."""
    import random

    if batch not in BATCH_MODES:
        raise ValueError(f"batch must be one of {list(BATCH_MODES)}, got {batch!r}")
    if batch == "reverse":
        return requests[::-1]
    if batch == "shuffle":
        shuffled = list(requests)
        random.Random(0).shuffle(shuffled)
        return shuffled
    return list(requests)


def replay_lines(lines: Sequence[Dict[str, Any]], model_dir: str, tp_size: int = 1, batch: str = "input",
                 force: bool = False, **config_kwargs: Any) -> Dict[str, Any]:
    """Replay the output ``lines`` on ``tp_size`` ranks (gloo, spawned here at ``tp_size`` > 1) and compare.

    Parameters
    ----------
    lines : sequence of dict
        Decoded output lines (with ``request`` and ``receipt``).
    model_dir : str
        The model to replay on (a Hugging Face directory).
    batch : str
        One of :data:`BATCH_MODES`.
    force : bool
        Run even when the model fingerprint or exactness class differs.
    **config_kwargs
        Further :class:`~tpguide.engine.config.EngineConfig` limits (``max_num_seqs``, ...).

    Returns
    -------
    dict
        ``{"refused": [str] | None, "mismatches": [str], "results": [{"id", "identical", "difference",
        "receipt_differences"}], "skipped": [[id, why]]}``; ``refused`` lists both values of each
        mismatch when the replay did not run.
    """
    from transformers import AutoTokenizer

    from tpguide.dist import TPGroup
    from tpguide.dist.spawn import run_on_ranks
    from tpguide.engine.config import EngineConfig
    from tpguide.engine.model_fingerprint import model_fingerprint
    from tpguide.engine.offline import generate_on_group
    from tpguide.kernels.exactness_class import exactness_class

    requests, skipped = replay_requests(lines)
    by_id = {str(line.get("id")): line for line in lines}
    receipts = [by_id[r["id"]]["receipt"] for r in requests]
    overrides = config_overrides(receipts)
    import torch

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    here = {"model": model_fingerprint(model_dir, AutoTokenizer.from_pretrained(model_dir).chat_template),
            "engine": {"exactness_class": exactness_class(device, overrides.get("dtype", torch.float32),
                                                          overrides.get("tp_invariant", True), tp_size)}}
    mismatches = [str(m) for m in check_compatible(receipts, here)]
    report: Dict[str, Any] = {"refused": None, "mismatches": mismatches, "results": [],
                              "skipped": [list(s) for s in skipped]}
    if mismatches and not force:
        report["refused"] = mismatches
        return report
    if batch == "one":
        config_kwargs["max_num_seqs"] = 1
    config = EngineConfig(**{**config_kwargs, **overrides})
    ordered = order_requests(requests, batch)
    if tp_size == 1:
        outputs = generate_on_group(TPGroup(), model_dir, ordered, config)
    else:
        outputs = run_on_ranks(generate_on_group, tp_size, model_dir, ordered, config)[0]
    replayed = {o["id"]: o for o in outputs}
    for request in requests:
        rid = request["id"]
        recorded, again = by_id[rid], replayed[rid]
        diff = first_difference(recorded, again)
        report["results"].append({"id": rid, "identical": diff is None, "difference": diff,
                                  "receipt_differences": receipt_differences(recorded["receipt"],
                                                                             again.get("receipt") or {})})
    return report

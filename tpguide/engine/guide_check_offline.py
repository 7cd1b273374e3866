"""``launch/generate.py --check-guides``: admit every request's guide without loading the weights (docs/receipts.md).

:func:`guide_backend` builds the grammar backend generation would build
(:meth:`~tpguide.engine.driver.Driver.guided_decoder`: the tokenizer, the
padded vocabulary of tp 1, every stop id, ``--guided-backend`` and
``--json-whitespace``) from the model directory's tokenizer and config
alone; :func:`check_request_lines` runs
:func:`~tpguide.guided.guide_check.check_guide` on each request line's
``structured_output``.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterable, List, Optional

from tpguide.guided.guide_check import check_guide

__all__ = ["check_request_lines", "guide_backend"]


def guide_backend(model_dir: str, guided_backend: str, json_whitespace: str):
    """The backend generation builds for ``model_dir`` (no weights loaded).

    Raises
    ------
    ValueError
        The tokenizer or config cannot be read, or no backend can use the tokenizer.
    """
    from transformers import AutoTokenizer

    from tpguide.guided import make_backend
    from tpguide.model.config import ModelConfig
    from tpguide.model.tokenizer_facts import collect_stop_token_ids
    from tpguide.model.vocab_shard import pad_vocab_size

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    padded = pad_vocab_size(ModelConfig.from_pretrained(model_dir).org_vocab_size, 1)
    stop_ids = sorted(collect_stop_token_ids(tokenizer, model_dir))
    return make_backend(guided_backend, tokenizer, padded, stop_ids, json_whitespace=json_whitespace)


def check_request_lines(lines: Iterable[str], backend, json_whitespace: str,
                        compile_timeout_s: Optional[float] = None) -> List[Dict[str, Any]]:
    """One report per non-blank request line: ``{"id", "guided", **check_guide's report}``.

    ``compile_timeout_s``: ``--grammar-compile-timeout`` (a guide slower to admit is refused, as in generation).

    A line without ``structured_output`` reports ``"guided": false`` (nothing
    to admit); a line that is not a JSON object reports the parse error.
    """
    from tpguide.guided.compile_service import CompileService

    compiles = CompileService(compile_timeout_s) if compile_timeout_s is not None else None
    reports: List[Dict[str, Any]] = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            reports.append({"id": str(len(reports)), "guided": None, "admitted": False,
                            "error": f"bad request line {number}: not valid JSON: {exc}"})
            continue
        rid = str(obj.get("id", len(reports))) if isinstance(obj, dict) else str(len(reports))
        guide = obj.get("structured_output") if isinstance(obj, dict) else None
        if guide is None:
            reports.append({"id": rid, "guided": False})
            continue
        reports.append({"id": rid, "guided": True, **check_guide(backend, guide, json_whitespace, compiles)})
    return reports

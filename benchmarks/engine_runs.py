"""Request sets and in-process engine runs shared by the GPU scripts (gpu_exactness.py, bench_gpu.py).

* :func:`json_schema_requests`: the fixtures' JSON-schema chat requests, cycled to N rows;
* :func:`demo_request_dicts`: ``launch/generate.py``'s built-in demo;
* :func:`shared_model_loads`: engines built inside it load each (model, dtype, mode) once and
  share the weights; every engine still has its own KV pool, prefix cache, scheduler and runner;
* :func:`run_engine`: one fresh engine, one ``generate`` call, its output lines and wall time;
* :func:`invalid_outputs`: rows that finished with an invalid guided output (the driver turns
  those into ``finish_reason`` ``"error"``, docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

#: The vLLM fixtures beside the checkout (absent on a GPU machine: pass a copy with --requests).
DEFAULT_FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "bench-data" / "vllm_fixtures.jsonl"

#: ``validate_output``'s messages (tpguide/guided/schema_check.py) all start so.
_INVALID_PREFIX = "output "


def json_schema_requests(path: str | Path, rows: Optional[int], max_tokens: int, logprobs: Optional[int] = None,
                         keep: Optional[Sequence[str]] = None) -> List[dict]:
    """The requests of ``path`` guided by a JSON schema (``structured_output.json``), cycled to ``rows``.

    ``rows`` None: each once.
    Greedy (``temperature`` 0), ``max_tokens`` set on each; a repeated
    request gets the id ``<id>#<k>`` (k = 1, 2, ...).  ``keep``: only these
    ids of the file (e.g. the schemas a peer can compile).  ``logprobs``:
    asked on every row when not None.

    Raises ``FileNotFoundError`` naming ``path``; ``ValueError`` if it has
    no JSON-schema request or ``rows`` < 1.
    """
    if rows is not None and rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"requests file {path} does not exist (copy ../shared/bench-data/"
                                f"vllm_fixtures.jsonl there, or pass --requests)")
    base = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        guide = r.get("structured_output") or {}
        if "json" in guide and (keep is None or r["id"] in keep):
            base.append(r)
    if not base:
        raise ValueError(f"{path} has no JSON-schema request (structured_output.json)"
                         + (f" among the ids {sorted(keep)}" if keep is not None else ""))
    out = []
    for i in range(len(base) if rows is None else rows):
        r = dict(base[i % len(base)], max_tokens=max_tokens, temperature=0.0)
        if i >= len(base):
            r["id"] = f"{r['id']}#{i // len(base)}"
        if logprobs is not None:
            r["logprobs"] = logprobs
        out.append(r)
    return out


def demo_request_dicts(max_tokens: int, logprobs: Optional[int] = None) -> List[dict]:
    """``launch/generate.py``'s demo requests (every guide type, one unguided, one seeded sampled)."""
    from tpguide.engine.demo_requests import DEMO_REQUESTS

    extra = {"max_tokens": max_tokens, **({"logprobs": logprobs} if logprobs is not None else {})}
    return [dict(r, **extra) for r in DEMO_REQUESTS]


#: KV pool per engine on CUDA (the CLI's default, a share of the free memory, would shrink while the
#: previous engine's pool is still allocated on the shared model); ample for 128 rows of 2048 tokens.
CUDA_KV_CACHE_MEMORY = 4 * 2**30

#: ``"config: reason"`` of every :func:`run_engine` whose CUDA fast path turned itself off
#: (tpguide/worker/fast_path_check.py): its outputs and times are the plain eager step's.
FAST_PATH_FALLBACKS: List[str] = []


def set_bench_defaults(parser) -> None:
    """Defaults of the engine flags (``tpguide/cli/engine_flags.py``) in these scripts.

    ``--max-num-seqs`` None: the script uses the number of rows (one batch);
    ``--kv-cache-memory`` :data:`CUDA_KV_CACHE_MEMORY` on CUDA (the pool's
    size changes no output bit, only when requests would be preempted).
    """
    import torch

    parser.set_defaults(max_num_seqs=None,
                        kv_cache_memory=CUDA_KV_CACHE_MEMORY if torch.cuda.is_available() else None)


def warm_up_variant(dicts: List[dict]) -> List[dict]:
    """The same requests with other prompts (``(warm-up)`` before each last message), other ids.

    A warm-up with the same shapes that leaves nothing in the prefix cache
    that the timed run could reuse beyond the chat template's header.
    """
    out = []
    for r in dicts:
        messages = [dict(m) for m in r["messages"]]
        messages[-1]["content"] = "(warm-up) " + messages[-1]["content"]
        out.append(dict(r, id=f"warm-up/{r['id']}", messages=messages))
    return out


@contextlib.contextmanager
def shared_model_loads(enabled: bool = True) -> Iterator[Dict[tuple, object]]:
    """Inside: ``build_engine`` loads a (model dir, rank, dtype, tp_invariant) once; yields the cache.

    ``tpguide.engine.build_engine`` imports ``load_model`` when called, so
    patching the loader module's attribute reaches it.  Each engine then
    allocates its own KV pool on the shared model (``start_engine``, tpguide/engine/startup.py).
    ``enabled=False``: a no-op (every engine loads its weights).
    """
    from tpguide.model import loader

    cache: Dict[tuple, object] = {}
    if not enabled:
        yield cache
        return
    original = loader.load_model

    def load_once(model_dir, group, dtype, **kwargs):
        key = (str(model_dir), group.tp_size, group.tp_rank, dtype, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = original(model_dir, group, dtype, **kwargs)
        return cache[key]

    loader.load_model = load_once
    try:
        yield cache
    finally:
        loader.load_model = original


def run_engine(model_dir: Optional[str], config, dicts: List[dict], default_max_tokens: int = 64,
               warm_up: Optional[List[dict]] = None) -> Tuple[List[dict], float]:
    """Build a fresh engine (tp 1), run ``warm_up`` if given, then time one ``generate`` of ``dicts``.

    Returns the output lines (:meth:`RequestOutput.to_json`, input order) and
    the wall seconds of the timed ``generate`` (on CUDA up to a synchronize).
    A run whose CUDA fast path turned itself off is added to
    :data:`FAST_PATH_FALLBACKS`.
    """
    import torch

    from tpguide.dist import TPGroup
    from tpguide.engine import build_engine
    from tpguide.engine.request_io import parse_request_lines

    engine = build_engine(TPGroup(), model_dir, config)
    try:
        if warm_up:
            engine.generate(parse_request_lines([json.dumps(r) for r in warm_up], default_max_tokens))
        requests = parse_request_lines([json.dumps(r) for r in dicts], default_max_tokens)
        start = time.perf_counter()
        outputs = engine.generate(requests)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        reason = getattr(engine.runner, "fast_path_off_reason", "")
        if reason:
            FAST_PATH_FALLBACKS.append(f"{config}: {reason}")
    finally:
        engine.shutdown()
    return [o.to_json() for o in outputs], wall


def invalid_outputs(outputs: List[dict]) -> List[str]:
    """``"id: message"`` of each output that failed its guide's validation (finish_reason ``"error"``)."""
    return [f"{o['id']}: {o['error']}" for o in outputs
            if o.get("finish_reason") == "error" and str(o.get("error") or "").startswith(_INVALID_PREFIX)]

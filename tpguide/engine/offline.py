"""The offline run on a TP group: request lines in, output lines out, on every rank (the multi-rank tests' entry).

:func:`generate_on_group` builds the engine (:mod:`tpguide.engine.startup`),
runs :meth:`~tpguide.engine.engine.Engine.generate` on the driver and
:meth:`~tpguide.engine.engine.Engine.run_worker` elsewhere, and broadcasts
the driver's output lines.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.engine.config import EngineConfig
from tpguide.engine.request import RequestOutput
from tpguide.engine.request_io import parse_request_lines
from tpguide.engine.startup import build_engine

__all__ = ["generate_on_group"]


def generate_on_group(group: TPGroup, model_dir: Optional[str], request_dicts: Sequence[Dict[str, Any]],
                      config: EngineConfig, default_max_tokens: int = 64) -> List[Dict[str, Any]]:
    """Run ``request_dicts`` on the group; every rank returns the driver's outputs.

    Returns
    -------
    list of dict
        One output line (:meth:`RequestOutput.to_json`) per request, input order.
    """
    engine = build_engine(group, model_dir, config)
    outputs: Optional[List[RequestOutput]] = None
    if group.is_driver:
        requests = parse_request_lines([json.dumps(r) for r in request_dicts], default_max_tokens)
        outputs = [o.to_json() for o in engine.generate(requests)]
        engine.shutdown()
    else:
        engine.run_worker()
    return C.broadcast_object(outputs, group)

"""The driver side and the engine API: requests, admission, scheduler, step planning and finishing, outputs.

Runs on tp_rank 0 (the driver) only, except :class:`Engine` itself, which
every rank builds (non-driver ranks call :meth:`Engine.run_worker`).  The
every-rank step execution lives in :mod:`tpguide.worker`, the sampling
mathematics in :mod:`tpguide.sampling`, speculative decoding in
:mod:`tpguide.speculative`.
"""

from tpguide.engine.engine import Engine, EngineConfig, build_engine
from tpguide.engine.request import Request, RequestOutput

__all__ = ["Engine", "EngineConfig", "Request", "RequestOutput", "build_engine"]

"""The driver side and the engine API: requests, admission, scheduler, step planning and finishing, outputs.

Runs on tp_rank 0 (the driver) only, except :class:`Engine` itself, which
every rank builds (non-driver ranks call :meth:`Engine.run_worker`).  The
every-rank step execution lives in :mod:`tpguide.worker`, the sampling
mathematics in :mod:`tpguide.sampling`, speculative decoding in
:mod:`tpguide.speculative`.  This package's names below are the engine API:
``serving/`` and ``launch/`` reach the driver only through :class:`Engine`
(never ``engine.driver``, ``tests/test_dependency_direction.py``); besides
these they use the request-line helpers (:mod:`tpguide.engine.request_io`),
the data-parallel front end (:mod:`tpguide.engine.data_parallel`) and the
demo requests.
"""

from tpguide.engine.config import EngineConfig, step_capacity
from tpguide.engine.engine import Engine
from tpguide.engine.offline import generate_on_group
from tpguide.engine.request import Request, RequestOutput
from tpguide.engine.startup import build_engine

__all__ = ["Engine", "EngineConfig", "Request", "RequestOutput", "build_engine", "generate_on_group",
           "step_capacity"]

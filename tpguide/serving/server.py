"""Assemble the server's state on rank 0: engine loop(s), metrics, tokenizer, guide precompilation.

Data parallel (docs/architecture.md §1 "Data parallel"): one loop per
replica behind a :class:`~tpguide.serving.dp_frontend.ReplicaRouter`.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Dict, Optional

from tpguide.serving.app import ServerState
from tpguide.serving.engine_loop import EngineLoop
from tpguide.serving.metrics import ServerMetrics
from tpguide.serving.tool_formats import ToolSetup


def make_precompile(engine, metrics: ServerMetrics):
    """``precompile(line)``: compile the line's guide into the driver's grammar cache (worker thread).

    The compile cache is shared with the engine and locked, so the engine
    loop finds the grammar compiled when the request joins the batch and
    the other requests keep stepping meanwhile.  Records compile time and
    cache hits.  Raises ValueError with the reason on a refused or bad guide
    (:func:`tpguide.guided.admission.admit`).
    """
    from tpguide.guided import StructuredOutputsParams
    from tpguide.guided.admission import admit

    backend = engine.guided_backend()  # built now (before any request), not raced later

    def precompile(line: Dict[str, Any]) -> None:
        params = StructuredOutputsParams.from_request(line.get("structured_output"))
        if params is None:
            return
        hit = backend.is_cached(params)
        start = time.perf_counter()
        admit(backend, params)  # the fail-closed checks and the compile: a refusal is a 400 with its reason
        if hit:
            metrics.grammar_cache_hits.inc()
        else:
            metrics.grammar_compile.observe(time.perf_counter() - start)
            metrics.grammar_cache_misses.inc()

    return precompile


def make_guide_check(engine, config):
    """``check(structured_output) -> report`` for ``POST /v1/guides/check``: the engine's own admission.

    :func:`tpguide.guided.guide_check.check_guide` on the engine's backend
    (the one generation admits with; its compile cache is shared, so a checked
    guide is compiled when a request uses it), under ``--grammar-compile-timeout``.
    """
    from tpguide.guided.compile_service import CompileService
    from tpguide.guided.guide_check import check_guide

    backend = engine.guided_backend()
    compiles = CompileService(config.grammar_compile_timeout_s)  # generation's limit, and its message
    one_at_a_time = threading.Lock()  # a compile service hands every finished job to whoever collects

    def check(structured_output):
        with one_at_a_time:
            return check_guide(backend, structured_output, config.json_whitespace, compiles)

    return check


def make_server_state(engine, config, *, served_model_name: str, api_key, max_waiting_requests: int,
                      max_body_bytes: int, default_max_tokens: int, heartbeat_s: float,
                      tool_format: ToolSetup, channels: Optional[Dict[int, Any]] = None, tp_size: int = 1,
                      on_leave: Optional[Callable[[str], None]] = None) -> ServerState:
    """The :class:`ServerState` of rank 0 (the engine loop is built, not started).

    ``precompile`` is None: set it with :func:`make_precompile` after the
    loop has started, so that the other ranks get heartbeats while the
    grammar backend is built (seconds).  ``channels`` (data parallel: the
    remote replicas' control channels by ``dp_rank``, ranks per replica
    ``tp_size``) makes the state's loop a router over every replica;
    ``on_leave(reason)`` runs when a remote replica asks to end the job.
    The queue limit (``--max-num-seqs`` + ``--max-waiting-requests``) then
    counts per replica.
    """
    metrics = ServerMetrics(served_model_name)
    if channels:
        from tpguide.dist.replicas import describe_replica
        from tpguide.serving.dp_frontend import ReplicaRouter
        from tpguide.serving.remote_engine import RemoteEngine

        loops = [EngineLoop(engine, metrics, config.max_num_seqs, heartbeat_s, replica=0,
                            replica_name=describe_replica(0, tp_size))]
        loops += [EngineLoop(RemoteEngine(channels[d], on_leave), metrics, config.max_num_seqs, heartbeat_s,
                             replica=d, replica_name=describe_replica(d, tp_size)) for d in sorted(channels)]
        loop = ReplicaRouter(loops, metrics)
        dp_size = len(loops)
    else:
        loop = EngineLoop(engine, metrics, config.max_num_seqs, heartbeat_s)
        dp_size = 1
    return ServerState(loop=loop, tokenizer=engine.tokenizer, served_model_name=served_model_name,
                       metrics=metrics, max_num_seqs=config.max_num_seqs * dp_size,
                       max_waiting_requests=max_waiting_requests * dp_size, default_max_tokens=default_max_tokens,
                       max_model_len=config.max_model_len, guided_backend=config.guided_backend,
                       api_key=api_key, max_body_bytes=max_body_bytes, tool_format=tool_format)


def exit_when_engine_dies(state: ServerState, server, poll_s: float = 0.2) -> threading.Thread:
    """Start a thread that stops ``server`` (a ``uvicorn.Server``) once the engine loop has died.

    A dead loop answers every request 503 while the process keeps its port,
    so a supervisor would never restart it.  Once ``state.loop.alive`` turns
    False without a shutdown under way, this sets ``server.should_exit``:
    uvicorn stops within its graceful-shutdown time and ``launch/serve.py``
    exits 1, naming the loop's error.  Data parallel: the router is alive
    while any replica is (a dead replica's requests go to the others).
    """
    def watch() -> None:
        while not server.should_exit:
            if not state.loop.alive and not state.shutting_down:
                print(f"[rank 0] the engine loop died ({state.loop.error}): stopping the server, exit 1",
                      file=sys.stderr, flush=True)
                state.shutting_down = True
                server.should_exit = True
                return
            time.sleep(poll_s)

    thread = threading.Thread(target=watch, name="engine-watch", daemon=True)
    thread.start()
    return thread

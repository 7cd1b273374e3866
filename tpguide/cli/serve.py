"""An OpenAI-compatible server on a tensor-parallel group.

    torchrun --nproc-per-node N launch/serve.py [--model DIR] [--host 127.0.0.1]
        [--port 8000] [--served-model-name NAME] [--api-key KEY] [engine flags]
    python launch/serve.py          # tp 1, the embedded model, loopback only
    tpguide serve [...]             # the same from an installed package
    torchrun --nproc-per-node N -m tpguide.serve [...]

Rank 0 runs the HTTP server (FastAPI + uvicorn) and exactly one thread that
steps the engine (the only thread that issues collectives); the other ranks
follow its plans.  While idle, rank 0 sends a heartbeat every
``--heartbeat-interval`` seconds, so the waiting ranks never reach
``--collective-timeout``; a dead rank fails the next heartbeat.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/responses`` (and ``GET /v1/responses/{id}``), ``POST /tokenize``,
``POST /detokenize``, ``GET /v1/models``, ``GET /health`` (503 once the engine loop is dead),
``GET /metrics`` (Prometheus), ``POST /v1/guides/check`` (admits guides without
generating; receipts with ``"return_receipt": true`` or ``--return-receipts``,
docs/receipts.md).  See docs/serving.md.  Tool calls are
written in the model's own call format (``--tool-call-parser``, default
``auto``; docs/tool-calls.md).

SIGINT or SIGTERM (to rank 0 or to torchrun, which forwards it): stop
accepting requests, abort the running ones, send the stop plan, every rank
exits 0 (within 10 s).

Data parallel (``--data-parallel-size D`` or ``--tensor-parallel-size T``,
e.g. ``torchrun --nnodes D --nproc-per-node T --rdzv-backend c10d
--rdzv-endpoint HOST:PORT``): D replicas of T ranks; global rank 0 serves
HTTP and routes each request to the replica with the fewest outstanding
tokens; the other replicas' drivers take requests over their control
channels (docs/architecture.md §1 "Data parallel").  A signal to a remote
replica's ranks ends the whole job the same way.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Optional

from tpguide.cli.engine_flags import add_engine_flags, engine_config_from_args, set_threads
from tpguide.cli.failure_policy import run_main
from tpguide.dist import destroy_tp_group, init_tp_group
from tpguide.dist.fault_inject import FAULT_ENV, step_fault_hook
from tpguide.dist.replica_channel import open_replica_channels
from tpguide.serving.tool_formats.table import FORMATS

#: Seconds a worker rank waits after SIGINT/SIGTERM for rank 0's stop plan before it leaves anyway.
WORKER_GRACE_S = 8.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--served-model-name", default=None,
                   help="the 'model' clients must send (default: the model directory's name)")
    p.add_argument("--api-key", default=os.environ.get("TPGUIDE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default $TPGUIDE_API_KEY, else none)")
    p.add_argument("--max-waiting-requests", type=int, default=64,
                   help="requests queued beyond --max-num-seqs before new ones get 503 + Retry-After (default 64)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body; larger gets 413 (default 4 MiB)")
    p.add_argument("--heartbeat-interval", type=float, default=None,
                   help="idle seconds between heartbeat plans (default min(5, --collective-timeout / 4))")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", *FORMATS],
                   help="call format of tool calls: auto (from the model's family and chat template) or one of "
                        "hermes, qwen3, llama3_json, mistral, phi4_mini_json, qwen3_coder (docs/tool-calls.md)")
    p.add_argument("--tool-call-begin", default=None, help="hermes only: tag that opens a tool call (<tool_call>)")
    p.add_argument("--tool-call-end", default=None, help="hermes only: tag that closes a tool call (</tool_call>)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    p.add_argument("--return-receipts", action="store_true",
                   help="every answer carries each choice's receipt, as with \"return_receipt\": true "
                        "(docs/receipts.md)")
    add_engine_flags(p, default_max_new_tokens=256)
    return p.parse_args(argv)


def _on_signal_leave_after_grace(group, waiting_for: str, leaving: Optional[threading.Event] = None) -> None:
    """On SIGTERM / SIGINT: set ``leaving`` (if given) and exit 0 after ``WORKER_GRACE_S`` unless the
    orderly stop (``waiting_for``, named in the message) came first."""
    def on_signal(signum, _frame):
        if leaving is not None:
            leaving.set()

        def leave():
            print(f"[rank {group.rank}] {waiting_for} {WORKER_GRACE_S:g} s after signal {signum}; exiting",
                  file=sys.stderr, flush=True)
            os._exit(0)

        timer = threading.Timer(WORKER_GRACE_S, leave)
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def _serve_worker(engine, group) -> int:
    """A non-driver rank: follow plans; on a signal wait for the stop plan, leave after a grace period."""
    _on_signal_leave_after_grace(group, "no stop plan")
    engine.run_worker()
    destroy_tp_group(group)
    print(f"[rank {group.rank}] stopped; exit 0", file=sys.stderr, flush=True)
    return 0


def _serve_replica(engine, group, channel, heartbeat_s: float) -> int:
    """A remote replica's driver: serve the front end's requests; on a signal ask it to end the job."""
    from tpguide.serving.replica_server import serve_replica

    leaving = threading.Event()
    _on_signal_leave_after_grace(group, "no stop from the front end", leaving)
    serve_replica(engine, channel, heartbeat_s, leaving)
    destroy_tp_group(group)
    print(f"[rank {group.rank}] stopped; exit 0", file=sys.stderr, flush=True)
    return 0


def _end_the_job_once():
    """``on_leave(reason)`` for the front end: a remote replica got a signal, so stop as on SIGTERM (once)."""
    fired = []

    def on_leave(reason: str) -> None:
        if not fired:
            fired.append(reason)
            print(f"[rank 0] {reason}: stopping the job", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)

    return on_leave


def _served_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model:
        return os.path.basename(os.path.normpath(args.model))
    from tpguide.model.default_model import MODEL_DIRNAME

    return MODEL_DIRNAME


def main(argv=None) -> int:
    args = parse_args(argv)
    config = engine_config_from_args(args)
    heartbeat = args.heartbeat_interval or min(5.0, args.collective_timeout / 4)
    if not 0 < heartbeat < args.collective_timeout:
        raise ValueError(f"--heartbeat-interval must be in (0, --collective-timeout={args.collective_timeout:g}), "
                         f"got {heartbeat:g}")
    for name in ("max_waiting_requests", "max_body_bytes"):
        if getattr(args, name) < (0 if name == "max_waiting_requests" else 1):
            raise ValueError(f"--{name.replace('_', '-')} is out of range: {getattr(args, name)}")
    group = init_tp_group(timeout_s=args.collective_timeout, data_parallel_size=args.data_parallel_size,
                          tensor_parallel_size=args.tensor_parallel_size)
    set_threads(args, group.tp_size)
    channels = open_replica_channels(group, heartbeat, args.collective_timeout)
    from tpguide.engine import build_engine

    engine = build_engine(group, args.model, config)
    if os.environ.get(FAULT_ENV):  # deliberate rank failure for tests (tpguide/dist/fault_inject.py)
        engine.runner.on_step = step_fault_hook(group)
    if not group.is_driver:
        return _serve_worker(engine, group)
    if group.rank != 0:
        return _serve_replica(engine, group, channels[0], heartbeat)
    import uvicorn

    from tpguide.serving.server import exit_when_engine_dies, make_guide_check, make_precompile, make_server_state
    from tpguide.serving.tool_formats import choose_tool_format

    state = make_server_state(engine, config, served_model_name=_served_name(args), api_key=args.api_key,
                              max_waiting_requests=args.max_waiting_requests, max_body_bytes=args.max_body_bytes,
                              default_max_tokens=args.max_new_tokens, heartbeat_s=heartbeat,
                              tool_format=choose_tool_format(args.tool_call_parser, engine.model.config.architecture,
                                                             engine.tokenizer,
                                                             args.tool_call_begin, args.tool_call_end,
                                                             config.json_whitespace, config.guided_backend),
                              channels=channels, tp_size=group.tp_size, on_leave=_end_the_job_once())
    from tpguide.serving.app import create_app

    state.loop.start()  # heartbeats from now on
    state.precompile = make_precompile(engine, state.metrics)
    state.guide_check = make_guide_check(engine, config)  # POST /v1/guides/check (docs/receipts.md)
    state.return_receipts = args.return_receipts
    class AbortFirstServer(uvicorn.Server):
        """On the first SIGINT / SIGTERM the engine loop aborts the running requests and stops
        before uvicorn's graceful shutdown ends: their clients get answers (``finish_reason``
        ``"abort"``) while the HTTP loop still runs, instead of 500s from a closed event loop."""

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                state.shutting_down = True
                state.loop.request_stop()
            super().handle_exit(sig, frame)

    server = AbortFirstServer(uvicorn.Config(create_app(state), host=args.host, port=args.port,
                                             log_level=args.log_level, timeout_graceful_shutdown=5,
                                             limit_concurrency=None))
    exit_when_engine_dies(state, server)  # a dead loop ends the process (exit 1), not a 503 server
    dp = f" x dp_size={group.dp_size}" if group.dp_size > 1 else ""
    print(f"[rank 0] serving {state.served_model_name!r} at tp_size={group.tp_size}{dp} on "
          f"http://{args.host}:{args.port}/v1 (pid {os.getpid()})", file=sys.stderr, flush=True)
    tools = state.tool_format
    shown = "rendered by the chat template" if tools.template_tools else "in tpguide's own tool prompt"
    print(f"[rank 0] tool calls: the {tools.fmt.name} format (--tool-call-parser {args.tool_call_parser}), tools "
          f"{shown}", file=sys.stderr, flush=True)
    received = []
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal it caught on its way out:
        signal.signal(sig, lambda signum, _frame: received.append(signum))  # land here, not in the default
    try:
        server.run()  # returns after SIGINT/SIGTERM (uvicorn's handlers stop accepting, finish, return)
    finally:
        state.loop.stop()
    if state.loop.error:
        print(f"[rank 0] error: {state.loop.error}", file=sys.stderr, flush=True)
        local = getattr(state.loop, "loops", [state.loop])[0]  # data parallel: replica 0's own loop
        if local.error is None:  # another replica failed: replica 0 stopped cleanly, let its ranks leave
            destroy_tp_group(group)
        sys.stdout.flush()
        os._exit(1)
    destroy_tp_group(group)
    print(f"[rank 0] stopped ({'signal ' + str(received[0]) if received else 'server exit'}); exit 0",
          file=sys.stderr, flush=True)
    return 0


def run(argv=None) -> int:
    """:func:`main` with the failure policy of the offline CLI (:func:`tpguide.cli.failure_policy.run_main`)."""
    return run_main(main, argv)


if __name__ == "__main__":
    sys.exit(run())  # python -m tpguide.cli.serve

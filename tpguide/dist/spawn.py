"""Run a function on ``tp_size`` local CPU ranks over gloo, for tests and benchmarks.

``run_on_ranks(fn, tp_size, *args)`` starts one process per rank with the
torchrun environment variables set, so each process builds its group with the
real :func:`~tpguide.dist.group.init_tp_group`, calls ``fn(group, *args)`` and
sends back the (picklable) result; tensors travel by value.  Results come back in rank order.

Each rank is a fork of a **fork server** that imported torch and the engine
once (:data:`PRELOAD`), not a fresh interpreter: a fresh one spends about 2 s
of CPU importing them, which was a large share of the test suite's time.  The
fork server is single-threaded (it only imports), and each rank gets the
caller's current environment, working directory and ``sys.path``, as a
spawned one would.  Where the platform has no fork server, ranks are spawned.  A rank
that raises makes the call raise with that rank's traceback; a rank that
hangs past ``timeout_s`` makes it raise ``TimeoutError``.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable, List

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Modules the fork server imports once for every rank it starts (no threads, no device: imports only).
PRELOAD = ("numpy", "torch", "tpguide.engine", "tpguide.model.loader", "tpguide.dist.group")


def _context():
    """The fork server's context (preloading :data:`PRELOAD`), or spawn where there is none."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when this process first starts its server
    return ctx


def _worker(rank: int, tp_size: int, port: int, fn: Callable, args: tuple, queue, dp_size: int = 1,
            environ: dict | None = None) -> None:
    if environ is not None:  # the caller's environment now, not the fork server's from its start
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(tp_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(tp_size),
        TPGUIDE_BACKEND="gloo",
    )
    import torch

    torch.set_num_threads(1)
    from tpguide.dist.group import destroy_tp_group, init_tp_group

    try:
        group = init_tp_group(backend="gloo", timeout_s=120, data_parallel_size=dp_size)
        # plain pickle: tensors travel by value, not as shared memory that
        # would vanish when this process exits
        result = pickle.dumps(fn(group, *args))
        queue.put((rank, True, result))
        destroy_tp_group(group, barrier=False)  # a peer that raised never reaches a barrier
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_on_ranks(fn: Callable, tp_size: int, *args: Any, timeout_s: float = 300.0,
                 data_parallel_size: int = 1) -> List[Any]:
    """Call ``fn(group, *args)`` on ``tp_size`` gloo ranks; return results by rank.

    ``tp_size`` is the world size; ``data_parallel_size`` splits it into
    replicas (:mod:`tpguide.dist.replicas`).

    ``fn`` must be importable (a module-level function).  Raises
    ``RuntimeError`` naming the failing rank, or ``TimeoutError``.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, tp_size, port, fn, args, queue, data_parallel_size,
                                          dict(os.environ)), daemon=True)
        for r in range(tp_size)
    ]
    for p in procs:
        p.start()
    results: dict = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < tp_size:
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} of {tp_size} died without reporting "
                                       f"(exit codes {[procs[r].exitcode for r in dead]})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not all report within {timeout_s} s; "
                                       f"reported {sorted(results)}") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {tp_size} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(tp_size)]


def run_at_tp_size(fn: Callable, tp_size: int, *args: Any) -> List[Any]:
    """``fn(group, *args)`` per rank, results by rank: at tp 1 in this process, else :func:`run_on_ranks`.

    tp 1 runs as the product does: one plain process without ``torch.distributed``.
    """
    if tp_size == 1:
        from tpguide.dist import TPGroup

        return [fn(TPGroup(), *args)]
    return run_on_ranks(fn, tp_size, *args)

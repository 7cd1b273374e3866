"""How a launch script fails: ``[rank R] error: ...`` on stderr and exit status 1, on every rank."""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch


def in_collective(exc: BaseException) -> bool:
    """True if ``exc`` was raised inside a ``torch.distributed`` collective (a peer died, a timeout)."""
    if isinstance(exc, torch.distributed.DistError):
        return True
    return any("torch/distributed/" in frame.filename.replace(os.sep, "/")
               for frame in traceback.extract_tb(exc.__traceback__))


#: Seconds a rank waits, after printing a startup error under torchrun, before it exits.
STARTUP_ERROR_GRACE_S = 1.0


def run_main(main, argv=None) -> int:
    """``main(argv)`` with the failure policy.

    Bad input and startup errors (``ValueError``, ``FileNotFoundError``), a
    driver abort, a failed replica or control channel (data parallel) and a
    failed collective print one line; anything else
    prints its traceback first.  ``os._exit`` skips interpreter teardown,
    which could block on a process group whose peers are gone.
    """
    from tpguide.dist.replica_channel import ChannelClosed
    from tpguide.engine.data_parallel import ReplicaFailed
    from tpguide.worker.protocol import DriverAborted

    rank = os.environ.get("RANK", "0")
    try:
        return main(argv)
    except (ValueError, FileNotFoundError, DriverAborted, ReplicaFailed, ChannelClosed) as exc:
        print(f"[rank {rank}] error: {exc}", file=sys.stderr, flush=True)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # every rank meets a startup error at about the same moment; the first to exit makes
            # torchrun stop the others, so give them a moment to print their own line first
            time.sleep(STARTUP_ERROR_GRACE_S)
    except Exception as exc:  # noqa: BLE001 - every failure exits 1
        if in_collective(exc):
            first = (str(exc).strip().splitlines() or [""])[0]
            print(f"[rank {rank}] error: a collective failed: another rank died or timed out "
                  f"(torchrun's summary names the first failed rank): {type(exc).__name__}: {first}",
                  file=sys.stderr, flush=True)
        else:  # a bug: show where
            traceback.print_exc()
            print(f"[rank {rank}] error: unexpected {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)

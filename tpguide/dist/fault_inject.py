"""Deliberate fault injection for tests of rank failure (off unless the variable is set).

``TPGUIDE_FAULT_INJECT=RANK:STEP`` makes the process with global rank
``RANK`` die with ``os._exit(1)`` when it starts its ``STEP``-th engine step
(counted from 1), without cleanup, like a killed or crashed rank.  Several
faults are separated by commas.  It exists so ``tests/multigpu/test_rank_failure.py``
can kill a rank at a known point mid-generation; production runs never set it.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, List, Tuple

from tpguide.dist.group import TPGroup

FAULT_ENV = "TPGUIDE_FAULT_INJECT"


def parse_fault_spec(text: str) -> List[Tuple[int, int]]:
    """``"1:3,0:7"`` -> ``[(1, 3), (0, 7)]``.

    Raises
    ------
    ValueError
        A malformed entry (names it and the expected ``RANK:STEP`` form).
    """
    faults = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        try:
            rank, step = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"{FAULT_ENV} entries must be RANK:STEP with integers, got {item!r}") from None
        if rank < 0 or step < 1:
            raise ValueError(f"{FAULT_ENV}: rank must be >= 0 and step >= 1, got {item!r}")
        faults.append((rank, step))
    return faults


def step_fault_hook(group: TPGroup) -> Callable[[], None]:
    """A function to call at the start of every engine step on this rank.

    A no-op unless :data:`FAULT_ENV` names this rank; then it counts steps
    and exits the process at the named one (a message on stderr first).
    """
    steps = [s for r, s in parse_fault_spec(os.environ.get(FAULT_ENV, "")) if r == group.rank]
    if not steps:
        return lambda: None
    counter = [0]

    def hook() -> None:
        counter[0] += 1
        if counter[0] in steps:
            print(f"[rank {group.rank}] {FAULT_ENV}: exiting at step {counter[0]}",
                  file=sys.stderr, flush=True)
            os._exit(1)

    return hook

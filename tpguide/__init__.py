"""tpguide: a tensor-parallel worker for exact grammar-guided LLM generation.

Every rank holds a slice of every weight, including a vocabulary slice of the
LM head, and applies its own slice of the grammar's token bitmask to its own
logits shard.  See ``docs/architecture.md`` for the architecture and its invariants.
"""

import os as _os

__version__ = "0.1.0"

#: How long an idle OpenMP thread spins before it sleeps (libgomp iterations; its default is 300,000).  torch
#: and the fixed-order C kernels share torch's libgomp; with its default, threads waiting at a parallel
#: region's end spin for about a millisecond, which on a machine whose cores are busy with other work
#: takes those cores from the threads still computing.  On 2 cores beside 2 busy loops the 8 fixture
#: requests ran at 6-11 tok/s with the default and 36-40 with 10,000, the same 86-88 on an idle machine
#: (docs/benchmarks.md, "Busy machines").  libgomp reads the variable when it is loaded, so this works only
#: if tpguide is imported before torch (the launch scripts do); a value the user set, or
#: OMP_WAIT_POLICY, is kept.
GOMP_SPINCOUNT = "10000"
if "GOMP_SPINCOUNT" not in _os.environ and "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT

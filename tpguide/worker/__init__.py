"""Every rank's step execution: a plan in, a result value out.

Imports nothing from :mod:`tpguide.engine` (the driver side); the driver
imports from here.  :mod:`~tpguide.worker.protocol`: the plan, result and
message types both sides use; :mod:`~tpguide.worker.runner`: the step
execution (:mod:`~tpguide.worker.forward`: its eager forward;
:mod:`~tpguide.worker.fast_path`: its CUDA fast path, persistent buffers and
graphs); :mod:`~tpguide.worker.group_sampling`: the sampler bound to the
TP group; :mod:`~tpguide.worker.faults`: non-finite rows and what a failure
does to the other ranks.
"""

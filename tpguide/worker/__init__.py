"""Every rank's step execution: a plan in, a result value out.

Imports nothing from :mod:`tpguide.engine` (the driver side); the driver
imports from here.  :mod:`~tpguide.worker.runner` holds the plan channel's
message type, the sampler bound to the TP group and the step execution;
:mod:`~tpguide.worker.faults` diagnoses non-finite rows and says what a
failure does to the other ranks.
"""

"""Every rank's step execution: a plan in, a result value out.

Imports nothing from :mod:`tpguide.engine` (the driver side); the driver
imports from here.  :mod:`~tpguide.worker.messages` is the plan channel's
message type, :mod:`~tpguide.worker.runner` the step execution,
:mod:`~tpguide.worker.group_exchange` binds the sampler to the TP group.
"""

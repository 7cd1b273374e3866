"""Process groups, the tensor-parallel group object and thin collectives (``group.py``).

This package is the only place that calls ``torch.distributed`` or reads the
torchrun environment (house rule 1 and 2).  ``collectives`` names the module
that holds the collectives (:mod:`tpguide.dist.group`): callers write
``from tpguide.dist import collectives as C`` and ``C.broadcast_object(...)``.
"""

from tpguide.dist import group as collectives
from tpguide.dist.group import TPGroup, destroy_tp_group, init_tp_group

__all__ = ["TPGroup", "init_tp_group", "destroy_tp_group", "collectives"]

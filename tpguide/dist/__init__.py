"""Process groups, the tensor-parallel group object and its collectives (``group.py``).

This package is the only place that calls ``torch.distributed`` or reads the
torchrun environment (docs/architecture.md §1).  Callers import the
collectives from their module: ``from tpguide.dist import group as C``.
"""

from tpguide.dist.group import TPGroup, destroy_tp_group, init_tp_group

__all__ = ["TPGroup", "init_tp_group", "destroy_tp_group"]

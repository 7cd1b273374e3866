"""The :class:`~tpguide.engine.EngineConfig` that the command-line flags (``tpguide/cli/engine_flags.py``) make of argv."""

import argparse

from tpguide.cli import engine_flags as flags


def engine_config(*argv):
    """``engine_config_from_args`` of ``add_engine_flags``' parse of ``argv``."""
    p = argparse.ArgumentParser()
    flags.add_engine_flags(p)
    return flags.engine_config_from_args(p.parse_args(list(argv)))

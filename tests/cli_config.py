"""The :class:`~tpguide.engine.EngineConfig` that ``launch/engine_flags.py`` (a script beside the package) makes of argv."""

import argparse
import importlib.util
from pathlib import Path


def engine_config(*argv):
    """``engine_config_from_args`` of ``add_engine_flags``' parse of ``argv``."""
    path = Path(__file__).resolve().parents[1] / "launch" / "engine_flags.py"
    spec = importlib.util.spec_from_file_location("engine_flags", path)
    flags = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flags)
    p = argparse.ArgumentParser()
    flags.add_engine_flags(p)
    return flags.engine_config_from_args(p.parse_args(list(argv)))

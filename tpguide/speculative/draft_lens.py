"""Tuned-lens translator for the draft head: fit once on calibration text, cache on disk.

The draft head exits after layer ``L``; reading the final norm and LM head
straight off that residual ("logit lens") agrees with the target's top-1
rarely (SmolLM2-135M, ``L = 10`` of 30: 4% on held-out text).  The
*tuned lens* (Belrose et al. 2023, *Eliciting Latent Predictions from
Transformers with the Tuned Lens*, arXiv:2303.08112) puts an affine
translator between layer ``L`` and the final norm.  They train it with a KL
loss; :func:`fit_tuned_lens` fits it by ridge least squares in closed form,
from the residual after layer ``L`` to the residual after the last layer::

    A = argmin_A ||[h_L, 1] A - h_final||^2 + ridge * sum_j (X^T X)_jj ||A_j||^2

with ``X = [h_L, 1]`` and ``j`` over the weight rows only (the bias row is
not penalised).  Scaling each row's penalty by ``(X^T X)_jj`` is ridge on
features scaled to unit RMS: the residual stream has a few dimensions with
very large activations, and a single penalty sized for them over-smooths
the others (held-out agreement 0.25 instead of 0.40 at ``L = 15``).

**Ridge strength.**  :data:`DEFAULT_RIDGE` = 0.03, from a held-out check on
SmolLM2-135M-Instruct: fit on the first 80% of the built-in calibration
documents (3.9k tokens), top-1 agreement with the target on the other 20%
(at ``L`` = 5, 10, 15, 20: 0.31, 0.37, 0.40, 0.49; the logit lens: 0.04,
0.04, 0.06, 0.13), on README/DESIGN text (0.15, 0.17, 0.19, 0.25) and on
the demo's answers (0.37, 0.48, 0.50, 0.56).  Ridge 0.001 .. 0.03 are within
0.02 of each other everywhere; 0.1 loses 0.006-0.026 on the held-out
documents at every ``L`` and gains at most 0.007 elsewhere.

**Cache.**  :func:`load_or_fit_lens` keeps the fitted tensor under
``cache_root() / "draft_lens"``, keyed by :func:`lens_cache_key`.  It is a
collective: rank 0 decides "cached or not" and broadcasts the decision (so
no rank runs the calibration forward alone), rank 0 alone fits and writes,
and the tensor is broadcast, so every rank holds the same lens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple, TypeVar

import torch

from tpguide.cache import cache_root
from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.speculative.draft_lens_calibration import calibration_text, calibration_token_ids, collect_residuals

logger = logging.getLogger(__name__)

DEFAULT_RIDGE = 0.03
"""Relative ridge strength (see the module docstring for the held-out check)."""

LENS_FORMAT_VERSION = 1
"""Bumped whenever the fit or the file changes meaning; part of the cache key."""

_FINGERPRINT_BYTES = 1 << 20

T = TypeVar("T")


def fit_tuned_lens(h_layer: torch.Tensor, h_final: torch.Tensor, ridge: float = DEFAULT_RIDGE) -> torch.Tensor:
    """Affine translator ``[h_layer, 1] @ A ~= h_final`` by ridge least squares (float64 solve).

    Parameters
    ----------
    h_layer : torch.Tensor
        ``[N, H]`` (``N`` tokens, ``H`` hidden size), any float dtype: the
        residual stream after layer ``L``.
    h_final : torch.Tensor
        ``[N, H]``: the residual stream after the last layer (before the final norm).
    ridge : float
        ``>= 0``; row ``j < H`` of ``A`` is penalised by ``ridge * (X^T X)_jj``
        (module docstring).  0 is plain least squares (needs ``N >= H + 1``
        independent rows).

    Returns
    -------
    torch.Tensor
        float32 ``[H + 1, H]`` on CPU: rows ``0 .. H-1`` the weight, row ``H``
        the bias; apply as ``h_layer @ A[:-1] + A[-1]``.

    Raises
    ------
    ValueError
        Shapes differ, are not 2-D, ``N == 0``, or ``ridge < 0``.
    torch.linalg.LinAlgError
        The system is singular (``ridge == 0`` with too few or dependent rows).
    """
    if h_layer.dim() != 2 or h_layer.shape != h_final.shape or h_layer.shape[0] == 0:
        raise ValueError(f"h_layer and h_final must both be [N >= 1, H], got {tuple(h_layer.shape)} "
                         f"and {tuple(h_final.shape)}")
    if ridge < 0:
        raise ValueError(f"ridge must be >= 0, got {ridge}")
    x = h_layer.detach().cpu().double()
    x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)  # [N, H + 1]
    gram = x.T @ x  # [H + 1, H + 1]
    penalty = gram.diagonal() * ridge
    penalty[-1] = 0.0  # the bias is not shrunk
    lens = torch.linalg.solve(gram + torch.diag(penalty), x.T @ h_final.detach().cpu().double())
    return lens.float()


def lens_cache_key(model_dir: str, num_layers: int, seqs: Sequence[Sequence[int]], ridge: float,
                   dtype: torch.dtype) -> str:
    """Hex key of a lens: what changes the fitted tensor.

    Hashes the format version, ``config.json``, each ``*.safetensors`` file's
    name, size and first and last MiB (a fingerprint, not a checksum: a
    fine-tune of the same shapes changes those bytes too), ``num_layers``,
    the calibration token ids (the text through the tokenizer and its chat
    template), ``ridge`` and the model dtype of the calibration forward.
    """
    h = hashlib.sha256()
    model = Path(model_dir)
    h.update(json.dumps([LENS_FORMAT_VERSION, num_layers, ridge, str(dtype)]).encode())
    h.update((model / "config.json").read_bytes())
    for path in sorted(model.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            h.update(f.read(_FINGERPRINT_BYTES))
            f.seek(max(0, size - _FINGERPRINT_BYTES))
            h.update(f.read())
    h.update(json.dumps([list(s) for s in seqs]).encode())
    return h.hexdigest()


def lens_cache_path(key: str) -> Path:
    """``cache_root() / "draft_lens" / f"{key}.safetensors"``."""
    return cache_root() / "draft_lens" / f"{key}.safetensors"


def _read_lens(path: Path, hidden_size: int) -> Optional[torch.Tensor]:
    """The cached lens, or None when absent or unreadable (then it is fitted again and rewritten)."""
    from safetensors.torch import load_file

    if not path.is_file():
        return None
    try:
        lens = load_file(str(path))["lens"]
    except Exception as exc:  # noqa: BLE001 - a damaged cache entry is recomputed
        logger.warning("ignoring the unreadable draft lens %s: %s: %s", path, type(exc).__name__, exc)
        return None
    if lens.shape != (hidden_size + 1, hidden_size) or lens.dtype != torch.float32:
        logger.warning("ignoring the draft lens %s: shape %s, dtype %s", path, tuple(lens.shape), lens.dtype)
        return None
    return lens


def _write_lens(path: Path, lens: torch.Tensor) -> None:
    """Atomic write (temporary sibling, then rename); a failure only logs a warning."""
    from safetensors.torch import save

    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(save({"lens": lens.contiguous()}, metadata={"format_version": str(LENS_FORMAT_VERSION)}))
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        logger.warning("could not cache the draft lens at %s: %s", path, exc)


def _on_driver(group: TPGroup, fn: Callable[[], T]) -> Tuple[Optional[T], Optional[str]]:
    """``(fn(), None)`` on the driver, ``(None, error)`` if it raised; ``(None, None)`` elsewhere."""
    if not group.is_driver:
        return None, None
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised
        return None, f"{type(exc).__name__}: {exc}"


def _raise_if(error: Optional[str], group: TPGroup) -> None:
    if error is not None:
        raise ValueError(f"cannot fit the draft lens: {error}" if group.is_driver
                         else f"the driver (rank 0) failed to fit the draft lens: {error}")


def load_or_fit_lens(target, model_dir: str, num_layers: int, tokenizer=None,
                     ridge: float = DEFAULT_RIDGE) -> torch.Tensor:
    """The draft lens for ``target``'s layer ``num_layers``, from the cache or fitted now (a collective).

    On a cache miss every rank runs the built-in calibration text through
    ``target`` (:func:`~tpguide.speculative.draft_lens_calibration.collect_residuals`,
    which **replaces the KV cache**; build the Engine afterwards) and rank 0
    fits (:func:`fit_tuned_lens`) and writes the cache file.

    Parameters
    ----------
    target : LlamaForCausalLM
        This rank's shard.
    model_dir : str
        The checkpoint ``target`` was loaded from (for the cache key).
    num_layers : int
        ``L``, ``1 <= L < num_hidden_layers``.
    tokenizer : transformers tokenizer, optional
        Needed on the driver (calibration token ids and cache key); ignored elsewhere.
    ridge : float

    Returns
    -------
    torch.Tensor
        float32 ``[H + 1, H]`` on ``target.group.device``, identical on every rank.

    Raises
    ------
    ValueError
        On every rank: the driver has no tokenizer, cannot read the model
        directory, or the fit failed.
    """
    group, hidden_size = target.group, target.config.hidden_size

    def look_up():
        if tokenizer is None:
            raise ValueError("the driver needs the tokenizer")
        seqs = calibration_token_ids(tokenizer, calibration_text())
        path = lens_cache_path(lens_cache_key(model_dir, num_layers, seqs, ridge, target.dtype))
        return seqs, path, _read_lens(path, hidden_size)

    found, error = _on_driver(group, look_up)
    seqs, path, lens = found or (None, None, None)
    cached, seqs, error = C.broadcast_object((lens is not None, None if lens is not None else seqs, error), group)
    _raise_if(error, group)
    if not cached:
        if group.is_driver:
            print(f"fitting the draft head's tuned lens for layer {num_layers} on {sum(map(len, seqs))} "
                  f"calibration tokens (once per model and layer, then cached) ...", file=sys.stderr, flush=True)
        h_layer, h_final = collect_residuals(target, num_layers, seqs)
        lens, error = _on_driver(group, lambda: fit_tuned_lens(h_layer, h_final, ridge))
        _raise_if(C.broadcast_object(error, group), group)
        if group.is_driver:
            _write_lens(path, lens)
    out = lens if group.is_driver else torch.empty(hidden_size + 1, hidden_size)
    return C.broadcast_tensor(out.to(group.device).contiguous(), group)

"""Counter-based random stream: noise as a pure function of (seed, position, token id).

Sampling over vocabulary shards is TP-invariant only if every rank draws, for
each of its tokens, exactly the noise the unsharded run draws for that token
(docs/architecture.md §6).  A stateful generator cannot give that; a hash of the
counter ``(seed, sample_position, global_token_id)`` can: the noise of a token
does not depend on which rank holds it, on the shard width, on the batch
composition or on the device.

Hash: MurmurHash3 x86_32 (Austin Appleby, public domain) of the 20-byte
little-endian message ``seed_lo32, seed_hi32, position_lo32, position_hi32,
token_id`` with hash seed ``0x9E3779B9``.  The four per-row words are mixed
once per row (``[rows]``); only the token word and the finaliser run per
element.  All arithmetic is int64 with every intermediate kept in
``[0, 2**32)`` by masks: 32-bit products are assembled from 16-bit halves, so
no int64 product overflows and no right shift sees a negative number.  The
results are bit-identical on CPU and CUDA.  Streams are keyed by 32 bits of
row state: two distinct ``(seed, position)`` pairs share a noise vector with
probability ``2**-32``, harmless for sampling.

Uniforms are ``(h + 0.5) / 2**32`` in float64 (``(h >> 9) + 0.5) / 2**23`` in
float32), exactly representable and strictly inside ``(0, 1)``; Gumbel noise
is ``-log(-log(u))`` (Gumbel 1954; the Gumbel-max trick, Maddison et al. 2014),
bounded to about ``[-3.1, 22.9]``.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_HASH_SEED = 0x9E3779B9
_C1, _C2 = 0xCC9E2D51, 0x1B873593
_MESSAGE_BYTES = 20


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` without int64 overflow."""
    if c < 2**31:  # x * c < 2**63
        return (x * c) & _MASK32
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & _MASK32) | (x >> (32 - r))


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _scramble(k: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 x86_32 word scramble (depends on the word only)."""
    return _mul32(_rotl32(_mul32(k, _C1), 15), _C2)


def _fold(h: torch.Tensor, k_scrambled: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 x86_32 body step: fold a scrambled word into state ``h``."""
    h = _rotl32(h ^ k_scrambled, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _MASK32


def hash32(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """32-bit hash of ``(seed, position, token_id)`` per row and token.

    Parameters
    ----------
    seeds : Tensor, int64 [rows]
        Per-row seed; all 64 bits are used (negative seeds are fine).
    positions : Tensor, int64 [rows]
        Per-row sample position (tokens), ``>= 0``.
    token_ids : Tensor, int64 [vocab] or [rows, vocab]
        *Global* token ids, ``0 <= id < 2**32``; shared by all rows when 1-D.

    Returns
    -------
    Tensor, int64 [rows, vocab]
        Values in ``[0, 2**32)`` on ``token_ids``'s device; a new tensor.
    """
    device = token_ids.device
    seeds = seeds.to(device=device, dtype=torch.int64)
    positions = positions.to(device=device, dtype=torch.int64)
    h = torch.full_like(seeds, _HASH_SEED)
    for word in (seeds & _MASK32, (seeds >> 32) & _MASK32, positions & _MASK32, (positions >> 32) & _MASK32):
        h = _fold(h, _scramble(word))
    # the token word is scrambled on [vocab] (or [rows, vocab]) before broadcasting
    h = _fold(h.unsqueeze(-1), _scramble(token_ids.to(torch.int64) & _MASK32))  # [rows, vocab]
    return _fmix32(h ^ _MESSAGE_BYTES)


def uniform_noise(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    token_ids: torch.Tensor,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Uniforms in the open interval ``(0, 1)``, a pure function of (seed, position, token id).

    Computing over a column slice of ``token_ids`` gives exactly the same
    slice of the full result (no state, no dependence on the shard).

    Parameters
    ----------
    seeds, positions, token_ids
        As in :func:`hash32`.
    dtype : torch.float64 or torch.float32
        float64 keeps all 32 hash bits; float32 keeps the top 23.

    Returns
    -------
    Tensor, dtype [rows, vocab]

    Raises
    ------
    ValueError
        For another ``dtype``.
    """
    h = hash32(seeds, positions, token_ids)
    if dtype == torch.float64:
        return (h.to(torch.float64) + 0.5) * 2.0**-32
    if dtype == torch.float32:
        return ((h >> 9).to(torch.float64) + 0.5).mul_(2.0**-23).to(torch.float32)
    raise ValueError(f"dtype must be torch.float64 or torch.float32, got {dtype}")


def gumbel_noise(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    token_ids: torch.Tensor,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` of :func:`uniform_noise`, shape [rows, vocab].

    ``argmax(logits / T + gumbel_noise(...))`` draws a token from
    ``softmax(logits / T)`` (the Gumbel-max trick); restricted to a subset of
    tokens it draws from the renormalised distribution on that subset.
    """
    u = uniform_noise(seeds, positions, token_ids, dtype)
    return u.log_().neg_().log_().neg_()

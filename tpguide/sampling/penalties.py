"""Presence, frequency and repetition penalties and ``logit_bias``, on each rank's own logits shard.

Every penalty changes one logit as a function of that logit, its token id
and the request's history only, so a rank applies it to the token ids of
its shard ``[vocab_start_index, vocab_end_index)`` and the result is exactly
the slice of the unsharded result: identical tokens at every tp size, and
no full-logits gather.  The driver sends the penalties as a sparse list of
``(row, token id)`` entries (only tokens with a non-neutral effect), built
by :func:`build_logit_penalties`; bytes per step grow with the penalized
history, not with the vocabulary.

Per entry, in this order (vLLM's order: repetition, then frequency and
presence, and ``logit_bias`` as OpenAI adds it)::

    x = x / r if x > 0 else x * r          repetition_penalty r, token in prompt or output
    x = x - f * count - p * (count > 0)    frequency f, presence p, count = times generated
    x = x + bias                           logit_bias

``-inf`` (masked) stays ``-inf``.  Sources: OpenAI's parameter reference
(presence/frequency), CTRL (Keskar et al., 2019; repetition), vLLM's
``apply_penalties``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class LogitPenalties:
    """Sparse penalties of one step; entries are unique per ``(row, token_id)``.

    Attributes
    ----------
    rows : Tensor, int64 [E]
        Sample row of each entry.
    token_ids : Tensor, int64 [E]
        Global token id (unpadded vocabulary).
    repetition : Tensor, float32 [E]
        Divisor/multiplier (1 = none).
    additive : Tensor, float32 [E]
        ``bias - frequency * count - presence * (count > 0)``.
    host_token_ids : Tensor or None
        int64 ``[E]`` on the CPU: ``token_ids`` before :meth:`to` moved them
        (None on the original), so a rank picks its shard's entries from host
        data, without reading a device tensor back (docs/gpu.md, "Exactness on CUDA").
    """

    rows: torch.Tensor
    token_ids: torch.Tensor
    repetition: torch.Tensor
    additive: torch.Tensor
    host_token_ids: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = self.rows.shape
        for name in ("token_ids", "repetition", "additive"):
            if getattr(self, name).shape != n:
                raise ValueError(f"{name} must have shape {tuple(n)}, got {tuple(getattr(self, name).shape)}")

    @property
    def token_ids_on_host(self) -> torch.Tensor:
        """int64 ``[E]`` token ids on the CPU (:attr:`host_token_ids`, or ``token_ids`` copied back)."""
        return (self.token_ids if self.host_token_ids is None else self.host_token_ids).cpu()

    def to(self, device) -> "LogitPenalties":
        """A copy on ``device`` that keeps the token ids' CPU copy (:attr:`host_token_ids`)."""
        host = self.host_token_ids
        if host is None and self.token_ids.device.type == "cpu":
            host = self.token_ids
        # non-blocking: a blocking copy from pageable memory is a stream sync (docs/gpu.md, "Speed on CUDA")
        moved = (getattr(self, f).to(device, non_blocking=True) for f in ("rows", "token_ids", "repetition", "additive"))
        return LogitPenalties(*moved, host_token_ids=host)


def build_logit_penalties(rows: Sequence[Tuple[object, Sequence[int], Sequence[int]]]) -> "LogitPenalties | None":
    """Entries for the sample rows that have penalties (driver side, pure).

    Parameters
    ----------
    rows : sequence of (SamplingParams, prompt_token_ids, output_token_ids)
        One per sample row, in row order.

    Returns
    -------
    LogitPenalties or None
        None when no row has a penalty or a bias.
    """
    r_rows: List[int] = []
    r_ids: List[int] = []
    r_rep: List[float] = []
    r_add: List[float] = []
    for row, (sp, prompt_ids, output_ids) in enumerate(rows):
        if not sp.has_penalties:
            continue
        counts = Counter(output_ids)
        entries: Dict[int, List[float]] = {}  # token -> [repetition, additive]
        if sp.repetition_penalty != 1.0:
            for t in set(prompt_ids) | set(counts):
                entries[t] = [float(sp.repetition_penalty), 0.0]
        if sp.frequency_penalty or sp.presence_penalty:
            for t, c in counts.items():
                e = entries.setdefault(t, [1.0, 0.0])
                e[1] -= sp.frequency_penalty * c + sp.presence_penalty
        for t, b in sp.logit_bias:
            entries.setdefault(t, [1.0, 0.0])[1] += b
        for t in sorted(entries):
            r_rows.append(row)
            r_ids.append(t)
            r_rep.append(entries[t][0])
            r_add.append(entries[t][1])
    if not r_rows:
        return None
    return LogitPenalties(torch.tensor(r_rows, dtype=torch.int64), torch.tensor(r_ids, dtype=torch.int64),
                          torch.tensor(r_rep, dtype=torch.float32), torch.tensor(r_add, dtype=torch.float32))


def apply_penalties_inplace(logits: torch.Tensor, penalties: LogitPenalties, vocab_start_index: int) -> None:
    """Apply the entries that fall in this shard to ``logits`` in place.

    Parameters
    ----------
    logits : Tensor, float32 [rows, shard_width]
        This rank's logits shard; column ``j`` is token ``vocab_start_index + j``.
    penalties : LogitPenalties
        On the logits' device.
    vocab_start_index : int
        First token id of the shard.
    """
    local = penalties.token_ids_on_host - vocab_start_index  # host data: no device sync
    keep = (local >= 0) & (local < logits.shape[1])
    if not bool(keep.any()):
        return
    index = keep.nonzero().squeeze(-1).to(logits.device, non_blocking=True)  # the shard's entries, in order
    rows, cols = penalties.rows[index], penalties.token_ids[index] - vocab_start_index
    x = logits[rows, cols]
    rep = penalties.repetition[index]
    x = torch.where(x > 0, x / rep, x * rep)
    logits[rows, cols] = x + penalties.additive[index]

"""Per-row sampling parameters of one step and the sampler's output (no collectives).

Split out of :mod:`tpguide.sampling.sampler`, which explains the algorithms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from tpguide.sampling.penalties import LogitPenalties

#: Candidates per rank for rows that use top-p without top-k (first round).
TOP_P_CANDIDATES = 256
#: Factor by which the candidate count grows when a nucleus does not fit.
TOP_P_GROWTH = 8
#: Temperatures below this are greedy (vLLM's sampling epsilon).
MIN_TEMPERATURE = 1e-5
FIXED_ONE = 2.0**44  # fixed-point unit of sum_exp; 2**19 tokens * 2**44 < 2**63
MAX_VOCAB_SIZE = 2**19
ID_SPAN = 2**32
NUM_HEAD_COLS = 4  # greedy key, Gumbel score bits, Gumbel key, bad flag; then K candidate keys



@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling parameters of one step (rows = sample rows, CPU or device).

    Attributes
    ----------
    temperature : Tensor, float32 [rows]
        ``>= 0``; below :data:`MIN_TEMPERATURE` means greedy.
    top_k : Tensor, int32 [rows]
        ``0`` or ``-1`` = off; ``>= org_vocab_size`` is off too.
    top_p : Tensor, float32 [rows]
        In ``(0, 1]``; ``1`` = off.
    seeds : Tensor, int64 [rows]
        Seed of each row's request (any 64-bit value).
    sample_positions : Tensor, int64 [rows]
        Absolute position of the token each row produces (tokens, ``>= 0``).
    num_logprobs : int
        Top-n logprobs to return per row (max over the batch); 0 = none.
    penalties : LogitPenalties or None
        Sparse penalties and logit biases, applied to each rank's logits
        shard before masking and sampling (:mod:`tpguide.sampling.penalties`).
    return_logprobs : bool
        Compute :attr:`SamplerOutput.logprobs` (forced on when ``num_logprobs > 0``).
        When off and no row uses top-p alone, the log-sum-exp pass over the
        vocabulary and its all-reduce are skipped, and ``logprobs`` is NaN.

    Raises
    ------
    ValueError, TypeError
        Wrong shapes, dtypes or out-of-range values (the message names them).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    sample_positions: torch.Tensor
    num_logprobs: int = 0
    return_logprobs: bool = True
    penalties: Optional["LogitPenalties"] = None

    def __post_init__(self) -> None:
        rows = self.temperature.shape
        for name, dtypes in (("temperature", (torch.float32,)), ("top_k", (torch.int32, torch.int64)),
                             ("top_p", (torch.float32,)), ("seeds", (torch.int64,)),
                             ("sample_positions", (torch.int64,))):
            t = getattr(self, name)
            if t.dtype not in dtypes:
                raise TypeError(f"{name} must have dtype in {dtypes}, got {t.dtype}")
            if t.dim() != 1 or t.shape != rows:
                raise ValueError(f"{name} must be 1-D of shape {tuple(rows)}, got {tuple(t.shape)}")
        if not bool(((self.temperature >= 0) & torch.isfinite(self.temperature)).all()):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature.tolist()}")
        if not bool(((self.top_p > 0) & (self.top_p <= 1)).all()):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p.tolist()}")
        if not bool((self.top_k >= -1).all()):
            raise ValueError(f"top_k must be >= -1 (0 or -1 = off), got {self.top_k.tolist()}")
        if not bool((self.sample_positions >= 0).all()):
            raise ValueError(f"sample_positions must be >= 0, got {self.sample_positions.tolist()}")
        if self.num_logprobs < 0:
            raise ValueError(f"num_logprobs must be >= 0, got {self.num_logprobs}")

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    def to(self, device: torch.device | str) -> "SamplingMetadata":
        """A copy with every tensor on ``device`` (not in place)."""
        moved = {f: getattr(self, f).to(device) for f in ("temperature", "top_k", "top_p", "seeds", "sample_positions")}
        penalties = self.penalties.to(device) if self.penalties is not None else None
        return SamplingMetadata(**moved, num_logprobs=self.num_logprobs, return_logprobs=self.return_logprobs,
                                penalties=penalties)


@dataclass(frozen=True)
class SamplerOutput:
    """Sampling result, identical on every rank (same device as the logits).

    Attributes
    ----------
    token_ids : Tensor, int64 [rows]
        Sampled global token ids; ``-1`` on bad rows.
    logprobs : Tensor, float32 [rows]
        ``log_softmax(logits)`` of the sampled token (raw, see module docstring).
    top_logprob_ids, top_logprobs : Tensor, int64 / float32 [rows, num_logprobs]
        The ``num_logprobs`` most likely tokens, larger logit first, lower id on ties.
    bad_rows : Tensor, bool [rows]
        All ``-inf``, a NaN or ``+inf`` in the row, or a padded id won: fail that request.
    num_candidates : int
        Candidates gathered per rank in the last round (diagnostics; 0 = none).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_logprob_ids: torch.Tensor
    top_logprobs: torch.Tensor
    bad_rows: torch.Tensor
    num_candidates: int

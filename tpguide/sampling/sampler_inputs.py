"""Which rows of one step's hidden states are sampled, and at which positions.

A pure function of the batch metadata (docs/architecture.md §4): the driver computes it
once per step and broadcasts the result; no ``torch.distributed`` here.

The flattened batch holds ``query_len`` new tokens per scheduled sequence, in
batch order.  Row ``j`` of sequence ``i`` sits at flat row
``query_start_loc[i] + j`` and at absolute position
``num_computed_tokens + j``; its hidden state predicts the token at position
``num_computed_tokens + j + 1``.  Every "+1" and "-1" below comes from that
shift.  Example (A: whole 6-token prompt, B: whole 3-token prompt, C: decode
with two draft tokens, 9 tokens already in its KV cache)::

    flat row        0  1  2  3  4  5 | 6  7  8 | 9  10 11
    sequence        A  A  A  A  A  A | B  B  B | C  C  C
    sampled rows                   5 |       8 | 9  10 11
    sample_positions               6 |       3 | 10 11 12

Conventions:

* prefill chunk: one sample row, its last token, also for a chunk that is not
  the last one of the prompt (computed, discarded by the engine; keeps shapes
  simple) unless the sequence is marked ``exclude``;
* decode with ``k`` draft tokens: ``1 + k`` consecutive sample rows;
* prompt logprobs: ``prompt_len - 1`` rows over the whole prompt, i.e.
  ``query_len`` rows on a non-final chunk and ``query_len - 1`` on the final
  one (the last prompt token predicts the first generated token, which is the
  sample row's business);
* ``sample_positions`` is the absolute position of the token a row *produces*
  (the key of the random stream, :mod:`tpguide.sampling.random_stream`), not a
  row number, so a request replayed at the same position with the same seed
  draws the same token, with or without draft tokens.

Source: the row-selection arithmetic of DeepInfer's ``prepare_sampler_inputs``
and vLLM's ``logits_indices = query_start_loc[1:] - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class ScheduledSeq:
    """Metadata of one scheduled sequence in one step (all counts in tokens).

    Attributes
    ----------
    query_len : int
        New tokens of this sequence in the flattened batch, ``>= 1``.
    num_computed_tokens : int
        Tokens already in the KV cache before this step, i.e. the absolute
        position of this step's first new token, ``>= 0``.
    prompt_len : int
        Length of the prompt, ``>= 1``.
    is_prefill : bool
        This step's tokens are part of the prompt (a prefill chunk).
    is_last_prefill_chunk : bool
        The chunk ends the prompt (``num_computed_tokens + query_len ==
        prompt_len``); must be ``False`` for decode.
    num_draft_tokens : int
        Draft tokens ``k`` of a decode step (``query_len == 1 + k``); 0 for prefill.
    want_prompt_logprobs : bool
        The request asked for prompt logprobs (ignored on decode steps).
    exclude : bool
        Skip the sample row of a non-final prefill chunk entirely.

    Raises
    ------
    ValueError
        On inconsistent values; the message names them.
    """

    query_len: int
    num_computed_tokens: int
    prompt_len: int
    is_prefill: bool
    is_last_prefill_chunk: bool = False
    num_draft_tokens: int = 0
    want_prompt_logprobs: bool = False
    exclude: bool = False

    def __post_init__(self) -> None:
        q, nc, p, k = self.query_len, self.num_computed_tokens, self.prompt_len, self.num_draft_tokens
        where = f"(query_len={q}, num_computed_tokens={nc}, prompt_len={p}, num_draft_tokens={k})"
        if q < 1:
            raise ValueError(f"query_len must be >= 1, got {q} {where}")
        if nc < 0 or k < 0:
            raise ValueError(f"num_computed_tokens and num_draft_tokens must be >= 0 {where}")
        if p < 1:
            raise ValueError(f"prompt_len must be >= 1, got {p} {where}")
        if self.is_prefill:
            if k != 0:
                raise ValueError(f"a prefill chunk cannot carry draft tokens {where}")
            if nc + q > p:
                raise ValueError(f"prefill chunk runs past the prompt: {nc} + {q} > {p} {where}")
            ends_prompt = nc + q == p
            if self.is_last_prefill_chunk != ends_prompt:
                raise ValueError(
                    f"is_last_prefill_chunk={self.is_last_prefill_chunk} but "
                    f"num_computed_tokens + query_len == prompt_len is {ends_prompt} {where}"
                )
            if self.exclude and ends_prompt:
                raise ValueError(f"the last prefill chunk cannot be excluded: its sample is needed {where}")
        else:
            if self.is_last_prefill_chunk or self.exclude:
                raise ValueError(
                    f"a decode step cannot set is_last_prefill_chunk={self.is_last_prefill_chunk} "
                    f"or exclude={self.exclude} {where}"
                )
            if q != 1 + k:
                raise ValueError(f"decode needs query_len == 1 + num_draft_tokens, got {q} != 1 + {k} {where}")
            if nc < p:
                raise ValueError(f"decode before the prompt is computed: num_computed_tokens={nc} < prompt_len={p}")

    @property
    def num_sample_rows(self) -> int:
        """Sample rows this sequence contributes: 0 (excluded), 1 (prefill) or ``1 + k``."""
        if self.exclude:
            return 0
        return 1 if self.is_prefill else self.query_len

    @property
    def num_prompt_rows(self) -> int:
        """Prompt-logprob rows of this chunk: ``query_len`` or ``query_len - 1`` on the last chunk."""
        if not (self.is_prefill and self.want_prompt_logprobs):
            return 0
        return self.query_len - int(self.is_last_prefill_chunk)


@dataclass(frozen=True)
class SamplerInputs:
    """Row indices for one step; every tensor is int32 on the CPU.

    Attributes
    ----------
    query_start_loc : Tensor, int32 [num_seqs + 1]
        Flat row where each sequence's tokens start; last entry = ``num_tokens``.
    selected_token_indices : Tensor, int32 [num_sample_rows]
        Flat rows that go through the LM head for sampling, sequences in batch order.
    sample_positions : Tensor, int32 [num_sample_rows]
        Absolute position of the token each sample row produces.
    sample_row_offsets : Tensor, int32 [num_seqs + 1]
        Sequence ``i`` owns sample rows ``[sample_row_offsets[i], sample_row_offsets[i+1])``.
    sample_row_to_seq : Tensor, int32 [num_sample_rows]
        Batch index of each sample row's sequence (to expand per-request sampling params).
    selected_prompt_indices : Tensor, int32 [num_prompt_rows]
        Flat rows whose log-softmax gives prompt logprobs.
    prompt_target_positions : Tensor, int32 [num_prompt_rows]
        Absolute prompt position of each prompt row's target token (row position + 1).
    prompt_row_offsets : Tensor, int32 [num_seqs + 1]
        Sequence ``i`` owns prompt rows ``[prompt_row_offsets[i], prompt_row_offsets[i+1])``.
    """

    query_start_loc: torch.Tensor
    selected_token_indices: torch.Tensor
    sample_positions: torch.Tensor
    sample_row_offsets: torch.Tensor
    sample_row_to_seq: torch.Tensor
    selected_prompt_indices: torch.Tensor
    prompt_target_positions: torch.Tensor
    prompt_row_offsets: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return self.query_start_loc.numel() - 1

    @property
    def num_tokens(self) -> int:
        """Rows of the flattened batch (all scheduled tokens)."""
        return int(self.query_start_loc[-1])

    @property
    def num_sample_rows(self) -> int:
        return self.selected_token_indices.numel()

    @property
    def num_prompt_rows(self) -> int:
        return self.selected_prompt_indices.numel()


def _int32(values: List[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def prepare_sampler_inputs(seqs: Sequence[ScheduledSeq]) -> SamplerInputs:
    """Compute the sample rows and prompt-logprob rows of one step.

    Parameters
    ----------
    seqs : sequence of ScheduledSeq
        The scheduled sequences in batch order (the order of the flattened batch).

    Returns
    -------
    SamplerInputs
        int32 CPU tensors; see the module docstring for the conventions.

    Raises
    ------
    TypeError
        If an element is not a :class:`ScheduledSeq`.
    ValueError
        If the flattened batch has more than ``2**31 - 1`` tokens or a position
        does not fit in int32.
    """
    for i, seq in enumerate(seqs):
        if not isinstance(seq, ScheduledSeq):
            raise TypeError(f"seqs[{i}] must be a ScheduledSeq, got {type(seq).__name__}")
    num_tokens = sum(seq.query_len for seq in seqs)
    if num_tokens > _INT32_MAX:
        raise ValueError(f"{num_tokens} tokens in one step overflow int32 row indices")
    for i, seq in enumerate(seqs):
        if seq.num_computed_tokens + seq.query_len > _INT32_MAX:
            raise ValueError(
                f"seqs[{i}]: position {seq.num_computed_tokens + seq.query_len} overflows int32"
            )
    expected_samples = sum(seq.num_sample_rows for seq in seqs)
    expected_prompt_rows = sum(seq.num_prompt_rows for seq in seqs)

    query_start_loc, sample_row_offsets, prompt_row_offsets = [0], [0], [0]
    selected, positions, row_to_seq = [], [], []
    prompt_selected, prompt_targets = [], []
    query_offset = 0  # read pointer: first flat row of the current sequence
    for i, seq in enumerate(seqs):
        first_pos = seq.num_computed_tokens  # absolute position of flat row query_offset
        if seq.num_sample_rows:
            # prefill: the chunk's last row; decode: all 1 + k rows
            first_row = seq.query_len - seq.num_sample_rows
            for j in range(first_row, seq.query_len):
                selected.append(query_offset + j)
                positions.append(first_pos + j + 1)
                row_to_seq.append(i)
        for j in range(seq.num_prompt_rows):
            prompt_selected.append(query_offset + j)
            prompt_targets.append(first_pos + j + 1)
        query_offset += seq.query_len
        query_start_loc.append(query_offset)
        sample_row_offsets.append(len(selected))
        prompt_row_offsets.append(len(prompt_selected))

    # the write pointers must land exactly on the totals computed up front
    assert len(selected) == expected_samples, (len(selected), expected_samples)
    assert len(prompt_selected) == expected_prompt_rows, (len(prompt_selected), expected_prompt_rows)
    assert query_offset == num_tokens, (query_offset, num_tokens)
    return SamplerInputs(
        query_start_loc=_int32(query_start_loc),
        selected_token_indices=_int32(selected),
        sample_positions=_int32(positions),
        sample_row_offsets=_int32(sample_row_offsets),
        sample_row_to_seq=_int32(row_to_seq),
        selected_prompt_indices=_int32(prompt_selected),
        prompt_target_positions=_int32(prompt_targets),
        prompt_row_offsets=_int32(prompt_row_offsets),
    )

"""A step's device inputs in persistent buffers: built on the host in (pinned) staging memory, sent in one copy.

docs/gpu.md "Speed on CUDA: graphs and host syncs".  Copying a step's
inputs from pageable memory (``tensor.to("cuda")``) makes the host wait for
the device at every copy.  :class:`StepBuffers` instead owns

* one int64 **host staging** vector (pinned on CUDA) and one device vector of
  the same layout, allocated once for the engine's limits
  (:class:`StepCapacity`);
* per step, :meth:`StepBuffers.stage` writes the plan's input ids, positions,
  attention metadata, selected rows and sampler parameters into the staging
  vector and sends it with ONE ``copy_(non_blocking=True)``; it returns
  device views (:class:`StepInputs`).  The layout depends only on the
  capacity, so a view ``[:T]`` of a segment is the same memory in every step:
  what a CUDA graph captured reads the next step's values
  (:mod:`tpguide.worker.cuda_graphs`).

Layout (int64 words; ``T`` = ``max_tokens``, ``S`` = ``max_seqs``, ``W`` = ``max_blocks_per_seq``)::

    segment            words    per entry
    input_ids          T        token id; padding 0
    positions          T        absolute position; padding -1 (docs/gpu.md)
    seq_index          T        sequence of the token; padding 0
    query_index        T        index among its sequence's new tokens; padding 0
    slot_mapping       T        flat KV pool row block * block_size + offset; padding -1 (no write)
    selected           T        hidden row of each sample row; padded rows point at a padding token
    seeds              T        sampler seed per sample row
    sample_positions   T        sampler position per sample row
    top_k              T        per sample row
    temperature_top_p  T        float32 pairs: temperature [T] then top_p [T] (a float32 view)
    query_start_loc    S + 1
    context_lens       S
    query_lens         S
    seq_lens           S
    block_tables       S * W    row-major [S, W]; past a table's end 0

The staging vector is rewritten only after the previous step's result was
read (that read waits for the device, :func:`tpguide.worker.runner.read_to_host`), so its last copy
has finished: no second staging buffer is needed.  The guided bitmask has its
own buffers (:class:`BitmaskBuffers`): it is filled on the host while the
forward runs and sent after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from tpguide.model.attention import AttentionMetadata
from tpguide.sampling.sampler import SamplingMetadata

__all__ = ["StepCapacity", "StepBuffers", "StepInputs", "BitmaskBuffers"]

_TOKEN_SEGMENTS = ("input_ids", "positions", "seq_index", "query_index", "slot_mapping", "selected", "seeds",
                   "sample_positions", "top_k", "temperature_top_p")
_SEQ_SEGMENTS = ("context_lens", "query_lens", "seq_lens")


@dataclass(frozen=True)
class StepCapacity:
    """The most a step holds: tokens (= sample rows), sequences, KV blocks per sequence.

    Checked by :class:`StepBuffers` (built on CUDA only: on CPU this module runs no code).
    ``max_graph_tokens``: the most tokens of a decode step (every sequence
    with every draft), which CUDA graphs are captured up to
    (:func:`tpguide.worker.cuda_graphs.capture_buckets`); None: ``max_tokens``.
    """

    max_tokens: int
    max_seqs: int
    max_blocks_per_seq: int
    block_size: int
    max_graph_tokens: Optional[int] = None

    def fits(self, num_tokens: int, num_rows: int, num_seqs: int, max_blocks: int) -> bool:
        """Whether a step of that size fits the buffers."""
        return (num_tokens <= self.max_tokens and num_rows <= self.max_tokens and num_seqs <= self.max_seqs
                and max_blocks <= self.max_blocks_per_seq)


def _layout(cap: StepCapacity) -> Tuple[Dict[str, Tuple[int, int]], int]:
    """``({segment: (offset, words)}, total words)`` of the staging vector (module docstring)."""
    sizes = [(name, cap.max_tokens) for name in _TOKEN_SEGMENTS]
    sizes += [("query_start_loc", cap.max_seqs + 1)] + [(name, cap.max_seqs) for name in _SEQ_SEGMENTS]
    sizes += [("block_tables", cap.max_seqs * cap.max_blocks_per_seq)]
    layout, offset = {}, 0
    for name, words in sizes:
        layout[name] = (offset, words)
        offset += words
    return layout, offset


@dataclass(frozen=True)
class StepInputs:
    """One step's device views into :class:`StepBuffers` (or the plain step's tensors, ``forward.plain_inputs``).

    Attributes
    ----------
    input_ids, positions : Tensor, int64 [T_pad]
        ``T_pad >= T`` tokens; padding tokens have id 0 and position -1.
    meta : AttentionMetadata
        Views of the buffers; ``slot_mapping(block_size)`` is the staged one
        (padding -1).  Unpadded: exactly what :meth:`AttentionMetadata.from_block_tables`
        gives.  Padded: ``T_pad`` tokens, ``max_seqs`` sequences (unused ones
        with ``query_len`` 0), ``max_query_len = T_pad`` and
        ``max_seq_len = max_blocks_per_seq * block_size`` (upper bounds).
    selected : Tensor, int64 [T_pad] (padded) or [num_rows]
        Hidden rows through the LM head; the first ``num_rows`` are the plan's.
    num_tokens, num_rows : int
        The plan's tokens and sample rows (host ints).
    sampling : SamplingMetadata
        The plan's sampler parameters on the device, ``num_rows`` rows (not
        re-validated: the driver validated the plan's copy).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    selected: torch.Tensor
    num_tokens: int
    num_rows: int
    sampling: SamplingMetadata


class StepBuffers:
    """Persistent staging and device buffers for a step's inputs (module docstring).

    Parameters
    ----------
    capacity : StepCapacity
    device : torch.device
        Where the model runs; the staging vector is pinned when it is CUDA.

    Raises
    ------
    ValueError
        A capacity size below 1.
    """

    def __init__(self, capacity: StepCapacity, device: torch.device) -> None:
        for name in ("max_tokens", "max_seqs", "max_blocks_per_seq", "block_size"):
            if getattr(capacity, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(capacity, name)}")
        self.capacity, self.device = capacity, torch.device(device)
        self.layout, total = _layout(capacity)
        self.host = torch.zeros(total, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._host_np = self.host.numpy()
        self.dev = torch.zeros(total, dtype=torch.int64, device=self.device)

    def segment(self, name: str, buffer: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The whole segment ``name`` of ``buffer`` (default: the device vector), a view."""
        offset, words = self.layout[name]
        return (self.dev if buffer is None else buffer)[offset:offset + words]

    def stage(self, plan, num_padded_tokens: Optional[int] = None) -> StepInputs:
        """Write ``plan`` into the staging vector, send it (one non-blocking copy), return device views.

        Parameters
        ----------
        plan : StepPlan
            Host-side (:mod:`tpguide.worker.protocol`).
        num_padded_tokens : int, optional
            Pad the tokens and sample rows to this many (a CUDA-graph bucket,
            ``>= num_tokens``); the metadata then spans all ``max_seqs``
            sequences.  None: no padding, metadata of the plan's sequences.

        Raises
        ------
        ValueError
            The step does not fit the capacity, or ``num_padded_tokens`` is
            smaller than the step (the message names the sizes).
        """
        cap = self.capacity
        num_tokens, num_seqs = plan.input_ids.numel(), len(plan.block_tables)
        num_rows = plan.selected_token_indices.numel()
        widest = max(len(t) for t in plan.block_tables)
        padded = num_padded_tokens is not None
        size = num_padded_tokens if padded else num_tokens
        if not cap.fits(size, num_rows, num_seqs, widest) or size < max(num_tokens, num_rows):
            raise ValueError(f"step of {num_tokens} tokens, {num_rows} rows, {num_seqs} sequences, {widest} blocks "
                             f"(padded to {num_padded_tokens}) does not fit {cap}")
        for s, (table, c, q) in enumerate(zip(plan.block_tables, plan.context_lens, plan.query_lens)):
            if len(table) * cap.block_size < c + q:
                raise ValueError(f"sequence {s}: block table of {len(table)} blocks x {cap.block_size} tokens "
                                 f"cannot hold {c + q} positions")
        self._write_host(plan, size)
        self.dev.copy_(self.host, non_blocking=True)  # the step's one H2D copy
        return self._views(plan, size, num_seqs if not padded else cap.max_seqs, padded)

    def stage_padding(self, num_padded_tokens: int) -> StepInputs:
        """Views of a step of padding tokens only (nothing read or written in the KV cache): graph capture."""
        host = self.host
        host.zero_()
        for name in ("positions", "slot_mapping"):
            self.segment(name, host).fill_(-1)
        self.dev.copy_(host, non_blocking=True)
        return self.padding_views(num_padded_tokens)

    # ------------------------------------------------------------------ host side
    def _write_host(self, plan, size: int) -> None:
        """The plan's values into the staging vector, padding up to ``size`` tokens and rows.

        numpy on the staging memory: single-threaded and a few microseconds
        an op (a torch op here could wake the OpenMP pool for a few hundred integers).
        """
        cap = self.capacity
        seg = self._host_segment
        q = np.asarray(plan.query_lens, dtype=np.int64)
        ctx = np.asarray(plan.context_lens, dtype=np.int64)
        num_seqs, num_tokens = q.size, int(plan.input_ids.numel())
        seq_index = np.repeat(np.arange(num_seqs, dtype=np.int64), q)  # [T]
        start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q, out=start[1:])
        query_index = np.arange(num_tokens, dtype=np.int64) - start[seq_index]  # [T]
        positions = ctx[seq_index] + query_index  # [T]
        tables = seg("block_tables").reshape(cap.max_seqs, cap.max_blocks_per_seq)
        tables[:] = 0
        for s, table in enumerate(plan.block_tables):
            tables[s, :len(table)] = table
        bs = cap.block_size
        slots = tables[seq_index, positions // bs] * bs + positions % bs  # [T]
        for name, value, pad in (("input_ids", plan.input_ids.numpy(), 0), ("positions", positions, -1),
                                 ("seq_index", seq_index, 0), ("query_index", query_index, 0),
                                 ("slot_mapping", slots, -1)):
            dst = seg(name)
            dst[:num_tokens] = value
            dst[num_tokens:size] = pad
        num_rows = plan.selected_token_indices.numel()
        selected = seg("selected")
        selected[:num_rows] = plan.selected_token_indices.numpy()
        selected[num_rows:size] = size - 1 if num_tokens < size else 0  # a padding token when there is one
        self._write_sampling(plan.sampling, num_rows, size)
        seg("query_start_loc")[:num_seqs + 1] = start
        seg("query_start_loc")[num_seqs + 1:] = num_tokens  # unused sequences: empty
        for name, value in (("context_lens", ctx), ("query_lens", q), ("seq_lens", ctx + q)):
            seg(name)[:num_seqs] = value
            seg(name)[num_seqs:] = 0

    def _write_sampling(self, sampling: SamplingMetadata, num_rows: int, size: int) -> None:
        seg = self._host_segment
        floats = seg("temperature_top_p").view(np.float32)  # [2 * max_tokens]
        t = self.capacity.max_tokens
        for name, value, pad in (("seeds", sampling.seeds, 0), ("sample_positions", sampling.sample_positions, 0),
                                 ("top_k", sampling.top_k, 0)):
            seg(name)[:num_rows] = value.numpy()
            seg(name)[num_rows:size] = pad
        floats[:num_rows] = sampling.temperature.numpy()
        floats[num_rows:size] = 0.0  # greedy
        floats[t:t + num_rows] = sampling.top_p.numpy()
        floats[t + num_rows:t + size] = 1.0

    def _host_segment(self, name: str) -> np.ndarray:
        """The staging vector's segment ``name`` as a numpy view."""
        offset, words = self.layout[name]
        return self._host_np[offset:offset + words]

    # ------------------------------------------------------------------ device views
    def _views(self, plan, size: int, num_seqs: int, padded: bool) -> StepInputs:
        cap = self.capacity
        seg = self.segment
        meta = self._metadata(size, num_seqs,
                              max_query_len=size if padded else max(plan.query_lens),
                              max_seq_len=(cap.max_blocks_per_seq * cap.block_size if padded else
                                           max(c + q for c, q in zip(plan.context_lens, plan.query_lens))),
                              table_width=cap.max_blocks_per_seq if padded else max(len(t) for t in plan.block_tables))
        num_rows = plan.selected_token_indices.numel()
        floats = seg("temperature_top_p").view(torch.float32)
        sampling = _device_sampling(plan.sampling, {
            "temperature": floats[:num_rows], "top_p": floats[cap.max_tokens:cap.max_tokens + num_rows],
            "top_k": seg("top_k")[:num_rows], "seeds": seg("seeds")[:num_rows],
            "sample_positions": seg("sample_positions")[:num_rows]})
        selected = seg("selected")[:size if padded else num_rows]
        return StepInputs(seg("input_ids")[:size], seg("positions")[:size], meta, selected,
                          int(plan.input_ids.numel()), num_rows, sampling)

    def padding_views(self, size: int) -> StepInputs:
        """Fresh views of a padding-only step of ``size`` tokens (as staged by :meth:`stage_padding`)."""
        cap = self.capacity
        meta = self._metadata(size, cap.max_seqs, max_query_len=size,
                              max_seq_len=cap.max_blocks_per_seq * cap.block_size, table_width=cap.max_blocks_per_seq)
        seg = self.segment
        empty = SamplingMetadata(torch.zeros(0), torch.zeros(0, dtype=torch.int32), torch.ones(0),
                                 torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
        return StepInputs(seg("input_ids")[:size], seg("positions")[:size], meta, seg("selected")[:size], 0, 0, empty)

    def _metadata(self, size: int, num_seqs: int, max_query_len: int, max_seq_len: int,
                  table_width: int) -> AttentionMetadata:
        """An AttentionMetadata of views: ``size`` tokens, ``num_seqs`` sequences, tables ``table_width`` wide."""
        cap, seg = self.capacity, self.segment
        tables = seg("block_tables").view(cap.max_seqs, cap.max_blocks_per_seq)[:num_seqs, :table_width]
        meta = AttentionMetadata(  # the SDPA mask is built on first use only: the CUDA path never asks
            block_tables=tables, query_start_loc=seg("query_start_loc")[:num_seqs + 1],
            context_lens=seg("context_lens")[:num_seqs], query_lens=seg("query_lens")[:num_seqs],
            seq_lens=seg("seq_lens")[:num_seqs], token_seq_index=seg("seq_index")[:size],
            token_query_index=seg("query_index")[:size], token_positions=seg("positions")[:size],
            max_query_len=max_query_len, max_seq_len=max_seq_len,
        )
        meta._derived[("write", cap.block_size)] = seg("slot_mapping")[:size]  # staged: padding -1, not derived
        return meta


def _device_sampling(host: SamplingMetadata, tensors: Dict[str, torch.Tensor]) -> SamplingMetadata:
    """The device copy of ``host``: its per-row tensors replaced by device views, ``host`` kept as its host copy.

    A copy with a host copy is not validated again (each check would read a
    device value, a sync); the driver validated ``host``, and the sampler's
    decisions read it, never the device (:attr:`SamplingMetadata.host`).
    """
    return SamplingMetadata(**tensors, num_logprobs=host.num_logprobs, return_logprobs=host.return_logprobs,
                            penalties=host.penalties, host=host)


class BitmaskBuffers:
    """Staging and device buffers for a guided step's ``token_mask`` and bitmask words.

    Parameters
    ----------
    max_rows : int
        Sample rows per step (:attr:`StepCapacity.max_tokens`).
    bitmask_size : int
        int32 words per full row; rank ``r`` receives words
        ``[r * W, (r + 1) * W)``, ``W = bitmask_size // tp_size``.
    tp_size : int
    device : torch.device
    """

    def __init__(self, max_rows: int, bitmask_size: int, tp_size: int, device: torch.device) -> None:
        self.max_rows, self.words, self.tp_size = max_rows, bitmask_size // tp_size, tp_size
        self.device = torch.device(device)
        total = max_rows * (1 + bitmask_size)
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self.dev = torch.zeros(total, dtype=torch.int32, device=self.device)

    def _parts(self, buffer: torch.Tensor, num_rows: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """``(token_mask [R], [slice r: [R, W] for each rank])`` views of ``buffer``; slices rank-major."""
        r, w = self.max_rows, self.words
        slices = [buffer[r + k * r * w:r + (k + 1) * r * w].view(r, w)[:num_rows] for k in range(self.tp_size)]
        return buffer[:num_rows], slices

    def receive_views(self, num_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Device ``(token_mask [R], this rank's words [R, W])`` to receive into (a non-driver rank)."""
        token_mask, slices = self._parts(self.dev, num_rows)
        return token_mask, slices[0]

    def send(self, token_mask: torch.Tensor, slices: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Stage the driver's host ``token_mask [R]`` and word ``slices`` and send them (one non-blocking copy).

        Returns the device views ``(token_mask [R], slices)``.

        Raises
        ------
        ValueError
            More rows than ``max_rows``, or slices that are not ``tp_size`` tensors ``[R, W]``.
        """
        num_rows = token_mask.numel()
        if num_rows > self.max_rows or len(slices) != self.tp_size or any(
                tuple(s.shape) != (num_rows, self.words) for s in slices):
            raise ValueError(f"bitmask of {num_rows} rows, slices {[tuple(s.shape) for s in slices]} does not fit "
                             f"{self.max_rows} rows x {self.tp_size} slices of {self.words} words")
        host_mask, host_slices = self._parts(self.host, num_rows)
        host_mask.copy_(token_mask)
        for dst, src in zip(host_slices, slices):
            dst.copy_(src)
        used = self.max_rows + (self.tp_size - 1) * self.max_rows * self.words + num_rows * self.words
        self.dev[:used].copy_(self.host[:used], non_blocking=True)
        return self._parts(self.dev, num_rows)

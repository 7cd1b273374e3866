"""Read slices of ``*.safetensors`` tensors with plain file reads, never mapping the file.

``safetensors.safe_open`` memory-maps the file: every page a slice touches
counts in the process's RSS until the file is closed, and a column slice
(row-parallel layers) touches every page of its tensor.  This reader parses
the header itself (8-byte little-endian length, JSON, then the raw data;
the format of https://github.com/huggingface/safetensors) and reads only the
requested bytes with ``readinto`` straight into the result: whole rows in
one read, a matrix's column slice row by row (a result on a GPU or any
non-CPU device through a host buffer, :meth:`TensorSlice.read_rows_into`).  A rank's peak memory is then its parameters plus one tensor
shard in flight, at the checkpoint's own dtype.

:class:`TensorSlice` has the interface of safetensors' ``PySafeSlice``
(``get_shape()``, ``get_dtype()``, ``[tuple of slices]``) that the weight
loaders accept (:mod:`tpguide.model.weight_slice`).
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from math import prod
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import torch

#: safetensors dtype tag -> torch dtype.
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
#: Bytes read per block when a slice needs part of each row.
BLOCK_BYTES = 4 << 20
INDEX_FILENAME = "model.safetensors.index.json"


def read_header(path: str | Path) -> Tuple[Dict[str, dict], int]:
    """``(tensors, data_offset)``: per-name header entries (``dtype``, ``shape``, ``data_offsets``).

    Raises
    ------
    ValueError
        A file too short or with an unreadable header (names the file).
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: unreadable safetensors header: {exc}") from exc
    header.pop("__metadata__", None)
    return header, 8 + n


def checkpoint_files(model_dir: str | Path) -> List[Path]:
    """The safetensors files of a checkpoint: those ``model.safetensors.index.json`` names, else ``*.safetensors``.

    Raises
    ------
    ValueError
        No safetensors file, or an index naming a file that is missing.
    """
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILENAME
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise ValueError(f"{index} names missing files: {missing}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in model directory {str(model_dir)!r}")
    return files


def checkpoint_dtype(model_dir: str | Path) -> torch.dtype:
    """The floating dtype holding most parameters of the checkpoint (headers only; e.g. for ``--dtype auto``)."""
    counts: Counter = Counter()
    for path in checkpoint_files(model_dir):
        header, _ = read_header(path)
        for entry in header.values():
            dtype = DTYPES.get(entry["dtype"])
            if dtype is not None and dtype.is_floating_point:
                counts[dtype] += prod(entry["shape"])
    if not counts:
        raise ValueError(f"no floating-point tensors in the checkpoint in {str(model_dir)!r}")
    return counts.most_common(1)[0][0]


def reads_in_place(dst: torch.Tensor) -> bool:
    """Whether :meth:`TensorSlice.read_rows_into` reads the file straight into ``dst``: a CPU tensor only."""
    return dst.device.type == "cpu"


def host_buffer(num_bytes: int, pin: bool) -> torch.Tensor:
    """A new uint8 ``[num_bytes]`` CPU tensor, page-locked when ``pin`` and CUDA is available (faster H2D copies)."""
    pin = pin and torch.cuda.is_available()
    return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)


class TensorSlice:
    """One tensor of a safetensors file, read lazily (``PySafeSlice`` interface)."""

    def __init__(self, path: Path, entry: dict, data_offset: int) -> None:
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{path}: unsupported safetensors dtype {entry['dtype']!r}")
        self.path, self.dtype, self.shape = path, DTYPES[entry["dtype"]], tuple(entry["shape"])
        self.offset = data_offset + entry["data_offsets"][0]

    def get_shape(self) -> List[int]:
        return list(self.shape)

    def get_dtype(self) -> torch.dtype:
        return self.dtype

    def _read(self, f, first_row: int, num_rows: int, row_shape: Tuple[int, ...]) -> torch.Tensor:
        """Rows ``[first_row, first_row + num_rows)`` of dim 0, whole, as ``[num_rows, *row_shape]``."""
        row_bytes = prod(row_shape) * self.dtype.itemsize
        out = torch.empty(num_rows * row_bytes, dtype=torch.uint8)
        f.seek(self.offset + first_row * row_bytes)
        if f.readinto(out.numpy()) != out.numel():
            raise ValueError(f"{self.path}: file ends inside a tensor")
        return out.view(self.dtype).view(num_rows, *row_shape)

    def read_rows_into(self, dst: torch.Tensor, first_row: int) -> torch.Tensor:
        """Read rows ``[first_row, first_row + dst.size(0))`` (whole rows) into contiguous ``dst``, in place.

        ``dst`` is cast-free, so it must have this tensor's dtype.  A CPU
        ``dst`` is read into straight from the file (no intermediate buffer);
        any other device (CUDA, ``meta``) goes through a host buffer of at
        most :data:`BLOCK_BYTES` per read (pinned for CUDA where pinning is
        available), copied to ``dst`` block by block, so no ``.numpy()`` is ever
        called on a device tensor (docs/gpu.md, "Exactness on CUDA").
        Returns ``dst``.

        Raises
        ------
        ValueError
            ``dst`` of another dtype, not contiguous or with other trailing dims;
            the file ends inside the tensor.
        """
        if dst.dtype != self.dtype or not dst.is_contiguous() or tuple(dst.shape[1:]) != self.shape[1:]:
            raise ValueError(f"read_rows_into needs a contiguous {self.dtype} [*, {list(self.shape[1:])}] tensor, "
                             f"got {dst.dtype} {list(dst.shape)}")
        row_bytes = prod(self.shape[1:]) * self.dtype.itemsize
        with open(self.path, "rb", buffering=0) as f:  # unbuffered: each read is exactly the bytes asked for
            f.seek(self.offset + first_row * row_bytes)
            if reads_in_place(dst):
                raw = dst.view(-1).view(torch.uint8) if dst.numel() else dst.view(torch.uint8)
                if f.readinto(raw.numpy()) != raw.numel():
                    raise ValueError(f"{self.path}: file ends inside a tensor")
                return dst
            rows_per_block = max(1, BLOCK_BYTES // max(1, row_bytes))
            buffer = host_buffer(min(dst.size(0), rows_per_block) * row_bytes, pin=dst.device.type == "cuda")
            for lo in range(0, dst.size(0), rows_per_block):
                n = min(rows_per_block, dst.size(0) - lo)
                raw = buffer[:n * row_bytes]
                if f.readinto(raw.numpy()) != raw.numel():
                    raise ValueError(f"{self.path}: file ends inside a tensor")
                dst.narrow(0, lo, n).copy_(raw.view(self.dtype).view(n, *self.shape[1:]))  # synchronous: reused
        return dst

    def __getitem__(self, index: Tuple[slice, ...]) -> torch.Tensor:
        """The sub-tensor ``index`` (one ``slice`` per dim, step 1); reads only the rows it covers."""
        if not isinstance(index, tuple):
            index = (index,)
        if not self.shape:
            with open(self.path, "rb", buffering=0) as f:  # unbuffered: each read is exactly the bytes asked for
                return self._read(f, 0, 1, ()).reshape(())
        index = index + (slice(None),) * (len(self.shape) - len(index))
        ranges = [range(*s.indices(n)) for s, n in zip(index, self.shape)]
        if any(r.step != 1 for r in ranges):
            raise ValueError(f"only step-1 slices are supported, got {index}")
        rows, rest = ranges[0], ranges[1:]
        row_shape = self.shape[1:]
        whole_rows = all(len(r) == n for r, n in zip(rest, row_shape))
        with open(self.path, "rb", buffering=0) as f:  # unbuffered: each read is exactly the bytes asked for
            if whole_rows:
                return self._read(f, rows.start, len(rows), row_shape)
            out = torch.empty(len(rows), *(len(r) for r in rest), dtype=self.dtype)
            if len(rest) == 1:  # a column slice of a matrix: read each row's part only
                item, cols = self.dtype.itemsize, rest[0]
                raw = out.view(torch.uint8).numpy()  # [rows, len(cols) * item]
                for i, row in enumerate(rows):
                    f.seek(self.offset + (row * row_shape[0] + cols.start) * item)
                    if f.readinto(raw[i]) != raw.shape[1]:
                        raise ValueError(f"{self.path}: file ends inside a tensor")
                return out
            block = max(1, BLOCK_BYTES // max(1, prod(row_shape) * self.dtype.itemsize))
            inner = tuple(slice(r.start, r.stop) for r in rest)
            for lo in range(0, len(rows), block):
                n = min(block, len(rows) - lo)
                out[lo:lo + n] = self._read(f, rows.start + lo, n, row_shape)[(slice(None), *inner)]
            return out


def iter_checkpoint(model_dir: str | Path) -> Iterator[Tuple[str, str, TensorSlice]]:
    """``(file name, tensor name, lazy slice)`` for every tensor of the checkpoint, file by file."""
    for path in checkpoint_files(model_dir):
        header, data_offset = read_header(path)
        for name, entry in header.items():
            yield path.name, name, TensorSlice(path, entry, data_offset)

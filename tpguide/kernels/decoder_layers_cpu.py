"""The fixed-order CPU decoder stack in one C call: ``tpguide_decoder_layers`` (docs/architecture.md §6, "The decoder stack in one call").

A decode step of the embedded model runs about ten kernels per layer; called
one by one from Python, each pays for its wrapper, its checks and its torch
allocations (a few microseconds to tens of them), about a third of a 1-thread
decode step.  ``csrc/decoder_layers_cpu.c`` runs the same kernels with the
same inputs in the same order, so the values are the per-op path's bit for
bit; this module holds its argument structures and the call.  Which layers
qualify, and building their descriptions from the model, is
:mod:`tpguide.model.decoder_stack_cpu`.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from tpguide.kernels.fixed_order_cpu import DTYPE_CODES, ELEMENTS_PER_THREAD, PackedWeight, _attention_scratch, library

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float

#: ``kind`` of a :class:`LinearDesc`: the fmaf-chain panels or the VDPBF16PS pairs.
LINEAR_KINDS = {"fmaf": 0, "pairs": 1}


class LinearDesc(ctypes.Structure):
    """One packed weight as ``stack_linear`` reads it (``struct tpguide_linear_desc``)."""

    _fields_ = [("panels", _ptr), ("kind", _i64), ("w_dtype", _i64), ("unit_size", _i64), ("k_pad", _i64),
                ("units", _i64), ("out_features", _i64)]


class LayerDesc(ctypes.Structure):
    """One decoder layer (``struct tpguide_layer_desc``): norms, four linears, its cache, this step's cos/sin."""

    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("input_eps", _f32), ("post_eps", _f32),
                ("qkv", LinearDesc), ("o", LinearDesc), ("gate_up", LinearDesc), ("down", LinearDesc),
                ("k_cache", _ptr), ("v_cache", _ptr), ("num_blocks", _i64), ("cos", _ptr), ("sin", _ptr),
                ("rotary_dim", _i64), ("window", _i64), ("act_op", _i64), ("scale", _f32), ("softcap", _f32)]


class StackStep(ctypes.Structure):
    """What every layer of one step shares (``struct tpguide_stack_step``)."""

    _fields_ = [("T", _i64), ("dtype", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64),
                ("head_dim", _i64), ("intermediate", _i64), ("slots", _ptr), ("block_tables", _ptr),
                ("num_seqs", _i64), ("max_blocks", _i64), ("block_size", _i64), ("token_seq", _ptr),
                ("token_pos", _ptr), ("max_seq_len", _i64), ("attention_scratch", _ptr), ("work", _ptr),
                ("threads", _i64), ("elements_per_thread", _i64)]


def linear_desc(packed: PackedWeight) -> LinearDesc:
    """The description of a weight packed for the fmaf kernels or the VDPBF16PS pairs.

    Raises
    ------
    ValueError
        A weight packed for AMX tiles (the stack does not run them).
    """
    if packed.amx:
        raise ValueError("the decoder stack call does not run AMX-packed weights")
    return LinearDesc(packed.panels.data_ptr(), LINEAR_KINDS["pairs" if packed.pairs else "fmaf"],
                      DTYPE_CODES[packed.panels.dtype], packed.unit_size, packed.padded_unit_size, packed.num_units,
                      packed.out_features)


_KEPT_WORK_BYTES = 64 << 20
_WORK = threading.local()


def _work_buffer(nbytes: int) -> torch.Tensor:
    """uint8 scratch of at least ``nbytes``, kept per calling thread up to 64 MiB (every byte is written before read)."""
    if nbytes > _KEPT_WORK_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    buf = getattr(_WORK, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _WORK.buf = torch.empty(nbytes, dtype=torch.uint8)
    return buf


def run_decoder_layers(layers: ctypes.Array, hidden: torch.Tensor, residual: torch.Tensor | None,
                       shape: tuple[int, int, int, int, int], slots: torch.Tensor, block_tables: torch.Tensor,
                       block_size: int, token_seq: torch.Tensor, token_pos: torch.Tensor,
                       max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Run ``layers`` over ``hidden``; ``(mlp_out, residual)`` of the last layer, or None if a kernel refused.

    Parameters
    ----------
    layers : ctypes array of LayerDesc
        ``(LayerDesc * num_layers)``: every layer's description with this step's cos/sin (each ``[T, R]``
        contiguous, the model dtype) and its KV cache.
    hidden : torch.Tensor
        ``[T, hidden]`` contiguous, fp32 or bf16 (the model dtype): the first layer's input.
    residual : torch.Tensor or None
        ``hidden``'s shape and dtype; None: the first layer's input is the residual.
    shape : tuple of int
        ``(heads, kv_heads, head_dim, intermediate, widest_padded_input)``: this
        rank's head counts, the MLP width and the widest ``units * K_pad`` of a linear.
    slots, token_seq, token_pos : torch.Tensor
        int64 ``[T]`` contiguous: cache rows, each token's sequence and position.
    block_tables : torch.Tensor
        int64 ``[num_seqs, max_blocks]`` contiguous.
    block_size, max_seq_len : int

    Returns
    -------
    (torch.Tensor, torch.Tensor) or None
        New ``[T, hidden]`` tensors whose sum is the stack's output, or None
        when a kernel refused its arguments (nothing returned is half-done:
        the caller runs the per-op path, which raises naming the bad value;
        cache rows written before the refusal are written again with the same bits).
    """
    lib = library()
    t, width = hidden.shape
    heads, kv_heads, head_dim, intermediate, widest = shape
    threads = torch.get_num_threads()
    out = hidden.clone()
    res = torch.empty_like(hidden) if residual is None else residual.clone()
    scratch = _attention_scratch(threads * lib.tpguide_attention_scratch_floats(max_seq_len, head_dim))
    work = _work_buffer(lib.tpguide_stack_work_bytes(t, width, heads, kv_heads, head_dim, intermediate, widest))
    step = StackStep(t, DTYPE_CODES[hidden.dtype], width, heads, kv_heads, head_dim, intermediate, slots.data_ptr(),
                     block_tables.data_ptr(), block_tables.shape[0], block_tables.shape[1], block_size,
                     token_seq.data_ptr(), token_pos.data_ptr(), max_seq_len, scratch.data_ptr(), work.data_ptr(),
                     threads, ELEMENTS_PER_THREAD)
    status = lib.tpguide_decoder_layers(layers, len(layers), ctypes.byref(step), out.data_ptr(), res.data_ptr(),
                                        int(residual is not None))
    return None if status else (out, res)

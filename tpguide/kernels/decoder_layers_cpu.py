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

import torch

from tpguide.kernels.fixed_order_cpu import (
    DTYPE_CODES,
    ELEMENTS_PER_THREAD,
    PackedWeight,
    _attention_scratch,
    kept_scratch,
    library,
)

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


#: The largest work buffer kept between steps, and the largest a step may use
#: (:meth:`~tpguide.model.decoder_stack_cpu.DecoderStackCPU.run`): a decode step
#: needs little; a long prefill keeps the per-op path, whose intermediates live one at a time.
KEPT_WORK_BYTES = 64 << 20


def work_bytes(t: int, dtype_code: int, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
               widest_padded_input: int) -> int:
    """Bytes of a step's intermediates in the stack call (``tpguide_stack_work_bytes``)."""
    return library().tpguide_stack_work_bytes(t, dtype_code, hidden, heads, kv_heads, head_dim, intermediate,
                                              widest_padded_input)


class StepArgs:
    """A step's :class:`StackStep` and the tensors it points into (kept alive while it is used).

    Parameters
    ----------
    hidden : torch.Tensor
        ``[T, hidden]`` contiguous, fp32 or bf16 (the model dtype): the first layer's input.
    shape : tuple of int
        ``(heads, kv_heads, head_dim, intermediate, widest_padded_input)``: this
        rank's head counts, its MLP width and the widest ``units * K_pad`` of a linear.
    slots, token_seq, token_pos : torch.Tensor
        int64 ``[T]`` contiguous: cache rows, each token's sequence and position.
    block_tables : torch.Tensor
        int64 ``[num_seqs, max_blocks]`` contiguous.
    block_size, max_seq_len : int
    nbytes : int
        The step's :func:`work_bytes` (at most :data:`KEPT_WORK_BYTES`).
    """

    def __init__(self, hidden: torch.Tensor, shape: tuple[int, int, int, int, int], slots: torch.Tensor,
                 block_tables: torch.Tensor, block_size: int, token_seq: torch.Tensor, token_pos: torch.Tensor,
                 max_seq_len: int, nbytes: int) -> None:
        t, width = hidden.shape
        heads, kv_heads, head_dim, intermediate, _ = shape
        threads = torch.get_num_threads()
        self.keep = (slots, block_tables, token_seq, token_pos,
                     _attention_scratch(threads * library().tpguide_attention_scratch_floats(max_seq_len, head_dim)),
                     kept_scratch("stack_work", nbytes, torch.uint8, KEPT_WORK_BYTES))  # every byte written first
        self.step = StackStep(t, DTYPE_CODES[hidden.dtype], width, heads, kv_heads, head_dim, intermediate,
                              slots.data_ptr(), block_tables.data_ptr(), block_tables.shape[0], block_tables.shape[1],
                              block_size, token_seq.data_ptr(), token_pos.data_ptr(), max_seq_len,
                              self.keep[4].data_ptr(), self.keep[5].data_ptr(), threads, ELEMENTS_PER_THREAD)


def run_decoder_layers(layers: ctypes.Array, args: StepArgs, hidden: torch.Tensor,
                       residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Run ``layers`` over ``hidden`` at tp 1; ``(mlp_out, residual)`` of the last layer, or None if a kernel refused.

    Parameters
    ----------
    layers : ctypes array of LayerDesc
        ``(LayerDesc * num_layers)``: every layer's description with this step's cos/sin (each ``[T, R]``
        contiguous, the model dtype) and its KV cache; every row-parallel unit on this rank.
    args : StepArgs
    hidden : torch.Tensor
        ``[T, hidden]`` contiguous, the model dtype: the first layer's input.
    residual : torch.Tensor or None
        ``hidden``'s shape and dtype; None: the first layer's input is the residual.

    Returns
    -------
    (torch.Tensor, torch.Tensor) or None
        New ``[T, hidden]`` tensors whose sum is the stack's output, or None
        when a kernel refused its arguments (nothing returned is half-done:
        the caller runs the per-op path, which raises naming the bad value;
        cache rows written before the refusal are written again with the same bits).
    """
    out = hidden.clone()
    res = torch.empty_like(hidden) if residual is None else residual.clone()
    status = library().tpguide_decoder_layers(layers, len(layers), ctypes.byref(args.step), out.data_ptr(),
                                              res.data_ptr(), int(residual is not None))
    return None if status else (out, res)


def run_decoder_half(layer: LayerDesc, args: StepArgs, half: int, x: torch.Tensor, residual: torch.Tensor,
                     first: bool, partials: torch.Tensor) -> bool:
    """One half of one layer at tp > 1 into fp32 unit ``partials``; False if a kernel refused.

    Parameters
    ----------
    layer : LayerDesc
    args : StepArgs
    half : int
        0: the attention half (``x`` the layer's input), 1: the MLP half (``x`` the
        summed ``o_proj`` output); both ``[T, hidden]`` contiguous, the model dtype.
    residual : torch.Tensor
        ``[T, hidden]``, updated in place (written from ``x`` when ``first``).
    first : bool
        The attention half of the first layer, whose input is also its residual.
    partials : torch.Tensor
        fp32 ``[U_local, T, N]`` contiguous: this rank's unit partials of ``o_proj``
        (half 0) or ``down_proj`` (half 1), for the ordered sum across ranks.
    """
    status = library().tpguide_decoder_half(ctypes.byref(layer), ctypes.byref(args.step), half, x.data_ptr(),
                                            residual.data_ptr(), int(first), partials.data_ptr())
    return status == 0

"""Triton kernel of ``offload_ref::static_cache_write_`` (twin of the CPU kernel in
``custom_ops/static_cache_write.py``): ``keys / values[:, :, cache_position[s]] := key_states / value_states[:, :, s]``.

The write of a Hugging Face host-KV cache (``offload_passes/hf_cache.py``: the latent / rope caches pinned
on the host, the rows computed on the device). Each source row ``(b, h, s)`` is stored through the pinned
cache's own address at ``(b, h, cache_position[s])``: under unified virtual addressing a page-locked
allocation has one address in host and device space (docs/cuda.md), so the rows travel over the host link
as the stores of one launch, with no staging copy, no host synchronisation and nothing a CUDA graph cannot
capture. The same kernel writes a device-resident cache.

Checks: shapes and dtypes on the host before the launch (the CPU kernel's messages), once per signature.
``cache_position`` lives on the device, so its bounds are checked by the kernel: an out-of-range position is
not written and sets an error word (``_common.ERR_CACHE_POSITION``) that
``offload_passes.cuda.raise_device_errors`` turns into a ``RuntimeError`` on the host. Positions must be
distinct, as ``index_copy_`` needs them (``StaticLayer.update`` writes ``arange(S) + length``); the CPU kernel
checks it, the device kernel does not (two programs would store one row in either order).

Ordering: the stores are issued on the current stream after the kernels that computed the rows; a later
kernel on that stream (``dsa_serve`` reading a missed row) sees them.
"""
from __future__ import annotations

import torch

from .. import static_cache_write as M
from ._common import ERR_CACHE_POSITION, CudaOp, error_flags, host_operand, next_pow2, require_triton
from .cache_write import _rows

triton = require_triton()
import triton.language as tl  # noqa: E402

QUALNAME = M.SPEC.qualname
BLOCK_R = 16
#: element size -> the integer dtype the rows move as (bit for bit, NaN included: a HF cache may be fp32)
_RAW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(_RAW[t.element_size()])


@triton.jit
def _static_write_kernel(pos_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, flag_ptr, N, S, T, Dk, Dv,
                         BLOCK_R: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    # r: a source row (b, h, s) of the [B, H, S, D] rows, flat; its destination row (b, h, position) of [B, H, T, D]
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < N
    s = r % S
    p = tl.load(pos_ptr + s, mask=rm, other=0).to(tl.int64)
    ok = rm & (p >= 0) & (p < T)
    # an out-of-range position: nothing written, the error word set (the host raises; no device assert)
    tl.atomic_max(flag_ptr + tl.zeros([BLOCK_R], tl.int32), 1, mask=rm & ~ok)
    dst = (r // S) * T + p
    _rows(r, ok, dst, k_ptr, kc_ptr, Dk, BLOCK_DK)  # the recipe write's row copy: dst row := src row r
    _rows(r, ok, dst, v_ptr, vc_ptr, Dv, BLOCK_DV)


def launch(keys: torch.Tensor, values: torch.Tensor, cache_position: torch.Tensor, key_states: torch.Tensor,
           value_states: torch.Tensor) -> None:
    """The CUDA kernel of the op on checked arguments (in place; the caches may be pinned host tensors)."""
    if key_states.is_cuda:  # a host cache must be pinned (its address valid on the device); interpreted: all host
        host_operand(keys, QUALNAME, "keys")
        host_operand(values, QUALNAME, "values")
    if not (keys.is_contiguous() and values.is_contiguous()):
        raise RuntimeError(f"{QUALNAME}: keys and values must be contiguous on CUDA")
    B, H, T, Dk = keys.shape
    S, Dv = cache_position.size(0), values.size(3)
    N = B * H * S
    if N == 0:
        return
    dev = cache_position.device if cache_position.device.type != "cpu" else key_states.device
    flags = error_flags(dev)[ERR_CACHE_POSITION:]
    _static_write_kernel[(triton.cdiv(N, BLOCK_R),)](
        cache_position.contiguous(), _raw(key_states.contiguous()), _raw(value_states.contiguous()), _raw(keys),
        _raw(values), flags, N, S, T, Dk, Dv, BLOCK_R=BLOCK_R, BLOCK_DK=next_pow2(Dk), BLOCK_DV=next_pow2(Dv))


def _validate(a: tuple, op: str) -> None:
    M.check_shapes(*a)


#: ``offload_ref::static_cache_write_`` on CUDA (``_common.CudaOp``: shapes checked once per signature; the
#: position bounds on the device, every launch)
KERNELS = CudaOp(M.SPEC, _validate, lambda a, _checked=None: launch(*a))
run, register = KERNELS.run, KERNELS.register

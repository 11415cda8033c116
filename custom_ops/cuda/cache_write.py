"""Triton kernel of ``offload_ref::npu_mla_prolog_cache_write_`` (twin of the CPU kernel in
``custom_ops/cache_write.py``): rows ``cache_index[t]`` of the latent / rope caches := ``kv[t]`` / ``kr[t]``.

The model's write of new KV rows into a host-resident full cache (``models/glm/modeling.py``
``write_kv_cache``: the caches pinned on the host, the rows computed on the device). The kernel stores
through the pinned cache's own address: under unified virtual addressing a page-locked allocation has one
address in host and device space (docs/cuda.md), so the rows travel over the host link as the stores of
one launch, with no staging copy, no host synchronisation and nothing a CUDA graph cannot capture. The
same kernel writes a device-resident cache.

Checks: shapes and dtypes on the host before the launch (the CPU kernel's messages). ``cache_index``
lives on the device, so its bounds are checked by the kernel: an out-of-range row is not written and sets
an error word (``_common.error_flags``) that ``offload_passes.cuda.raise_device_errors`` turns into a
``RuntimeError`` on the host, never a device-side assert.

Ordering: the stores are issued on the current stream, after the kernels that computed ``kv`` / ``kr``;
a host reader of the cache (or a later copy from it) must wait for that stream, as for any device write.
"""
from __future__ import annotations

import torch

from .. import cache_write as M
from ._common import ERR_CACHE_INDEX, CudaOp, bits, error_flags, host_operand, next_pow2, require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402

OP = M.PROLOG
QUALNAME = f"offload_ref::{OP}"
BLOCK_T = 16


@triton.jit
def _rows(t, ok, r, src_ptr, dst_ptr, D, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)[None, :]
    m = ok[:, None] & (d < D)
    tl.store(dst_ptr + r[:, None] * D + d, tl.load(src_ptr + t[:, None] * D + d, mask=m), mask=m)


@triton.jit
def _write_kernel(idx_ptr, kv_ptr, kr_ptr, kvc_ptr, krc_ptr, flag_ptr, T, R, Dkv, Dr,
                  BLOCK_T: tl.constexpr, BLOCK_DKV: tl.constexpr, BLOCK_DR: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    r = tl.load(idx_ptr + t, mask=tm, other=0).to(tl.int64)
    ok = tm & (r >= 0) & (r < R)
    # an out-of-range row: nothing written, the error word set (the host raises; no device assert)
    tl.atomic_max(flag_ptr + tl.zeros([BLOCK_T], tl.int32), 1, mask=tm & ~ok)
    _rows(t, ok, r, kv_ptr, kvc_ptr, Dkv, BLOCK_DKV)
    _rows(t, ok, r, kr_ptr, krc_ptr, Dr, BLOCK_DR)


def launch(kv_cache: torch.Tensor, kr_cache: torch.Tensor, cache_index: torch.Tensor, kv: torch.Tensor,
           kr: torch.Tensor) -> None:
    """The CUDA kernel of the op on checked arguments (in place; the caches may be pinned host tensors)."""
    if kv.is_cuda:  # a host cache must be pinned (its address valid on the device); under the interpreter all is host
        host_operand(kv_cache, QUALNAME, "kv_cache")
        host_operand(kr_cache, QUALNAME, "kr_cache")
    if not (kv_cache.is_contiguous() and kr_cache.is_contiguous()):
        raise RuntimeError(f"{QUALNAME}: kv_cache and kr_cache must be contiguous on CUDA")
    T = cache_index.size(0)
    if T == 0:
        return
    R = kv_cache.size(0) * kv_cache.size(1)
    Dkv, Dr = kv_cache.size(3), kr_cache.size(3)
    dev = cache_index.device if cache_index.device.type != "cpu" else kv.device
    flags = error_flags(dev)[ERR_CACHE_INDEX:]
    _write_kernel[(triton.cdiv(T, BLOCK_T),)](
        cache_index.contiguous(), bits(kv.contiguous()), bits(kr.contiguous()), bits(kv_cache), bits(kr_cache),
        flags, T, R, Dkv, Dr, BLOCK_T=BLOCK_T, BLOCK_DKV=next_pow2(Dkv), BLOCK_DR=next_pow2(Dr))


def _validate(a: tuple, op: str) -> None:
    M._check_prolog(*a)


#: ``offload_ref::npu_mla_prolog_cache_write_`` on CUDA (``_common.CudaOp``: shapes checked once per signature;
#: the row bounds on the device, every launch)
KERNELS = CudaOp(M.PROLOG_SPEC, _validate, lambda a, _checked=None: launch(*a))
run, register = KERNELS.run, KERNELS.register

"""Triton kernel of ``custom::dsa_serve`` / ``dsa_serve_functional`` (twin of ``csrc/dsa_serve.cpp``).

One program serves ``BLOCK_R`` consecutive plan rows: kind 1 copies a pool row, kinds 2/3 a full-cache
row, anything else (and any out-of-range value) writes zeros. Plan rows are independent and each writes
only its own selection row, so any grid gives the same bytes.

Miss path on a GPU: ``full_kv_cache`` / ``full_k_rope`` may be *pinned host* tensors
(:func:`offload_passes.cuda.place_full_caches`). The kernel then dereferences host addresses directly:
with unified virtual addressing (every 64-bit CUDA platform) a page-locked allocation's host pointer is
also its device pointer (``cudaHostGetDevicePointer`` returns the same value), so passing the pinned
tensor's ``data_ptr`` reads the missed rows over the host link, zero-copy, with no staging copy of the
cache. That assumption is checked on a GPU only (``tests/cuda/test_device_ops.py`` with ``OFFLOAD_PASSES_GPU=1``).

Per call the host binds the arguments and launches; validation and the launch constants are per call
signature (``_common.CudaOp``). A zero-width rope (the no-rope mode, docs/ops.md §3.3) is skipped at compile
time (``HAS_ROPE``).
"""
from __future__ import annotations


from typing import NamedTuple

from .. import dsa_serve as M
from ._common import COPY_TILE, CudaOp, bits, commit, host_operand, next_pow2, out_buffer, require_triton
from ._kinds import DECODE_WINDOW, FULL_OLD_MISS, POOL_HIT

triton = require_triton()
import triton.language as tl  # noqa: E402

OP, FUNCTIONAL_OP = M.OP, M.FUNCTIONAL_OP


@triton.jit
def _copy_rows(q, qm, from_pool, from_full, pool_row, full_row, src_pool, src_full, dst, D, dst_stride,
               BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    dm = d[None, :] < D
    a = tl.load(src_pool + pool_row[:, None] * D + d[None, :], mask=from_pool[:, None] & dm, other=0)
    f = tl.load(src_full + full_row[:, None] * D + d[None, :], mask=from_full[:, None] & dm, other=0)
    val = tl.where(from_pool[:, None], a, f)  # both masked loads give 0 where they do not apply
    tl.store(dst + q[:, None] * dst_stride + d[None, :], val, mask=qm[:, None] & dm)


@triton.jit
def _serve_kernel(plan_ptr, fkv_ptr, frp_ptr, pkv_ptr, prp_ptr, skv_ptr, srp_ptr,
                  rows, per_batch, F, PS, Dkv, Dr, kv_dst_stride, rope_dst_stride,
                  BLOCK_R: tl.constexpr, BLOCK_DKV: tl.constexpr, BLOCK_DR: tl.constexpr, HAS_ROPE: tl.constexpr):
    q = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    qm = q < rows
    kind = tl.load(plan_ptr + 2 * q, mask=qm, other=0)
    v = tl.load(plan_ptr + 2 * q + 1, mask=qm, other=-1).to(tl.int64)
    b = q // per_batch
    from_pool = qm & (kind == POOL_HIT) & (v >= 0) & (v < PS)
    from_full = qm & ((kind == FULL_OLD_MISS) | (kind == DECODE_WINDOW)) & (v >= 0) & (v < F)
    pool_row = b * PS + v
    full_row = b * F + v
    _copy_rows(q, qm, from_pool, from_full, pool_row, full_row, pkv_ptr, fkv_ptr, skv_ptr, Dkv, kv_dst_stride,
               BLOCK_DKV)
    if HAS_ROPE:
        _copy_rows(q, qm, from_pool, from_full, pool_row, full_row, prp_ptr, frp_ptr, srp_ptr, Dr, rope_dst_stride,
                   BLOCK_DR)


class _Launch(NamedTuple):
    """What a call signature fixes (computed once per signature with the validation)."""

    grid: tuple
    per_batch: int
    kv_stride: int
    rope_stride: int
    block_r: int
    block_dkv: int
    block_dr: int
    has_rope: bool  # Dr > 0


def _validate(a: tuple, op: str) -> _Launch:
    """The op's checks (``validate_dsa_serve``) and the launch constants of the signature."""
    M.validate_dsa_serve(*a, op=op)
    plan, full_kv_cache, full_k_rope, selection_kv_cache, selection_k_rope = a[0], a[1], a[2], a[5], a[6]
    raw_seq, topk, compact = a[7], a[8], a[10] == 1
    Dkv, Dr = full_kv_cache.size(2), full_k_rope.size(2)
    block_dkv, block_dr = next_pow2(Dkv), next_pow2(Dr)
    block_r = max(1, min(64, COPY_TILE // block_dkv))
    return _Launch((triton.cdiv(plan.size(0), block_r),), raw_seq * topk,
                   Dkv if compact else selection_kv_cache.size(1) * Dkv,
                   Dr if compact else selection_k_rope.size(1) * Dr, block_r, block_dkv, block_dr, Dr > 0)


def launch(a: tuple, cfg: _Launch) -> None:
    """Run the kernel on validated arguments (dense copies / temporaries where the tensors are strided). A
    zero-width rope (the no-rope mode) is never addressed: the kv tensors stand in for its pointers."""
    plan, full_kv_cache, full_k_rope, pool_kv_cache, pool_k_rope, selection_kv_cache, selection_k_rope = a[:7]
    if plan.is_cuda:  # checked once per host allocation (is_pinned() asks the driver; kept out of graph replays)
        host_operand(full_kv_cache, OP, "full_kv_cache")
        host_operand(full_k_rope, OP, "full_k_rope")
    outs = [out_buffer(t) for t in (selection_kv_cache, selection_k_rope)]
    has_rope = cfg.has_rope
    fkv, pkv = bits(full_kv_cache.contiguous()), bits(pool_kv_cache.contiguous())
    frp = bits(full_k_rope.contiguous()) if has_rope else fkv
    prp = bits(pool_k_rope.contiguous()) if has_rope else pkv
    _serve_kernel[cfg.grid](
        plan.contiguous(), fkv, frp, pkv, prp, bits(outs[0]), bits(outs[1]) if has_rope else bits(outs[0]),
        plan.size(0), cfg.per_batch, full_kv_cache.size(1), pool_kv_cache.size(1), full_kv_cache.size(2),
        full_k_rope.size(2), cfg.kv_stride, cfg.rope_stride,
        BLOCK_R=cfg.block_r, BLOCK_DKV=cfg.block_dkv, BLOCK_DR=cfg.block_dr, HAS_ROPE=has_rope,
    )
    for dst, buf in zip((selection_kv_cache, selection_k_rope), outs):
        commit(dst, buf)


#: ``custom::dsa_serve`` / ``dsa_serve_functional`` on CUDA (``_common.CudaOp``: bound once, validated once per
#: signature with the CPU kernel's own checks; the twin writes new selection tensors, inputs untouched)
KERNELS = CudaOp(M.SPEC, _validate, launch, twin_outputs=lambda a: M.functional_outputs(a[5], a[6], a[10]))
run, run_functional, register = KERNELS.run, KERNELS.run_functional, KERNELS.register

"""Device implementation of ``offload_ref::npu_sparse_flash_attention`` (twin of
``reference_npu_sparse_flash_attention``, docs/ops.md §6.2): MLA-absorb attention over the selected KV rows,
in fp64 as the reference.

Why fp64 on the device too: the offload path presents the selected rows in ledger order, the unmodified path
in top-k order; in fp64 the products of bf16 values are exact and both orders round to the same output,
which is what makes the two pipelines bit-identical (docs/ops.md §10). Any fp32 order would differ between
them in the last bit, and so would the next top-k.

Why Triton: the reference as a torch composite gathers the K rows of every token into fp64 (``[T, K, 576]``:
1.2 GB per layer at B = 128), and its token map, paged addressing and masking are about 50 launches per
layer. Here three launches, each reading the rows through the block table:

1. ``_sfa_score_kernel``, one program per (token, block of ``BLOCK_H`` heads, block of ``BLOCK_K`` positions):
   the token's validity window (``lim``), the paged rows, ``z = scale * (q . k + q_rope . k_rope)`` in fp64
   (products summed in registers), ``-inf`` where a position is not selected; writes ``z [T, N, K]``, the rows and the validity.
2. ``_sfa_stats_kernel``, per (token, head block): whether the token has any valid position, the softmax maximum
   and sum (a token without one attends uniformly, as the reference's zeros do, and is multiplied by 0).
3. ``_sfa_out_kernel``, per (token, head block, block of ``BLOCK_D`` value dims): ``sum_p softmax(z)_p * v(p)``
   in fp64, times "any valid"; torch casts the fp64 result to the query's dtype, as the reference does.

The reference's data checks (length tensors, a selected position beyond the table, a block id out of range)
set the ``cuda`` mode's guard word instead of raising (``_attention.py``); a bad row is never read.
"""
from __future__ import annotations

import struct

import torch

from .. import npu_sparse_flash_attention as M
from . import _attention as A
from ._common import CudaOp, next_pow2, require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402

OP = M.OP
#: heads per program (GLM's 64 heads are four blocks); positions x dims of the score kernel's product tile;
#: positions x value dims of the output kernel's. The products are fp64 registers (``tl.dot`` of fp64 does
#: not compile with triton 3.6, the lent machine's: "PassManager::run failed" for sm_80 and sm_90).
BLOCK_H = 16
SCORE_K, SCORE_D = 32, 8
OUT_K, OUT_D = 8, 32
#: positions per step of the statistics kernel
STATS_K = 64


@triton.jit
def _dot_rows(acc, x_ptr, xk_ptr, t, h, hm, rows, km, N, D, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """``acc += x[t, h] . xk[rows]`` over the ``D`` dims, in fp64 (``[BLOCK_H, BLOCK_K]``)."""
    d0 = 0
    while d0 < D:
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        qt = tl.load(x_ptr + (t * N + h[:, None]) * D + d[None, :], mask=hm[:, None] & dm[None, :], other=0)
        kt = tl.load(xk_ptr + rows[:, None] * D + d[None, :], mask=km[:, None] & dm[None, :], other=0)
        acc += tl.sum(qt.to(tl.float64)[:, None, :] * kt.to(tl.float64)[None, :, :], axis=2)
        d0 += BLOCK_D
    return acc


@triton.jit
def _sfa_score_kernel(q_ptr, qr_ptr, k_ptr, kr_ptr, idx_ptr, table_ptr, kvlen_ptr, cu_ptr, z_ptr, rows_ptr, valid_ptr,
                  flag_ptr, scale_bits, T, B, S, N, D, DR, K, BS, MAXBLK, NUM_BLOCKS,
                  c_start, c_cum, c_last, c_bsnd, c_beyond, c_block,
                  TND: tl.constexpr, PAGED: tl.constexpr, HAS_QLEN: tl.constexpr, HAS_KVLEN: tl.constexpr,
                  MODE3: tl.constexpr, HAS_ROPE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    kb = tl.program_id(2)
    if (t == 0) & (hb == 0) & (kb == 0):
        A.check_lengths(cu_ptr, kvlen_ptr, flag_ptr, B, S, T, c_start, c_cum, c_last, c_bsnd, 0,
                        TND, HAS_QLEN, False, BLOCK_B)
    b, i, sq = A.token_map(t, cu_ptr, B, S, TND, BLOCK_B)
    if HAS_KVLEN:
        L = tl.load(kvlen_ptr + b).to(tl.int64)
    else:
        L = b * 0 + BS
    if MODE3:
        lim = L - sq + i
    else:
        lim = L - 1
    kk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    km = kk < K
    p = tl.load(idx_ptr + t * K + kk, mask=km, other=-1).to(tl.int64)
    valid = km & (p >= 0) & (p <= lim)  # -1 and every other negative never selected
    col = tl.where(valid, p, 0) // BS
    beyond = valid & (col >= MAXBLK)
    tl.atomic_max(flag_ptr + kk * 0, c_beyond, mask=beyond)
    if PAGED:
        blk = tl.load(table_ptr + b * MAXBLK + tl.minimum(col, MAXBLK - 1), mask=valid, other=0).to(tl.int64)
    else:
        blk = b + col * 0
    bad = valid & ~beyond & ((blk < 0) | (blk >= NUM_BLOCKS))
    tl.atomic_max(flag_ptr + kk * 0, c_block, mask=bad)
    rows = tl.where(valid & ~beyond & ~bad, blk * BS + tl.where(valid, p, 0) % BS, 0)
    if hb == 0:
        tl.store(rows_ptr + t * K + kk, rows, mask=km)
        tl.store(valid_ptr + t * K + kk, valid.to(tl.int8), mask=km)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < N
    z = _dot_rows(tl.zeros([BLOCK_H, BLOCK_K], tl.float64), q_ptr, k_ptr, t, h, hm, rows, km, N, D,
                  BLOCK_H, BLOCK_K, BLOCK_D)
    if HAS_ROPE:  # the reference adds the rope dot to the nope dot, then scales
        z = z + _dot_rows(tl.zeros([BLOCK_H, BLOCK_K], tl.float64), qr_ptr, kr_ptr, t, h, hm, rows, km, N, DR,
                          BLOCK_H, BLOCK_K, BLOCK_D)
    z = z * scale_bits.to(tl.int64).to(tl.float64, bitcast=True)
    z = tl.where(valid[None, :], z, float("-inf"))
    tl.store(z_ptr + (t * N + h[:, None]) * K + kk[None, :], z, mask=hm[:, None] & km[None, :])


@triton.jit
def _softmax_input(z_ptr, t, h, hm, kk, km, anyv, N, K):
    """The reference's softmax input: ``z`` of a token with a valid position, else zeros; -inf past K."""
    z = tl.load(z_ptr + (t * N + h[:, None]) * K + kk[None, :], mask=hm[:, None] & km[None, :], other=0.0)
    z = tl.where(anyv, z, 0.0)
    return tl.where(km[None, :], z, float("-inf"))


@triton.jit
def _sfa_stats_kernel(z_ptr, valid_ptr, m_ptr, l_ptr, any_ptr, N, K, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < N
    cnt = 0
    k0 = 0
    while k0 < K:
        kk = k0 + tl.arange(0, BLOCK_K)
        cnt += tl.sum(tl.load(valid_ptr + t * K + kk, mask=kk < K, other=0).to(tl.int32), axis=0)
        k0 += BLOCK_K
    anyv = cnt > 0
    m = tl.full([BLOCK_H], float("-inf"), tl.float64)
    nan = tl.zeros([BLOCK_H], tl.int32)
    k0 = 0
    while k0 < K:
        kk = k0 + tl.arange(0, BLOCK_K)
        z = _softmax_input(z_ptr, t, h, hm, kk, kk < K, anyv, N, K)
        m = tl.maximum(m, tl.max(z, axis=1))
        nan += tl.sum((z != z).to(tl.int32), axis=1)
        k0 += BLOCK_K
    m = tl.where(nan > 0, float("nan"), m)  # torch's softmax: one NaN makes the whole row NaN
    s = tl.zeros([BLOCK_H], tl.float64)
    k0 = 0
    while k0 < K:
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < K
        z = _softmax_input(z_ptr, t, h, hm, kk, km, anyv, N, K)
        s += tl.sum(tl.where(km[None, :], tl.exp(z - m[:, None]), 0.0), axis=1)
        k0 += BLOCK_K
    tl.store(m_ptr + t * N + h, m, mask=hm)
    tl.store(l_ptr + t * N + h, s, mask=hm)
    if hb == 0:
        tl.store(any_ptr + t, anyv.to(tl.int8))


@triton.jit
def _sfa_out_kernel(z_ptr, rows_ptr, m_ptr, l_ptr, any_ptr, v_ptr, out_ptr, N, D, K, BLOCK_H: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < N
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    anyv = tl.load(any_ptr + t) != 0
    m = tl.load(m_ptr + t * N + h, mask=hm, other=0.0)
    s = tl.load(l_ptr + t * N + h, mask=hm, other=1.0)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float64)
    k0 = 0
    while k0 < K:
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < K
        z = _softmax_input(z_ptr, t, h, hm, kk, km, anyv, N, K)
        p = tl.where(km[None, :], tl.exp(z - m[:, None]) / s[:, None], 0.0)
        rows = tl.load(rows_ptr + t * K + kk, mask=km, other=0)
        vt = tl.load(v_ptr + rows[:, None] * D + d[None, :], mask=km[:, None] & dm[None, :], other=0)
        acc += tl.sum(p[:, :, None] * vt.to(tl.float64)[None, :, :], axis=1)
        k0 += BLOCK_K
    acc = acc * tl.where(anyv, 1.0, 0.0)  # the reference multiplies by "any valid" (0 * NaN stays NaN)
    tl.store(out_ptr + (t * N + h[:, None]) * D + d[None, :], acc, mask=hm[:, None] & dm[None, :])


def _validate(a: tuple, op: str) -> tuple:
    (query, key, value, idx, _scale, table, cu_q, kv_len, q_rope, k_rope, sbs, layout_query, layout_kv, mode,
     _pre, _next, attention_mode, lse, sinks) = a
    info = M.validate_npu_sparse_flash_attention(query, key, value, idx, table, cu_q, kv_len, q_rope, k_rope, sbs,
                                                 layout_query, layout_kv, mode, attention_mode, lse, sinks)
    maxblk = table.size(1) if layout_kv == "PA_BSND" else 1
    checks = A.DataChecks.of(OP, T=info["T"], S=info["S"], layout_query=layout_query,
                             has_query_lengths=cu_q is not None, check_kv_negative=False,
                             lengths_arg="actual_seq_lengths_kv", maxblk=maxblk, block_size=key.size(1),
                             num_blocks=key.size(0))
    return info, checks


def _launch(a: tuple, checked: tuple) -> tuple:
    query, key, value, idx, scale, table, cu_q, kv_len, q_rope, k_rope, _sbs, layout_query, layout_kv, mode = a[:14]
    info, checks = checked
    T, N, D, K, B = info["T"], info["N"], info["D"], info["K"], info["B"]
    dev = query.device
    empty = query.new_empty((0,), dtype=torch.float32)
    out = torch.empty((T, N, D), dtype=torch.float64, device=dev)
    if T > 0:
        nb, bs = key.size(0), key.size(1)
        paged = layout_kv == "PA_BSND"
        z = torch.empty((T, N, K), dtype=torch.float64, device=dev)
        rows = torch.empty((T, K), dtype=torch.int64, device=dev)
        valid = torch.empty((T, K), dtype=torch.int8, device=dev)
        m = torch.empty((T, N), dtype=torch.float64, device=dev)
        s = torch.empty((T, N), dtype=torch.float64, device=dev)
        anyv = torch.empty((T,), dtype=torch.int8, device=dev)
        q = query.reshape(T, N, D).contiguous()
        k = key.contiguous().view(nb * bs, D)
        v = k if value is None else value.contiguous().view(nb * bs, D)
        rope = q_rope is not None
        dr = q_rope.size(-1) if rope else 0
        qr = q_rope.reshape(T, N, dr).contiguous() if rope else q
        kr = k_rope.contiguous().view(nb * bs, dr) if rope else k
        ids = idx.reshape(T, K).contiguous()
        tab = table.contiguous() if paged else rows
        cu = cu_q.contiguous() if cu_q is not None else rows
        kvl = kv_len.contiguous() if kv_len is not None else rows
        scale_bits = struct.unpack("<q", struct.pack("<d", float(scale)))[0]  # fp64 exactly (a float arg is fp32)
        bh = min(BLOCK_H, next_pow2(N))
        hblocks = triton.cdiv(N, bh)
        _sfa_score_kernel[(T, hblocks, triton.cdiv(K, SCORE_K))](
            q, qr, k, kr, ids, tab, kvl, cu, z, rows, valid, A.guard_word(dev), scale_bits,
            T, B, info["S"] or 1, N, D, dr, K, bs, table.size(1) if paged else 1, nb,
            checks.start, checks.cumulative, checks.last, checks.bsnd_lengths, checks.beyond, checks.block,
            TND=layout_query == "TND", PAGED=paged, HAS_QLEN=cu_q is not None, HAS_KVLEN=kv_len is not None,
            MODE3=mode == 3, HAS_ROPE=rope, BLOCK_B=A.block_b(B), BLOCK_H=bh, BLOCK_K=SCORE_K,
            BLOCK_D=SCORE_D,
        )
        _sfa_stats_kernel[(T, hblocks)](z, valid, m, s, anyv, N, K, BLOCK_H=bh, BLOCK_K=STATS_K)
        _sfa_out_kernel[(T, hblocks, triton.cdiv(D, OUT_D))](z, rows, m, s, anyv, v, out, N, D, K,
                                                             BLOCK_H=bh, BLOCK_K=OUT_K, BLOCK_D=OUT_D)
    return out.to(query.dtype).reshape(query.shape), empty, empty.clone()


#: ``offload_ref::npu_sparse_flash_attention`` on CUDA (``_common.CudaOp``: validated once per signature with the
#: CPU reference's own checks; the data checks on the device)
KERNELS = CudaOp(M.SPEC, _validate, _launch)
run, register = KERNELS.run, KERNELS.register

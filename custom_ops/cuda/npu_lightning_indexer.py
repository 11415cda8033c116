"""Device implementation of ``offload_ref::npu_lightning_indexer`` (twin of ``reference_npu_lightning_indexer``,
docs/ops.md §6.1); its score kernel also serves ``npu_quant_lightning_indexer.py`` (``QUANT``).

Three launches, no host synchronisation, nothing that depends on the data in shape (a CUDA graph captures it):

1. ``_indexer_score_kernel``, one program per (query token, block of ``BLOCK_J`` window positions). The window is the
   whole key table (``W = block_table.size(1) * block_size``, ``S_kv`` for a ``BSND`` key): its visible part
   ``n`` depends on the lengths, which live on the device. The program maps its token to the batch row
   (:func:`_attention.token_map`), reads its keys through the block table (no gathered copy of the cache),
   computes the score in the reference's fixed order (``_attention_common.pairwise_sum`` over the head dim,
   the heads summed in order; the int8 dot is an exact integer) and writes one int64 **sort key** per
   position: the score's bits made order-preserving in the high half, ``2**32 - 1 - id`` in the low half,
   ``INT64_MIN`` for a position beyond the window. Distinct keys, so the largest ``c`` keys are unique and
   their order is the reference's (score descending, equal scores by ascending id; ``-0.0`` equals ``0.0``,
   every NaN sorts first, as ``torch.sort`` orders them).
2. ``torch.topk`` of the keys (``c = min(K, W)``, sorted).
3. ``_indexer_finish_kernel``: the ids back from the keys, ``-1`` from ``min(K, n)`` on.

Why Triton and not a torch composite: a composite gathers every token's window (``[T, W, D]``, then fp32:
4 GiB per layer at B = 128 and a 64K context) and scores it with a BLAS product whose summation order is the
library's, which no other kernel reproduces (torch's CPU bmm already rounds differently when only ``W``
changes). The kernel reads each key once and adds in the reference's order, bit for bit on any device, with
floating-point contraction disabled (``enable_fp_fusion=False``: a fused multiply-add rounds once where the
reference rounds twice).

The reference's data checks (the length tensors, block ids, a window beyond the table) cannot raise here:
each failure sets the ``cuda`` mode's guard word with the reference's message, raised on the host by
``offload_passes.cuda.raise_device_errors`` (docs/cuda.md); a bad block id is never read.
"""
from __future__ import annotations

import torch

from .. import npu_lightning_indexer as M
from .._attention_common import indexer_out_shape
from . import _attention as A
from ._common import CudaOp, next_pow2, require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402

INT64_MIN = tl.constexpr(-(2 ** 63))
#: elements of a program's key tile (``BLOCK_J`` rows of the padded head dim)
SCORE_TILE = 4096


@triton.jit
def _pairwise(p, BLOCK_J: tl.constexpr, LOG_D: tl.constexpr):
    """``_attention_common.pairwise_sum`` of the rows of ``p [BLOCK_J, 2**LOG_D]``: first half plus second
    half, until one column is left (a sum of two elements is one IEEE add in either order; the padding
    holds -0.0)."""
    for _ in tl.static_range(LOG_D):
        p = tl.sum(tl.reshape(p, [BLOCK_J, 2, p.shape[1] // 2]), axis=1)
    return tl.reshape(p, [BLOCK_J])


@triton.jit
def _indexer_score_kernel(q_ptr, k_ptr, w_ptr, qs_ptr, ks_ptr, table_ptr, kvlen_ptr, cu_ptr, keys_ptr, n_ptr, flag_ptr,
                  T, B, S, N, D, W, BS, MAXBLK, NUM_BLOCKS,
                  c_start, c_cum, c_last, c_bsnd, c_kvneg, c_beyond, c_block,
                  TND: tl.constexpr, PAGED: tl.constexpr, HAS_QLEN: tl.constexpr, HAS_KVLEN: tl.constexpr,
                  MODE3: tl.constexpr, QUANT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_J: tl.constexpr,
                  BLOCK_D: tl.constexpr, LOG_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    jb = tl.program_id(1)
    if (t == 0) & (jb == 0):
        A.check_lengths(cu_ptr, kvlen_ptr, flag_ptr, B, S, T, c_start, c_cum, c_last, c_bsnd, c_kvneg,
                        TND, HAS_QLEN, HAS_KVLEN, BLOCK_B)
    b, i, sq = A.token_map(t, cu_ptr, B, S, TND, BLOCK_B)
    if HAS_KVLEN:
        L = tl.load(kvlen_ptr + b).to(tl.int64)
    else:
        L = b * 0 + BS  # BSND key without lengths: every row of the key's S_kv is visible
    if MODE3:
        n = L - sq + i + 1
    else:
        n = L
    n = tl.maximum(n, 0)
    # a window longer than the table: the reference raises; here it is flagged and cut to the table
    tl.atomic_max(flag_ptr, c_beyond, mask=(jb == 0) & (n > W))
    n = tl.minimum(n, W)
    if jb == 0:
        tl.store(n_ptr + t, n.to(tl.int32))

    j = jb * BLOCK_J + tl.arange(0, BLOCK_J)
    jm = j < W
    keys = tl.full([BLOCK_J], INT64_MIN, tl.int64)
    if jb * BLOCK_J < n:
        needed = j < n
        if PAGED:
            blk = tl.load(table_ptr + b * MAXBLK + j // BS, mask=needed, other=0).to(tl.int64)
        else:
            blk = b + j * 0
        bad = needed & ((blk < 0) | (blk >= NUM_BLOCKS))
        tl.atomic_max(flag_ptr + j * 0, c_block, mask=bad)
        ok = needed & ~bad
        rows = tl.where(ok, blk * BS + j % BS, 0)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        km = ok[:, None] & dm[None, :]
        kt = tl.load(k_ptr + rows[:, None] * D + d[None, :], mask=km, other=0)
        acc = tl.full([BLOCK_J], -0.0, tl.float32)  # -0.0 + x == x: the fold starts with head 0's term
        if QUANT:
            kt = kt.to(tl.int32)
            kscale = tl.load(ks_ptr + rows, mask=ok, other=0).to(tl.float32)
            h = 0
            while h < N:  # a while loop: range() of a run-time bound breaks the interpreters of triton 3.4 / 3.6
                qh = tl.load(q_ptr + (t * N + h) * D + d, mask=dm, other=0).to(tl.int32)
                dot = tl.sum(qh[None, :] * kt, axis=1).to(tl.float32)  # exact: |dot| <= 2**14 * D
                qscale = tl.load(qs_ptr + t * N + h).to(tl.float32)
                v = (qscale * kscale) * dot
                r = tl.where(v < 0, 0.0, v)  # relu; NaN stays NaN, as torch.relu
                acc = acc + tl.load(w_ptr + t * N + h).to(tl.float32) * r
                h += 1
        else:
            kt = kt.to(tl.float32)
            h = 0
            while h < N:
                qh = tl.load(q_ptr + (t * N + h) * D + d, mask=dm, other=0).to(tl.float32)
                p = tl.where(dm[None, :], qh[None, :] * kt, -0.0)
                dot = _pairwise(p, BLOCK_J, LOG_D)
                r = tl.where(dot < 0, 0.0, dot)
                acc = acc + tl.load(w_ptr + t * N + h).to(tl.float32) * r
                h += 1
        # order-preserving integer of the score: -0.0 as 0.0, every NaN as one NaN (torch.sort puts NaN first)
        sb = acc.to(tl.int32, bitcast=True)
        sb = tl.where(acc == 0, 0, sb)
        sb = tl.where(acc != acc, 0x7FC00000, sb)
        sb = tl.where(sb >= 0, sb, sb ^ 0x7FFFFFFF)
        low = tl.full([BLOCK_J], A.LOW, tl.int64) - j.to(tl.int64)  # equal scores: the smaller id is larger
        keys = tl.where(ok, sb.to(tl.int64) * (A.LOW + 1) + low, INT64_MIN)
    tl.store(keys_ptr + t * W + j, keys, mask=jm)


@triton.jit
def _indexer_finish_kernel(top_ptr, n_ptr, out_ptr, C, K, BLOCK_K: tl.constexpr):
    """``out[t, k]`` = the id of the ``k``-th largest key for ``k < min(n[t], C)``, else -1."""
    t = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    n = tl.load(n_ptr + t)
    v = tl.load(top_ptr + t * C + k, mask=k < C, other=0)
    low = tl.full([BLOCK_K], A.LOW, tl.int64)
    ids = (low - (v & low)).to(tl.int32)
    keep = (k < C) & (k < n)
    tl.store(out_ptr + t * K + k, tl.where(keep, ids, -1), mask=k < K)


def geometry(key: torch.Tensor, block_table, layout_key: str) -> tuple:
    """``(W, block_size, maxblk, num_blocks)`` of the key table (``_attention_common.kv_addressing``)."""
    num_blocks, bs = key.size(0), key.size(1)
    maxblk = block_table.size(1) if layout_key == "PA_BSND" else 1
    return maxblk * bs, bs, maxblk, num_blocks


def checks_for(op: str, info: dict, key, block_table, actual_seq_lengths_query, layout_query: str,
               layout_key: str) -> A.DataChecks:
    W, bs, maxblk, num_blocks = geometry(key, block_table, layout_key)
    return A.DataChecks.of(op, T=info["T"], S=info["S"], layout_query=layout_query,
                           has_query_lengths=actual_seq_lengths_query is not None, check_kv_negative=True,
                           lengths_arg="actual_seq_lengths_key", maxblk=maxblk, block_size=bs,
                           num_blocks=num_blocks)


def topk(query, key, weights, query_scale, key_scale, cu_q, kv_len, block_table, layout_query: str,
         layout_key: str, sparse_count: int, sparse_mode: int, info: dict, checks: A.DataChecks) -> torch.Tensor:
    """The top-k ids ``[T, 1, K]`` / ``[B, S, 1, K]`` int32 of validated arguments (``QUANT`` when the scales
    are given): the three launches of the module docstring, on ``query``'s device."""
    T, N, D, K = info["T"], info["N"], info["D"], sparse_count
    dev = query.device
    W, bs, maxblk, num_blocks = geometry(key, block_table, layout_key)
    out = torch.empty((T, K), dtype=torch.int32, device=dev)
    if T == 0 or W == 0:
        return out.fill_(-1).view(indexer_out_shape(info, layout_query, K))
    B = info["B"]
    quant = query_scale is not None
    keys = torch.empty((T, W), dtype=torch.int64, device=dev)
    n = torch.empty((T,), dtype=torch.int32, device=dev)
    block_d = next_pow2(D)
    block_j = max(16, min(128, SCORE_TILE // block_d))
    q = query.reshape(T, N, D).contiguous()
    k = key.contiguous().view(-1, D)
    w = weights.reshape(T, N).contiguous()
    qs = query_scale.reshape(T, N).contiguous() if quant else w
    ks = key_scale.contiguous().view(-1) if quant else w
    table = block_table.contiguous() if layout_key == "PA_BSND" else n
    cu = cu_q.contiguous() if cu_q is not None else n
    kvl = kv_len.contiguous() if kv_len is not None else n
    _indexer_score_kernel[(T, triton.cdiv(W, block_j))](
        q, k, w, qs, ks, table, kvl, cu, keys, n, A.guard_word(dev),
        T, B, info["S"] or 1, N, D, W, bs, maxblk, num_blocks, *checks.args(),
        TND=layout_query == "TND", PAGED=layout_key == "PA_BSND", HAS_QLEN=cu_q is not None,
        HAS_KVLEN=kv_len is not None, MODE3=sparse_mode == 3, QUANT=quant, BLOCK_B=A.block_b(B),
        BLOCK_J=block_j, BLOCK_D=block_d, LOG_D=block_d.bit_length() - 1, enable_fp_fusion=False,
    )
    c = min(K, W)
    top = torch.topk(keys, c, dim=1, largest=True, sorted=True).values
    _indexer_finish_kernel[(T,)](top, n, out, c, K, BLOCK_K=next_pow2(K))
    return out.view(indexer_out_shape(info, layout_query, K))


def _validate(a: tuple, op: str) -> tuple:
    (query, key, weights, cu_q, kv_len, table, layout_query, layout_key, sparse_count, sparse_mode, _pre, _next,
     return_value) = a
    info = M.validate_npu_lightning_indexer(query, key, weights, cu_q, kv_len, table, layout_query, layout_key,
                                            sparse_count, sparse_mode, return_value)
    return info, checks_for(M.OP, info, key, table, cu_q, layout_query, layout_key)


def _launch(a: tuple, checked: tuple) -> tuple:
    query, key, weights, cu_q, kv_len, table, layout_query, layout_key, sparse_count, sparse_mode = a[:10]
    info, checks = checked
    out = topk(query, key, weights, None, None, cu_q, kv_len, table, layout_query, layout_key, sparse_count,
               sparse_mode, info, checks)
    return out, query.new_empty((0,))


#: ``offload_ref::npu_lightning_indexer`` on CUDA (``_common.CudaOp``: validated once per signature with the
#: CPU reference's own checks; the data checks on the device)
KERNELS = CudaOp(M.SPEC, _validate, _launch)
run, register = KERNELS.run, KERNELS.register

"""Triton kernels of ``custom::npu_gather_selection_kv_cache`` (+ ``_functional``), twin of
``csrc/npu_gather_selection_kv_cache.cpp``: the recipe's gather, the baseline the offload is measured against.

A row ``r = b*S + s`` owns its ledger row (``selection_kv_block_status[r]``), its ``selection_kv_actual_seq``
entry and the selection blocks its block-table row names, so rows never share a written address (GLM's
selection table is the identity; a table that maps two rows onto the same block gives undefined content on
every backend, as documented in the op module). First the block-table checks (``_check_kernel``, one program
per row, and ``_report_kernel``: every entry the op would dereference, the C++ kernel's checks in its
order; a failure writes nothing and leaves an error record the host raises later, with the C++ kernel's
message), then three launches:

1. ``_ledger_kernel`` (one program per row): the C++ kernel's ledger logic, vectorised over the K
   positions. Valid ids are compacted with a prefix sum; each id is matched against the old ledger (the
   lowest eligible position holding it) by sorting the eligible ``(id, position)`` pairs once
   (``tl.sort``) and one binary search per id: O(K log K) per row, not the O(K^2) all-pairs compare. Kept
   entries at or after position ``n`` move below ``n``, the ids still to write take the free positions in
   ascending order; the ledger is written here and every payload copy is listed (destination, source,
   length).
2. ``_copy_kernel`` (rows x chunks of the list): the copies, many programs per row. Sources of moved
   entries are at positions ``>= n`` and every destination is ``< n``, so a row's copies never overlap.
3. ``_swap_kernel`` (K <= 32 only, any ``bsz``: ``bsz``-token blocks): the maximum (possibly partial) block
   swaps to position ``n - 1`` after the copies, exactly as the C++ kernel.

Block-table bounds are checked on the device, so the op needs no host synchronisation and a CUDA graph can
capture it; the error surfaces at the next ``raise_device_errors`` (the ``cuda`` mode's lowered step calls it
before every step).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import npu_gather_selection_kv_cache as M
from ._common import (COPY_TILE, ERR_GATHER_TABLE, GATHER_TABLE_WORDS, CudaOp, bits, commit, error_flags,
                      error_record, host_operand, next_pow2, out_buffer, require_triton)

triton = require_triton()
import triton.language as tl  # noqa: E402

OP, FUNCTIONAL_OP = M.OP, M.FUNCTIONAL_OP


@triton.jit
def _check_kernel(sbt_ptr, topk_ptr, fbt_ptr, len_ptr, fail_ptr, maxid_ptr, bad_ptr,
                  S, K, bsz, FBS, sbt_cols, fbt_cols, need_blk, n_sel, n_full,
                  BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr):
    """One program per row: the first block-table check the row fails (``M.TABLE_*`` in the C++ kernel's
    order, 0 if none) into ``fail[r]``, the row's largest valid id into ``maxid[r]``, and the largest kind
    into the call's ``bad`` word (the other kernels then write nothing)."""
    r = tl.program_id(0)
    b = r // S
    s = r % S
    Lb = tl.load(len_ptr + b)
    Lr = Lb - (S - 1 - s)
    active = (Lb > 0) & (Lr > 0)
    # an empty row reads no table entry: no column of its selection table, no valid id (-1 limits)
    max_sel = tl.where(active, (Lr + bsz - 1) // bsz - 1, -1)
    r64 = r.to(tl.int64)
    j = tl.arange(0, BLOCK_J)
    jm = j < tl.where(active, need_blk, 0)
    e = tl.load(sbt_ptr + r64 * sbt_cols + j, mask=jm, other=0)
    sel_bad = tl.sum((jm & ((e < 0) | (e >= n_sel))).to(tl.int32), 0) > 0
    k = tl.arange(0, BLOCK_K)
    x = tl.load(topk_ptr + r64 * K + k, mask=k < K, other=-1)
    valid = (k < K) & (x >= 0) & (x <= max_sel)
    col = (x.to(tl.int64) * bsz) // FBS
    in_cols = valid & (col < fbt_cols)
    cols_bad = tl.sum((valid & (col >= fbt_cols)).to(tl.int32), 0) > 0
    ent = tl.load(fbt_ptr + b.to(tl.int64) * fbt_cols + col, mask=in_cols, other=0)
    ent_bad = tl.sum((in_cols & ((ent < 0) | (ent >= n_full))).to(tl.int32), 0) > 0
    kind = tl.where(sel_bad, 1, tl.where(cols_bad, 2, tl.where(ent_bad, 3, 0)))
    tl.store(fail_ptr + r, kind)
    tl.store(maxid_ptr + r, tl.max(tl.where(valid, x, -1), 0))
    tl.atomic_max(bad_ptr, kind)


@triton.jit
def _report_kernel(fail_ptr, maxid_ptr, len_ptr, err_ptr, R, S, n_sel, need_blk, fbt_cols, n_full,
                   BLOCK_R: tl.constexpr):
    """One program: the call's first failing row (row order, as the C++ kernel raises) as the error record
    ``[kind, r, b, max_id, L[b], n_sel, need_blk, fbt_cols, n_full]``, unless a record is already there (the
    first failure since the host last read the words stays)."""
    rr = tl.arange(0, BLOCK_R)
    f = tl.load(fail_ptr + rr, mask=rr < R, other=0)
    first = tl.min(tl.where(f > 0, rr, BLOCK_R), 0)
    if first < R:
        if tl.load(err_ptr) == 0:
            b = first // S
            tl.store(err_ptr + 1, first)
            tl.store(err_ptr + 2, b)
            tl.store(err_ptr + 3, tl.load(maxid_ptr + first))
            tl.store(err_ptr + 4, tl.load(len_ptr + b))
            tl.store(err_ptr + 5, n_sel)
            tl.store(err_ptr + 6, need_blk)
            tl.store(err_ptr + 7, fbt_cols)
            tl.store(err_ptr + 8, n_full)
            tl.store(err_ptr, tl.load(fail_ptr + first))


@triton.jit
def _ledger_kernel(sbt_ptr, status_ptr, topk_ptr, fbt_ptr, len_ptr, act_ptr, bad_ptr,
                   ids_ptr, keep_ptr, kept_ptr, moved_ptr, free_ptr, srt_ptr, cp_ptr, cpn_ptr, swap_ptr,
                   S, K, bsz, SBS, FBS, sbt_cols, fbt_cols,
                   SMALL: tl.constexpr, BLOCK_K: tl.constexpr, LOG_K: tl.constexpr):
    """One program per row: the ledger, and the row's copy list (``cp``: destination, source, length per
    id still to write; the copies run in ``_copy_kernel``). Nothing when the call's tables failed a check."""
    r = tl.program_id(0)
    b = r // S
    s = r % S
    Lb = tl.load(len_ptr + b)
    Lr = Lb - (S - 1 - s)
    tl.store(swap_ptr + r.to(tl.int64) * 4 + 3, 0)
    if (Lb > 0) & (Lr > 0) & (tl.load(bad_ptr) == 0):
        max_sel = (Lr + bsz - 1) // bsz - 1
        r64 = r.to(tl.int64)
        k = tl.arange(0, BLOCK_K)
        km = k < K
        x = tl.load(topk_ptr + r64 * K + k, mask=km, other=-1)
        if SMALL:  # scanning stops at the first negative id
            negi = (km & (x < 0)).to(tl.int32)
            valid = km & (tl.cumsum(negi, 0) == 0) & (x <= max_sel)
        else:      # all K scanned; negatives anywhere dropped
            valid = km & (x >= 0) & (x <= max_sel)
        vi = valid.to(tl.int32)
        n = tl.sum(vi, 0)
        j_of = tl.cumsum(vi, 0) - 1
        row_s = r64 * K                      # this row's scratch rows
        tl.store(ids_ptr + row_s + j_of, x, mask=valid)
        st_row = status_ptr + r64 * (K + 1)
        old = tl.load(st_row + k, mask=km, other=-1)
        if SMALL:
            old_actual = tl.load(st_row + K)
            eligible = tl.where(old_actual > 0, tl.minimum(old_actual // bsz, K), 0)
            elig = k < eligible
        else:
            max_reuse = tl.maximum(max_sel - s - 1, 0)
            elig = km & (old >= 0) & (old <= max_reuse)
        # keep[p] = j: old position p keeps new id j (the lowest eligible position holding the id; when several
        # j find the same p the last one wins: atomic_max, independent of the schedule). O(K log K): the
        # eligible (id, position) pairs sorted once, then one binary search per new id.
        pair = tl.where(elig, old.to(tl.int64) * BLOCK_K + k, 9223372036854775807)
        srt_row = srt_ptr + r64 * BLOCK_K
        tl.store(srt_row + k, tl.sort(pair, 0))
        tl.debug_barrier()
        target = x.to(tl.int64) * BLOCK_K
        lo = tl.zeros([BLOCK_K], tl.int32)
        hi = tl.full([BLOCK_K], BLOCK_K, tl.int32)
        for _ in tl.static_range(LOG_K + 1):
            go = lo < hi
            mid = (lo + hi) // 2
            below = tl.load(srt_row + mid, mask=go, other=0) < target
            lo = tl.where(go & below, mid + 1, lo)
            hi = tl.where(go & ~below, mid, hi)
        hitp = tl.load(srt_row + lo, mask=valid & (lo < BLOCK_K), other=-1)
        found = valid & (lo < BLOCK_K) & (hitp >= 0) & (hitp // BLOCK_K == x.to(tl.int64))
        tl.atomic_max(keep_ptr + row_s + (hitp % BLOCK_K).to(tl.int32), j_of, mask=found)
        tl.debug_barrier()
        keep = tl.load(keep_ptr + row_s + k, mask=km, other=-1)
        # kept entries at/after position n move below n
        moved = (keep >= 0) & (k >= n)
        tl.store(moved_ptr + row_s + keep, k, mask=moved)
        keep = tl.where(moved, -1, keep)
        tl.store(kept_ptr + row_s + keep, tl.full([BLOCK_K], 1, tl.int32), mask=keep >= 0)
        freem = km & (keep < 0)
        fi = freem.to(tl.int32)
        tl.store(free_ptr + row_s + tl.cumsum(fi, 0) - 1, k, mask=freem)
        tl.debug_barrier()
        # the ids still to write (todo rank t -> t-th free position): ledger entries here, copies listed
        jm = k < n
        xj = tl.load(ids_ptr + row_s + k, mask=jm, other=0)
        todo = jm & (tl.load(kept_ptr + row_s + k, mask=jm, other=1) < 0)
        ti = todo.to(tl.int32)
        t = tl.cumsum(ti, 0) - 1
        dst = tl.load(free_ptr + row_s + t, mask=todo, other=0)
        mfrom = tl.load(moved_ptr + row_s + k, mask=todo, other=-1)
        if SMALL:
            tail_len = Lr - max_sel * bsz
            ln = tl.where(xj == max_sel, tail_len, bsz)
        else:
            ln = tl.full([BLOCK_K], 1, tl.int32)
        # token offsets (unit: one token of the payload)
        dtok = dst * bsz
        d_off = tl.load(sbt_ptr + r64 * sbt_cols + dtok // SBS, mask=todo, other=0).to(tl.int64) * SBS + dtok % SBS
        mtok = tl.maximum(mfrom, 0) * bsz
        m_off = tl.load(sbt_ptr + r64 * sbt_cols + mtok // SBS, mask=todo & (mfrom >= 0),
                        other=0).to(tl.int64) * SBS + mtok % SBS
        ftok = xj * bsz
        f_off = tl.load(fbt_ptr + b.to(tl.int64) * fbt_cols + ftok // FBS, mask=todo & (mfrom < 0),
                        other=0).to(tl.int64) * FBS + ftok % FBS
        cp = cp_ptr + (row_s + t).to(tl.int64) * 3
        tl.store(cp, d_off, mask=todo)
        tl.store(cp + 1, tl.where(mfrom >= 0, m_off, f_off), mask=todo)
        tl.store(cp + 2, tl.where(mfrom >= 0, ln, -ln).to(tl.int64), mask=todo)  # sign: from the selection
        tl.store(cpn_ptr + r, tl.sum(ti, 0))
        tl.store(st_row + dst, xj, mask=todo)
        tl.debug_barrier()
        if SMALL:
            tail_len = Lr - max_sel * bsz
            actual = tl.sum(tl.where(valid, tl.where(x == max_sel, tail_len, bsz), 0), 0)
            if n > 0:
                mx = tl.max(tl.where(valid, x, -1), 0)
                cur = tl.load(st_row + k, mask=km, other=-1)
                last = tl.load(st_row + n - 1)
                if last != mx:  # the max (possibly partial) block must end the selection (_swap_kernel)
                    pm = tl.min(tl.where((k < n) & (cur == mx), k, BLOCK_K), 0)
                    atok = pm * bsz
                    ztok = (n - 1) * bsz
                    sw = swap_ptr + r64 * 4
                    tl.store(sw, tl.load(sbt_ptr + r64 * sbt_cols + atok // SBS).to(tl.int64) * SBS + atok % SBS)
                    tl.store(sw + 1, tl.load(sbt_ptr + r64 * sbt_cols + ztok // SBS).to(tl.int64) * SBS + ztok % SBS)
                    tl.store(sw + 2, tl.where(mx == max_sel, tail_len, bsz).to(tl.int64))
                    tl.store(sw + 3, 1)
                    tl.debug_barrier()
                    tl.store(st_row + pm, last)
                    tl.store(st_row + n - 1, mx)
        else:
            actual = n
        tl.debug_barrier()
        tl.store(st_row + k, tl.full([BLOCK_K], -1, tl.int32), mask=km & (k >= n))
        tl.store(st_row + K, actual)
        tl.store(act_ptr + r, actual)


@triton.jit
def _copy_kernel(skv_ptr, srp_ptr, fkv_ptr, frp_ptr, cp_ptr, cpn_ptr, K, Dkv, Dr,
                 HAS_ROPE: tl.constexpr, CH: tl.constexpr, BLOCK_EKV: tl.constexpr, BLOCK_ER: tl.constexpr):
    """``CH`` entries of row ``program_id(0)``'s copy list per program (grid: rows x chunks): the sources of
    moved entries sit at positions >= n, every destination below n, so a row's copies never overlap."""
    r = tl.program_id(0)
    t = tl.program_id(1) * CH + tl.arange(0, CH)
    tm = t < tl.load(cpn_ptr + r)
    cp = cp_ptr + (r.to(tl.int64) * K + t) * 3
    d_off = tl.load(cp, mask=tm, other=0)
    src = tl.load(cp + 1, mask=tm, other=0)
    sln = tl.load(cp + 2, mask=tm, other=0)
    ln = tl.abs(sln)
    from_sel = (sln > 0)[:, None]
    e = tl.arange(0, BLOCK_EKV)[None, :]
    em = tm[:, None] & (e < ln[:, None] * Dkv)
    a = tl.load(skv_ptr + src[:, None] * Dkv + e, mask=em & from_sel, other=0)
    f = tl.load(fkv_ptr + src[:, None] * Dkv + e, mask=em & ~from_sel, other=0)
    tl.store(skv_ptr + d_off[:, None] * Dkv + e, tl.where(from_sel, a, f), mask=em)
    if HAS_ROPE:
        e = tl.arange(0, BLOCK_ER)[None, :]
        em = tm[:, None] & (e < ln[:, None] * Dr)
        a = tl.load(srp_ptr + src[:, None] * Dr + e, mask=em & from_sel, other=0)
        f = tl.load(frp_ptr + src[:, None] * Dr + e, mask=em & ~from_sel, other=0)
        tl.store(srp_ptr + d_off[:, None] * Dr + e, tl.where(from_sel, a, f), mask=em)


@triton.jit
def _swap_kernel(skv_ptr, srp_ptr, swap_ptr, bsz, Dkv, Dr,
                 HAS_ROPE: tl.constexpr, BLOCK_EKV: tl.constexpr, BLOCK_ER: tl.constexpr):
    """K <= 32 path, after the copies: the row's maximum (possibly partial) block swaps with its last one."""
    sw = swap_ptr + tl.program_id(0).to(tl.int64) * 4
    if tl.load(sw + 3) != 0:
        a_off = tl.load(sw)
        z_off = tl.load(sw + 1)
        lnm = tl.load(sw + 2)
        e1 = tl.arange(0, BLOCK_EKV)
        blk_max = tl.load(skv_ptr + a_off * Dkv + e1, mask=e1 < lnm * Dkv)
        blk_last = tl.load(skv_ptr + z_off * Dkv + e1, mask=e1 < bsz * Dkv)
        if HAS_ROPE:
            e2 = tl.arange(0, BLOCK_ER)
            rmax = tl.load(srp_ptr + a_off * Dr + e2, mask=e2 < lnm * Dr)
            rlast = tl.load(srp_ptr + z_off * Dr + e2, mask=e2 < bsz * Dr)
        tl.debug_barrier()
        tl.store(skv_ptr + z_off * Dkv + e1, blk_max, mask=e1 < lnm * Dkv)
        tl.store(skv_ptr + a_off * Dkv + e1, blk_last, mask=e1 < bsz * Dkv)
        if HAS_ROPE:
            tl.store(srp_ptr + z_off * Dr + e2, rmax, mask=e2 < lnm * Dr)
            tl.store(srp_ptr + a_off * Dr + e2, rlast, mask=e2 < bsz * Dr)


class _Launch(NamedTuple):
    """What a call signature fixes (computed once per signature with the validation)."""

    geo: "M.GatherGeometry"
    R: int
    block_k: int
    small: bool
    block_ekv: int
    block_er: int
    has_rope: bool
    need_blk: int
    block_j: int
    ch: int


def _validate(a: tuple, op: str) -> _Launch:
    """The op's checks (``validate_npu_gather_selection_kv_cache``) and the launch constants of the signature."""
    geo = M.validate_npu_gather_selection_kv_cache(*a, op=op)
    sel_rope, sel_kv = a[0], a[1]
    K, bsz, R = geo.K, geo.bsz, geo.B * geo.S
    has_rope = not geo.no_rope
    small = K <= M.SMALL_TOPK
    tokens = bsz if small else 1
    block_ekv = next_pow2(tokens * sel_kv.size(2))
    need_blk = (K * bsz + sel_kv.size(1) - 1) // sel_kv.size(1)
    return _Launch(geo, R, next_pow2(K), small, block_ekv, next_pow2(tokens * (sel_rope.size(2) if has_rope else 1)),
                   has_rope, need_blk, next_pow2(need_blk),
                   max(1, min(64, next_pow2(K), COPY_TILE // block_ekv)))  # list entries per [CH, E] tile


def launch(a: tuple, cfg: _Launch) -> torch.Tensor:
    """Run the kernels on validated arguments (in place); returns ``selection_kv_actual_seq``.

    The block-table entries the op dereferences are checked on the device first (``_check_kernel``): a bad
    entry writes nothing and leaves an error record that ``_common.raise_device_errors`` (``offload_passes.
    cuda.raise_device_errors``) raises with the C++ kernel's message; no host synchronisation."""
    sel_rope, sel_kv, sbt, status, topk, full_rope, full_kv, fbt, kv_len = a[:9]
    if sel_kv.is_cuda:  # paged host KV: the copies read the full caches through the pinned address
        host_operand(full_kv, OP, "full_kv")
        if not cfg.geo.no_rope:
            host_operand(full_rope, OP, "full_rope")
    geo, R = cfg.geo, cfg.R
    S, K, bsz = geo.S, geo.K, geo.bsz
    topk2 = topk.contiguous()
    sbt_c, fbt_c, len_c = sbt.contiguous(), fbt.contiguous(), kv_len.contiguous()
    full_kv_d = full_kv.contiguous()
    outs = [out_buffer(t) for t in (sel_rope, sel_kv, status)]
    dev = sel_kv.device
    block_k = cfg.block_k
    # scratch: the -1-filled int32 words (ids, keep, kept, moved, free, per-row list length, the table checks'
    # kinds and largest ids, the call's bad word) in one fill; the int64 words (sorted pairs, copy lists,
    # swaps) are written before they are read
    words = torch.full((5 * R * K + 3 * R + 1,), -1, dtype=torch.int32, device=dev)
    ids, keep, kept, moved, free, cpn, fail, maxid, bad = words.split([R * K] * 5 + [R, R, R, 1])
    wide = torch.empty((R * block_k + 3 * R * K + 4 * R,), dtype=torch.int64, device=dev)
    srt, cp, swap = wide.split([R * block_k, 3 * R * K, 4 * R])
    act = torch.zeros(sbt.size(0), dtype=torch.int32, device=dev)
    n_sel, n_full, sbt_cols, fbt_cols = sel_kv.size(0), full_kv.size(0), sbt_c.size(1), fbt_c.size(1)
    _check_kernel[(R,)](sbt_c, topk2, fbt_c, len_c, fail, maxid, bad, S, K, bsz, full_kv.size(1), sbt_cols,
                        fbt_cols, cfg.need_blk, n_sel, n_full, BLOCK_K=block_k, BLOCK_J=cfg.block_j)
    _report_kernel[(1,)](fail, maxid, len_c, error_flags(dev)[ERR_GATHER_TABLE:], R, S, n_sel, cfg.need_blk,
                         fbt_cols, n_full, BLOCK_R=next_pow2(R))
    Dkv = sel_kv.size(2)
    Dr = sel_rope.size(2) if cfg.has_rope else 1
    rope_sel = bits(outs[0]) if cfg.has_rope else bits(outs[1])    # unused pointers in no-rope mode
    rope_full = bits(full_rope.contiguous()) if cfg.has_rope else bits(full_kv_d)
    _ledger_kernel[(R,)](
        sbt_c, outs[2], topk2, fbt_c, len_c, act, bad, ids, keep, kept, moved, free, srt, cp, cpn, swap,
        S, K, bsz, sel_kv.size(1), full_kv.size(1), sbt_cols, fbt_cols,
        SMALL=cfg.small, BLOCK_K=block_k, LOG_K=block_k.bit_length() - 1,
    )
    _copy_kernel[(R, triton.cdiv(K, cfg.ch))](
        bits(outs[1]), rope_sel, bits(full_kv_d), rope_full, cp, cpn, K, Dkv, Dr,
        HAS_ROPE=cfg.has_rope, CH=cfg.ch, BLOCK_EKV=cfg.block_ekv, BLOCK_ER=cfg.block_er)
    if cfg.small:
        _swap_kernel[(R,)](bits(outs[1]), rope_sel, swap, bsz, Dkv, Dr, HAS_ROPE=cfg.has_rope,
                           BLOCK_EKV=cfg.block_ekv, BLOCK_ER=cfg.block_er)
    for dst, buf in zip((sel_rope, sel_kv, status), outs):
        commit(dst, buf)
    return act


def _table_message(record: list) -> str:
    """The text of the gather's error record (``_report_kernel``): the C++ kernel's message."""
    kind, r, b, max_id, L_b, n_sel, need_blk, fbt_cols, n_full = record
    return f"{M.SPEC.qualname}: " + M.table_error(kind, r, b, max_id, L_b, n_sel, need_blk, fbt_cols, n_full)


error_record(ERR_GATHER_TABLE, GATHER_TABLE_WORDS, _table_message)

#: ``custom::npu_gather_selection_kv_cache`` (+ ``_functional``: ``(actual_seq, rope, kv, table, status)``,
#: inputs untouched) on CUDA (``_common.CudaOp``: bound once, validated once per signature; the geometry the
#: validation returns is handed to the launcher)
KERNELS = CudaOp(M.SPEC, _validate, launch)
run, run_functional, register = KERNELS.run, KERNELS.run_functional, KERNELS.register

"""Triton kernel of ``custom::npu_gather_selection_kv_cache`` (+ ``_functional``), twin of
``csrc/npu_gather_selection_kv_cache.cpp``.

One program per query row ``r = b*S + s``: a row owns its ledger row (``selection_kv_block_status[r]``),
its ``selection_kv_actual_seq`` entry and the selection blocks its block-table row names, so rows never
share a written address (GLM's selection table is the identity; a table that maps two rows onto the same
block gives undefined content on every backend, as documented in the op module). Inside a row the ledger
logic is the C++ kernel's, vectorised over the K positions: valid ids are compacted with a prefix sum,
each id is matched against the old ledger (lowest eligible position, ``CH`` ids at a time), kept entries at or after position
``n`` are moved below ``n``, and the ids still to write go to the free positions in ascending order. The
sources of moved entries are at positions ``>= n`` and every destination is ``< n``, so the copies of a
row never overlap. The K <= 32 path (any ``bsz``) copies ``bsz``-token blocks and swaps the maximum
(possibly partial) block to position ``n - 1``, exactly as the C++ kernel.

Block-table bounds: every entry the op would dereference is checked before anything is written, with
the C++ kernel's messages (the reference's ``_check_tables`` runs on the host: on a GPU this is one
device-to-host synchronisation per call, so this op, which only the *unmodified* model uses, cannot be
captured in a CUDA graph; the offload graph replaces it by ``dsa_serve``).
"""
from __future__ import annotations

import torch

from .. import _library as L
from .. import npu_gather_selection_kv_cache as M
from ._common import bits, commit, next_pow2, out_buffer, require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402

OP, FUNCTIONAL_OP = M.OP, M.FUNCTIONAL_OP


@triton.jit
def _gather_kernel(skv_ptr, srp_ptr, sbt_ptr, status_ptr, topk_ptr, fkv_ptr, frp_ptr, fbt_ptr, len_ptr, act_ptr,
                   ids_ptr, keep_ptr, kept_ptr, moved_ptr, free_ptr,
                   S, K, bsz, SBS, FBS, sbt_cols, fbt_cols, Dkv, Dr,
                   SMALL: tl.constexpr, HAS_ROPE: tl.constexpr, BLOCK_K: tl.constexpr, CH: tl.constexpr,
                   BLOCK_EKV: tl.constexpr, BLOCK_ER: tl.constexpr):
    r = tl.program_id(0)
    b = r // S
    s = r % S
    Lb = tl.load(len_ptr + b)
    Lr = Lb - (S - 1 - s)
    if (Lb > 0) & (Lr > 0):
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
        tl.debug_barrier()
        # keep[p] = j: old position p keeps new id j (the lowest eligible position holding the id; when
        # several j find the same p the last one wins: atomic_max, independent of the schedule)
        # Loops with a runtime bound are while loops, not range(): the Triton interpreter of triton 3.4 and
        # 3.6 (torch 2.8 and 2.10) turns range()'s bound into an int with int() on a one-element array,
        # which numpy >= 2.4 refuses (docs/versions.md); compiled, a while loop is an scf.while of the same steps.
        j0 = 0
        while j0 < n:
            jj = j0 + tl.arange(0, CH)
            jm = jj < n
            xj = tl.load(ids_ptr + row_s + jj, mask=jm, other=0)
            eq = jm[:, None] & elig[None, :] & (xj[:, None] == old[None, :])
            p = tl.min(tl.where(eq, k[None, :], BLOCK_K), 1)
            tl.atomic_max(keep_ptr + row_s + p, jj, mask=jm & (p < BLOCK_K))
            j0 += CH
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
        # copy the ids still to write, CH at a time (todo rank t -> t-th free position)
        t0 = 0
        j0 = 0
        while j0 < n:
            jj = j0 + tl.arange(0, CH)
            jm = jj < n
            xj = tl.load(ids_ptr + row_s + jj, mask=jm, other=0)
            todo = jm & (tl.load(kept_ptr + row_s + jj, mask=jm, other=1) == 0)
            ti = todo.to(tl.int32)
            t = t0 + tl.cumsum(ti, 0) - 1
            t0 += tl.sum(ti, 0)
            dst = tl.load(free_ptr + row_s + t, mask=todo, other=0)
            mfrom = tl.load(moved_ptr + row_s + jj, mask=todo, other=-1)
            if SMALL:
                tail_len = Lr - max_sel * bsz
                ln = tl.where(xj == max_sel, tail_len, bsz)
            else:
                ln = tl.full([CH], 1, tl.int32)
            # token offsets (unit: one token of the payload)
            dtok = dst * bsz
            d_off = tl.load(sbt_ptr + r64 * sbt_cols + dtok // SBS, mask=todo, other=0).to(tl.int64) * SBS + dtok % SBS
            mtok = tl.maximum(mfrom, 0) * bsz
            m_off = tl.load(sbt_ptr + r64 * sbt_cols + mtok // SBS, mask=todo & (mfrom >= 0),
                            other=0).to(tl.int64) * SBS + mtok % SBS
            ftok = xj * bsz
            f_off = tl.load(fbt_ptr + b.to(tl.int64) * fbt_cols + ftok // FBS, mask=todo & (mfrom < 0),
                            other=0).to(tl.int64) * FBS + ftok % FBS
            from_sel = (mfrom >= 0)[:, None]
            e = tl.arange(0, BLOCK_EKV)[None, :]
            em = todo[:, None] & (e < ln[:, None] * Dkv)
            a = tl.load(skv_ptr + m_off[:, None] * Dkv + e, mask=em & from_sel, other=0)
            f = tl.load(fkv_ptr + f_off[:, None] * Dkv + e, mask=em & ~from_sel, other=0)
            tl.store(skv_ptr + d_off[:, None] * Dkv + e, tl.where(from_sel, a, f), mask=em)
            if HAS_ROPE:
                e = tl.arange(0, BLOCK_ER)[None, :]
                em = todo[:, None] & (e < ln[:, None] * Dr)
                a = tl.load(srp_ptr + m_off[:, None] * Dr + e, mask=em & from_sel, other=0)
                f = tl.load(frp_ptr + f_off[:, None] * Dr + e, mask=em & ~from_sel, other=0)
                tl.store(srp_ptr + d_off[:, None] * Dr + e, tl.where(from_sel, a, f), mask=em)
            tl.store(st_row + dst, xj, mask=todo)
            j0 += CH
        tl.debug_barrier()
        if SMALL:
            tail_len = Lr - max_sel * bsz
            actual = tl.sum(tl.where(valid, tl.where(x == max_sel, tail_len, bsz), 0), 0)
            if n > 0:
                mx = tl.max(tl.where(valid, x, -1), 0)
                cur = tl.load(st_row + k, mask=km, other=-1)
                last = tl.load(st_row + n - 1)
                if last != mx:  # the max (possibly partial) block must end the selection
                    pm = tl.min(tl.where((k < n) & (cur == mx), k, BLOCK_K), 0)
                    lnm = tl.where(mx == max_sel, tail_len, bsz)
                    atok = pm * bsz
                    ztok = (n - 1) * bsz
                    a_off = tl.load(sbt_ptr + r64 * sbt_cols + atok // SBS).to(tl.int64) * SBS + atok % SBS
                    z_off = tl.load(sbt_ptr + r64 * sbt_cols + ztok // SBS).to(tl.int64) * SBS + ztok % SBS
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
                    tl.store(st_row + pm, last)
                    tl.store(st_row + n - 1, mx)
        else:
            actual = n
        tl.debug_barrier()
        tl.store(st_row + k, tl.full([BLOCK_K], -1, tl.int32), mask=km & (k >= n))
        tl.store(st_row + K, actual)
        tl.store(act_ptr + r, actual)


def _active_rows(topk, kv_len, B: int, S: int, bsz: int) -> list:
    """``(r, b, max_sel)`` of the non-empty rows (the rows whose tables the op dereferences)."""
    lens = kv_len.tolist()
    out = []
    for r in range(B * S):
        b, s = divmod(r, S)
        Lr = lens[b] - (S - 1 - s)
        if lens[b] > 0 and Lr > 0:
            out.append((r, b, (Lr + bsz - 1) // bsz - 1))
    return out


def launch(sel_rope, sel_kv, sbt, status, topk, full_rope, full_kv, fbt, kv_len, geo: "M.GatherGeometry"):
    """Run the kernel on validated arguments (in place); returns ``selection_kv_actual_seq``."""
    B, S, K, bsz = geo.B, geo.S, geo.K, geo.bsz
    R = B * S
    topk2 = topk.contiguous().reshape(R, K)
    sbt_c, fbt_c, len_c = sbt.contiguous(), fbt.contiguous(), kv_len.contiguous()
    full_kv_d = L.dense(full_kv, OP, "full_kv_cache")
    full_rope_d = L.dense(full_rope, OP, "full_k_rope")
    # Same pre-pass (and messages) as the C++ kernel: before anything is written.
    M._check_tables(_active_rows(topk2, len_c, B, S, bsz), sbt_c, fbt_c, topk2, len_c, geo, sel_kv.size(0),
                    full_kv.size(0), full_kv.size(1), sel_kv.size(1), OP)
    outs = [out_buffer(t) for t in (sel_rope, sel_kv, status)]
    dev = sel_kv.device
    act = torch.zeros(sbt.size(0), dtype=torch.int32, device=dev)
    scratch = dict(ids=torch.zeros(R * K, dtype=torch.int32, device=dev),
                   keep=torch.full((R * K,), -1, dtype=torch.int32, device=dev),
                   kept=torch.zeros(R * K, dtype=torch.int32, device=dev),
                   moved=torch.full((R * K,), -1, dtype=torch.int32, device=dev),
                   free=torch.zeros(R * K, dtype=torch.int32, device=dev))
    has_rope = not geo.no_rope and sel_rope.size(2) > 0
    Dkv = sel_kv.size(2)
    Dr = sel_rope.size(2) if has_rope else 1
    rope_sel = bits(outs[0]) if has_rope else bits(outs[1])    # unused pointers in no-rope mode
    rope_full = bits(full_rope_d) if has_rope else bits(full_kv_d)
    small = K <= M.SMALL_TOPK
    tokens = bsz if small else 1
    block_k, block_ekv = next_pow2(K), next_pow2(tokens * Dkv)
    ch = min(block_k, 64, max(1, 16384 // block_k), max(1, 16384 // block_ekv))  # ids per [CH, K] / [CH, E] tile
    _gather_kernel[(R,)](
        bits(outs[1]), rope_sel, sbt_c, outs[2], topk2, bits(full_kv_d), rope_full, fbt_c, len_c, act,
        scratch["ids"], scratch["keep"], scratch["kept"], scratch["moved"], scratch["free"],
        S, K, bsz, sel_kv.size(1), full_kv.size(1), sbt_c.size(1), fbt_c.size(1), Dkv, Dr,
        SMALL=small, HAS_ROPE=has_rope, BLOCK_K=block_k, CH=ch,
        BLOCK_EKV=block_ekv, BLOCK_ER=next_pow2(tokens * Dr),
    )
    for dst, buf in zip((sel_rope, sel_kv, status), outs):
        commit(dst, buf)
    return act


def run(selection_k_rope, selection_kv_cache, selection_kv_block_table, selection_kv_block_status,
        selection_topk_indices, full_k_rope, full_kv_cache, full_kv_block_table, full_kv_actual_seq,
        full_q_actual_seq, selection_topk_block_size: int = 64) -> torch.Tensor:
    """``custom::npu_gather_selection_kv_cache`` through the Triton kernel (in place, same validation)."""
    geo = M.validate_npu_gather_selection_kv_cache(
        selection_k_rope, selection_kv_cache, selection_kv_block_table, selection_kv_block_status,
        selection_topk_indices, full_k_rope, full_kv_cache, full_kv_block_table, full_kv_actual_seq,
        full_q_actual_seq, selection_topk_block_size)
    return launch(selection_k_rope, selection_kv_cache, selection_kv_block_table, selection_kv_block_status,
                  selection_topk_indices, full_k_rope, full_kv_cache, full_kv_block_table, full_kv_actual_seq, geo)


def run_functional(selection_k_rope, selection_kv_cache, selection_kv_block_table, selection_kv_block_status,
                   selection_topk_indices, full_k_rope, full_kv_cache, full_kv_block_table, full_kv_actual_seq,
                   full_q_actual_seq, selection_topk_block_size: int = 64) -> tuple:
    """The functional twin: ``(actual_seq, rope, kv, table, status)`` clones, inputs untouched."""
    geo = M.validate_npu_gather_selection_kv_cache(
        selection_k_rope, selection_kv_cache, selection_kv_block_table, selection_kv_block_status,
        selection_topk_indices, full_k_rope, full_kv_cache, full_kv_block_table, full_kv_actual_seq,
        full_q_actual_seq, selection_topk_block_size, op=FUNCTIONAL_OP)
    rope, kv, table, status = (selection_k_rope.clone(), selection_kv_cache.clone(),
                               selection_kv_block_table.clone(), selection_kv_block_status.clone())
    act = launch(rope, kv, table, status, selection_topk_indices, full_k_rope, full_kv_cache, full_kv_block_table,
                 full_kv_actual_seq, geo)
    return act, rope, kv, table, status


def register() -> list[str]:
    return [n for n, fn in ((OP, run), (FUNCTIONAL_OP, run_functional)) if L.impl(n, "CUDA", fn)]

"""Triton kernels of ``custom::dsa_install`` (FIFO) and ``offload_ref::dsa_install_sc`` (second chance).

Twin of ``csrc/_install_common.h`` (+ ``dsa_install.cpp`` / ``dsa_install_sc.cpp``), CPU ``base = 0``
records layout. The C++ kernel walks a batch row's records in order; here the work is partitioned by
**(batch row, set)** so that many programs run at once and none races another:

1. ``_first_kernel`` / ``_cand_kernel`` (record-parallel): per-row dedupe. The first occurrence of an
   id is the valid record with the smallest global index ``g = mt*cap + i``; ``atomic_max`` of
   ``INT32_MAX - g`` over ``[B, IR]`` gives the same answer whatever the order of the programs. Each
   installing record gets the key ``b*NS + set``; a stable device sort of the keys lists every set's
   installs in record order.
2. ``_assign_kernel`` (one program per ``(b, set)``): finds its set's run in the sorted keys by binary
   search and walks it in record order. The victim choice (FIFO pointer, or the
   second-chance reference bits, set first from the plan's POOL_HIT rows of that set), the set's
   counter (a register) and its 16 ``pool_ids`` entries are owned by that program: **per-set independence**
   (a record only ever touches the ways of the set it names, and a set's counter only moves with its own
   installs) makes this equal to the sequential order. Each install logs its slot and the evicted id
   under its index ``g``.
3. ``_keys_kernel``: writes that can cross sets (``id_to_slot`` of an evicted id or of the installed
   id, and payload rows, which batch rows share when ``PS % selection_block_size != 0``) are resolved
   as "last write in record order wins", as in the sequential kernel: ``atomic_max`` of the write's
   sequence number (``2g`` eviction, ``2g+1`` claim, ``g`` payload) per destination.
4. ``_apply_kernel``: only the winning write of each destination is performed (one writer per address).

``metadata_update=0`` runs steps 1-4 on a private copy of the counters and writes the payload only. A
zero-width rope (the no-rope mode, docs/ops.md §3.3) is skipped at compile time (``HAS_ROPE``). The launch
constants of a call signature are computed once, with its validation (:func:`prepare`, ``_common.CudaOp``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import dsa_install as M
from .._records import records_layout
from ._common import COPY_TILE, CudaOp, bits, commit, int32_words, next_pow2, out_buffer, require_triton
from ._kinds import POOL_HIT

triton = require_triton()
import triton.language as tl  # noqa: E402

OP, FUNCTIONAL_OP = M.OP, M.FUNCTIONAL_OP
WAYS = M.WAYS  # the pool associativity (custom_ops/_pool.py)


@triton.jit
def _first_kernel(words_ptr, first_ptr, MT, S, K, IR, NS, stride_w, cnt_w, cap, BLOCK_CAP: tl.constexpr,
                  MPP: tl.constexpr):
    idx = tl.arange(0, MPP * BLOCK_CAP)       # MPP microtasks per program, BLOCK_CAP record slots each
    mt = tl.program_id(0) * MPP + idx // BLOCK_CAP
    i = idx % BLOCK_CAP
    b = mt // (S * 8)
    n = tl.minimum(tl.load(words_ptr + cnt_w + mt.to(tl.int64) * 8, mask=mt < MT, other=0), cap)
    im = (mt < MT) & (i < n)
    rb = words_ptr + mt.to(tl.int64) * stride_w + 4 * i  # one 16-byte record [set, id, seq, pos]
    st = tl.load(rb, mask=im, other=-1)
    x = tl.load(rb + 1, mask=im, other=-1)
    sq = tl.load(rb + 2, mask=im, other=-1)
    pos = tl.load(rb + 3, mask=im, other=-1)
    ok = im & (x >= 0) & (x < IR) & (st >= 0) & (st < NS) & (sq >= 0) & (sq < S) & (pos >= 0) & (pos < K)
    # first[b, x] = INT32_MAX - (smallest g): an atomic_max on the -1-filled scratch (no second fill)
    tl.atomic_max(first_ptr + b.to(tl.int64) * IR + x, 2147483647 - (mt * cap + i), mask=ok)


@triton.jit
def _cand_kernel(words_ptr, first_ptr, key_ptr, MT, S, K, IR, NS, stride_w, cnt_w, cap, sentinel,
                 BLOCK_CAP: tl.constexpr, MPP: tl.constexpr):
    # key[g] = b*NS + set for the records that install (valid and first-seen), sentinel for the others
    idx = tl.arange(0, MPP * BLOCK_CAP)
    mt = tl.program_id(0) * MPP + idx // BLOCK_CAP
    i = idx % BLOCK_CAP
    b = mt // (S * 8)
    inside = (mt < MT) & (i < cap)
    n = tl.minimum(tl.load(words_ptr + cnt_w + mt.to(tl.int64) * 8, mask=mt < MT, other=0), cap)
    im = (mt < MT) & (i < n)
    rb = words_ptr + mt.to(tl.int64) * stride_w + 4 * i
    st = tl.load(rb, mask=im, other=-1)
    x = tl.load(rb + 1, mask=im, other=-1)
    sq = tl.load(rb + 2, mask=im, other=-1)
    pos = tl.load(rb + 3, mask=im, other=-1)
    ok = im & (x >= 0) & (x < IR) & (st >= 0) & (st < NS) & (sq >= 0) & (sq < S) & (pos >= 0) & (pos < K)
    g = mt * cap + i
    fst = tl.load(first_ptr + b.to(tl.int64) * IR + x, mask=ok, other=-1)
    tl.store(key_ptr + g, tl.where(ok & (fst == 2147483647 - g), b * NS + st, sentinel), mask=inside)


@triton.jit
def _ref_kernel(plan_ptr, ref_ptr, rows, SK, NS, PS, BLOCK_Q: tl.constexpr):
    # second chance: one lane per plan row; a POOL_HIT row clears its way's bit in its set's word of the
    # -1-filled scratch (atomic_and: the same bits whatever the order; the word holds the *inverted*
    # reference bits), so every set's bits cost O(B*S*K) in all
    q = tl.program_id(0).to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    qm = q < rows
    kd = tl.load(plan_ptr + 2 * q, mask=qm, other=0)
    v = tl.load(plan_ptr + 2 * q + 1, mask=qm, other=-1)
    hit = qm & (kd == POOL_HIT) & (v >= 0) & (v < PS)
    b = q // SK
    tl.atomic_and(ref_ptr + b * NS + v // 16, ~(1 << (v % 16)), mask=hit)


@triton.jit
def _lower_bound(sorted_ptr, n, key):
    """First index of the sorted ``sorted_ptr[:n]`` whose value is >= ``key`` (binary search)."""
    lo = n * 0
    hi = n
    while lo < hi:
        mid = (lo + hi) // 2
        below = tl.load(sorted_ptr + mid) < key
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit
def _assign_kernel(words_ptr, sorted_ptr, order_ptr, n_keys, lru_ptr, pid_ptr, ref_ptr, log_slot_ptr,
                   log_old_ptr, S, K, NS, PS, stride_w, cap,
                   SECOND_CHANCE: tl.constexpr, UPDATE: tl.constexpr):
    b = tl.program_id(0)
    me = tl.program_id(1)
    c = tl.load(lru_ptr + b.to(tl.int64) * NS + me)
    if SECOND_CHANCE:
        # reference bits of this set's hits, gathered once for all sets by _ref_kernel (stored inverted)
        c = c | ((~tl.load(ref_ptr + b.to(tl.int64) * NS + me) & 0xFFFF) << 4)
    # This set's installs, in record order: the run of key b*NS + me in the stably sorted install keys
    # (the launcher's device sort), found by two binary searches (no count / prefix-sum launches).
    # The set's 16 pool_ids entries are owned by this program; a barrier after each write makes it
    # visible to every thread of the program before the next install reads it.
    row_ids = pid_ptr + b.to(tl.int64) * PS + me * 16
    key = b * NS + me
    first = _lower_bound(sorted_ptr, n_keys, key)
    n_installs = _lower_bound(sorted_ptr, n_keys, key + 1) - first
    t = 0
    while t < n_installs:  # not range(runtime bound): see the note in npu_gather_selection_kv_cache.py
        g = tl.load(order_ptr + first + t)
        x = tl.load(words_ptr + (g // cap).to(tl.int64) * stride_w + 4 * (g % cap) + 1)
        if SECOND_CHANCE:
            # first way from the pointer whose reference bit is clear; the set bits before it are
            # cleared (all 16 set: all cleared, the pointer's way)
            ptr = c & 15
            ref = (c >> 4) & 0xFFFF
            rot = ((ref >> ptr) | (ref << (16 - ptr))) & 0xFFFF
            ones = (~rot & (rot + 1)) - 1          # the trailing set bits of rot
            v = ones - ((ones >> 1) & 0x5555)       # popcount(ones) = ways skipped
            v = (v & 0x3333) + ((v >> 2) & 0x3333)
            v = (v + (v >> 4)) & 0x0F0F
            skip = (v + (v >> 8)) & 0x1F
            way = (ptr + skip) & 15
            cleared = ((ones << ptr) | (ones >> (16 - ptr))) & 0xFFFF
            c = ((c & ~(cleared << 4)) & ~15) | ((way + 1) & 15)
        else:
            way = c & 15
            c = ((c & 15) + 1) & 15
        old = tl.load(row_ids + way)
        tl.store(row_ids + way, x)
        tl.store(log_slot_ptr + g, me * 16 + way)
        tl.store(log_old_ptr + g, old)
        tl.debug_barrier()
        t += 1
    if UPDATE:
        tl.store(lru_ptr + b.to(tl.int64) * NS + me, c)


@triton.jit
def _install_lane(words_ptr, log_slot_ptr, MT, S, stride_w, cap, BLOCK_CAP: tl.constexpr, LANES: tl.constexpr):
    """This program's LANES lanes of the (microtask, record slot) space, BLOCK_CAP slots per microtask:
    (row b, log index g, pool slot, installs?, and the record [set, id, seq, pos])."""
    idx = tl.program_id(0) * LANES + tl.arange(0, LANES)
    mt = idx // BLOCK_CAP
    i = idx % BLOCK_CAP
    b = (mt // (S * 8)).to(tl.int64)
    g = mt * cap + i
    slot = tl.load(log_slot_ptr + g, mask=(mt < MT) & (i < cap), other=-1)
    inst = slot >= 0
    rb = words_ptr + mt.to(tl.int64) * stride_w + 4 * i  # one 16-byte record [set, id, seq, pos]
    st = tl.load(rb, mask=inst, other=-1)
    x = tl.load(rb + 1, mask=inst, other=-1)
    sq = tl.load(rb + 2, mask=inst, other=-1)
    pos = tl.load(rb + 3, mask=inst, other=-1)
    return b, g, slot, inst, st, x, sq, pos


@triton.jit
def _keys_kernel(words_ptr, log_slot_ptr, log_old_ptr, win_i2s_ptr, win_dst_ptr,
                 MT, S, IR, stride_w, cap, pool_row_base, UPDATE: tl.constexpr, BLOCK_CAP: tl.constexpr,
                 MPP: tl.constexpr):
    b, g, slot, inst, st, x, sq, pos = _install_lane(words_ptr, log_slot_ptr, MT, S, stride_w, cap, BLOCK_CAP,
                                                     MPP * BLOCK_CAP)
    if UPDATE:
        old = tl.load(log_old_ptr + g, mask=inst, other=-1)
        tl.atomic_max(win_i2s_ptr + b * IR + old, 2 * g, mask=inst & (old >= 0) & (old < IR))
        tl.atomic_max(win_i2s_ptr + b * IR + x, 2 * g + 1, mask=inst)
    tl.atomic_max(win_dst_ptr + b * pool_row_base + slot, g, mask=inst)


@triton.jit
def _apply_kernel(words_ptr, log_slot_ptr, log_old_ptr, win_i2s_ptr, win_dst_ptr, i2s_ptr,
                  skv_ptr, srp_ptr, pkv_ptr, prp_ptr,
                  MT, S, IR, stride_w, cap, pool_row_base, blocks_per_row, sbs, Dkv, Dr,
                  UPDATE: tl.constexpr, BLOCK_CAP: tl.constexpr, BLOCK_DKV: tl.constexpr,
                  BLOCK_DR: tl.constexpr, LANES: tl.constexpr, HAS_ROPE: tl.constexpr):
    # LANES x BLOCK_DKV is the copy tile: sized by the launcher (COPY_TILE), not by the record capacity
    b, g, slot, inst, st, x, sq, pos = _install_lane(words_ptr, log_slot_ptr, MT, S, stride_w, cap, BLOCK_CAP, LANES)
    if UPDATE:
        old = tl.load(log_old_ptr + g, mask=inst, other=-1)
        ev = inst & (old >= 0) & (old < IR)
        w_old = tl.load(win_i2s_ptr + b * IR + old, mask=ev, other=-1)
        tl.store(i2s_ptr + b * IR + old, tl.full([LANES], -1, tl.int32), mask=ev & (w_old == 2 * g))
        w_new = tl.load(win_i2s_ptr + b * IR + x, mask=inst, other=-1)
        tl.store(i2s_ptr + b * IR + x, slot, mask=inst & (w_new == 2 * g + 1))
    dst = b * pool_row_base + slot
    win = inst & (tl.load(win_dst_ptr + dst, mask=inst, other=-1) == g)
    src = ((b * S + sq) * blocks_per_row + pos // sbs) * sbs + pos % sbs
    d = tl.arange(0, BLOCK_DKV)[None, :]
    m = win[:, None] & (d < Dkv)
    tl.store(pkv_ptr + dst[:, None] * Dkv + d, tl.load(skv_ptr + src[:, None] * Dkv + d, mask=m), mask=m)
    if HAS_ROPE:
        e = tl.arange(0, BLOCK_DR)[None, :]
        m = win[:, None] & (e < Dr)
        tl.store(prp_ptr + dst[:, None] * Dr + e, tl.load(srp_ptr + src[:, None] * Dr + e, mask=m), mask=m)


class Launch(NamedTuple):
    """What a call signature of an install fixes (computed once per signature with the validation)."""

    B: int
    S: int
    K: int
    PS: int
    NS: int
    IR: int
    sbs: int
    lay: object  # _records.RecordsLayout
    cap: int  # record slots per microtask (lay.cap)
    MT: int  # microtasks (lay.microtasks)
    block_q: int  # plan rows per program of the second-chance pass
    sizes: tuple  # the -1-filled scratch arrays (see launch)
    block_cap: int
    mpp: int
    grid: tuple
    block_dkv: int
    block_dr: int
    lanes: int
    has_rope: bool  # Dr > 0


def prepare(pool_kv_cache: torch.Tensor, pool_k_rope: torch.Tensor, id_to_slot: torch.Tensor, raw_seq: int,
            topk: int, selection_block_size: int, second_chance: bool) -> Launch:
    """The launch constants of an install signature (validated arguments)."""
    B, PS = pool_kv_cache.size(0), pool_kv_cache.size(1)
    S, K, NS, IR = raw_seq, topk, PS // WAYS, id_to_slot.size(1)
    lay = records_layout(B, S, K)
    n_log = lay.microtasks * lay.cap
    block_cap = next_pow2(lay.cap)
    mpp = max(1, min(8, 1024 // block_cap))  # microtasks per program of the record-parallel kernels
    Dr = pool_k_rope.size(2)
    block_dkv, block_dr = next_pow2(pool_kv_cache.size(2)), next_pow2(Dr)
    # The copy kernel's own lanes per program: a [lanes, BLOCK_DKV] tile of at most COPY_TILE elements
    lanes = max(1, min(mpp * block_cap, COPY_TILE // max(block_dkv, block_dr)))
    sizes = (B * IR, n_log, n_log, B * IR, B * PS, B * NS if second_chance else 0)
    return Launch(B, S, K, PS, NS, IR, selection_block_size, lay, lay.cap, lay.microtasks,
                  min(1024, next_pow2(B * S * K)), sizes, block_cap, mpp, (triton.cdiv(lay.microtasks, mpp),),
                  block_dkv, block_dr, lanes, Dr > 0)


def launch(install_records, selection_kv_cache, selection_k_rope, pool_kv_cache, pool_k_rope, pool_ids,
           id_to_slot, lru_counter, metadata_update: int, cfg: Launch, plan=None) -> None:
    """Run the kernels on validated arguments. ``plan`` given: second-chance victims (``dsa_install_sc``).

    Launches: one fill of the scratch, [``_ref_kernel``], ``_first_kernel``, ``_cand_kernel``, the device
    sort, ``_assign_kernel``, ``_keys_kernel``, ``_apply_kernel`` (tests/cuda/test_install_launches.py)."""
    B, S, K, PS, NS, IR, sbs, lay = cfg.B, cfg.S, cfg.K, cfg.PS, cfg.NS, cfg.IR, cfg.sbs, cfg.lay
    cap, MT = cfg.cap, cfg.MT
    dev = pool_kv_cache.device
    words = int32_words(install_records, lay.required)
    bufs = [out_buffer(t) for t in (pool_kv_cache, pool_k_rope, pool_ids, id_to_slot, lru_counter)]
    pkv, prp, pid, i2s, lru = bufs
    update = metadata_update == 1
    if not update:  # private counters and pool ids: the metadata stays bit-identical
        lru, pid = lru.clone(), pid.clone()
    skv = selection_kv_cache.contiguous()
    # a zero-width rope (the no-rope mode) is never addressed: the kv tensors stand in for its pointers
    srp, prp_k = (selection_k_rope.contiguous(), prp) if cfg.has_rope else (skv, pkv)
    sc = plan is not None
    # Every -1-initialised scratch array in one allocation and one fill: the first-occurrence words (stored
    # as INT32_MAX - g, atomic_max), the install log, the winners, and the inverted reference bits.
    scratch = torch.full((sum(cfg.sizes),), -1, dtype=torch.int32, device=dev)
    first, log_slot, log_old, win_i2s, win_dst, ref = scratch.split(cfg.sizes)
    if sc:  # reference bits per (row, set), one pass over the plan
        rows_q, block_q = B * S * K, cfg.block_q  # plan rows (validated)
        _ref_kernel[(triton.cdiv(rows_q, block_q),)](plan.contiguous(), ref, rows_q, S * K, NS, PS, BLOCK_Q=block_q)
    else:
        ref = log_slot  # unused pointer when FIFO
    common = dict(stride_w=lay.stride // 4, cap=cap)
    grid, block_cap, mpp = cfg.grid, cfg.block_cap, cfg.mpp
    _first_kernel[grid](words, first, MT, S, K, IR, NS, cnt_w=lay.rec_bytes // 4, BLOCK_CAP=block_cap, MPP=mpp,
                        **common)
    key = torch.empty(MT * cap, dtype=torch.int32, device=dev)
    _cand_kernel[grid](words, first, key, MT, S, K, IR, NS, cnt_w=lay.rec_bytes // 4, sentinel=B * NS,
                       BLOCK_CAP=block_cap, MPP=mpp, **common)
    # Per-(b, set) install lists in record order: a stable device sort, no host synchronisation
    sorted_key, order = torch.sort(key, stable=True)
    _assign_kernel[(B, NS)](words, sorted_key, order, MT * cap, lru, pid, ref, log_slot, log_old, S, K, NS, PS,
                            SECOND_CHANCE=sc, UPDATE=update, **common)
    base = (PS // sbs) * sbs  # NPU destination formula: dst = b*(PS//sbs)*sbs + slot
    _keys_kernel[grid](words, log_slot, log_old, win_i2s, win_dst, MT, S, IR, pool_row_base=base, UPDATE=update,
                       BLOCK_CAP=block_cap, MPP=mpp, **common)
    _apply_kernel[(triton.cdiv(MT * block_cap, cfg.lanes),)](
        words, log_slot, log_old, win_i2s, win_dst, i2s, bits(skv), bits(srp), bits(pkv), bits(prp_k), MT, S, IR,
        pool_row_base=base, blocks_per_row=(K + sbs - 1) // sbs, sbs=sbs, Dkv=pkv.size(2), Dr=prp.size(2),
        UPDATE=update, BLOCK_CAP=block_cap, BLOCK_DKV=cfg.block_dkv, BLOCK_DR=cfg.block_dr, LANES=cfg.lanes,
        HAS_ROPE=cfg.has_rope, **common)
    targets = (pool_kv_cache, pool_k_rope, pool_ids, id_to_slot, lru_counter)
    for dst, buf in zip(targets if update else targets[:2], bufs):
        commit(dst, buf)


def _validate(a: tuple, op: str) -> Launch:
    """``validate_dsa_install`` and the launch constants of the signature."""
    M.validate_dsa_install(*a, op=op)
    return prepare(a[4], a[5], a[7], a[9], a[10], a[11], second_chance=False)


def _launch_bound(a: tuple, cfg: Launch) -> None:
    """:func:`launch` on the op's bound arguments (schema order; ``selection_kv_block_table`` unread)."""
    launch(*a[:3], *a[4:9], a[12], cfg)


#: ``custom::dsa_install`` / ``dsa_install_functional`` on CUDA (``_common.CudaOp``: bound once, validated once
#: per signature with the CPU kernel's own checks)
KERNELS = CudaOp(M.SPEC, _validate, _launch_bound)
run, run_functional, register = KERNELS.run, KERNELS.run_functional, KERNELS.register

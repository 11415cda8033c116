"""Triton kernel of ``custom::dsa_plan`` (twin of ``csrc/dsa_plan.cpp``; CPU ``base = 0`` records layout).

Work split: one program per query row ``r = b*S + s``, holding the row's 8 microtasks (top-k columns
``[m*K/8, (m+1)*K/8)``) as one ``[8, K/8]`` tile. A row's plan rows, its 8 record slabs, its count cells
and ``selection_kv_actual_seq[r]`` are written by its program only; a microtask's stop state needs only
its own columns plus the one-element look-back (the previous microtask's last column, read-only), so
programs never share a written address and the result is independent of the schedule.

``dsa_plan`` only *reads* the pool metadata (``id_to_slot``); the per-set FIFO / second-chance
bookkeeping it feeds is written by the install kernels (``cuda/dsa_install.py``), which own one set per
program.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import dsa_plan as M
from .._records import records_layout
from ._common import CudaOp, next_pow2, require_triton
from ._kinds import DECODE_WINDOW, FULL_OLD_MISS, FUTURE_SKIP, INVALID, NEGATIVE_STOP, POOL_HIT

triton = require_triton()
import triton.language as tl  # noqa: E402

OP = M.OP


@triton.jit
def _plan_kernel(topk_ptr, lens_ptr, i2s_ptr, plan_ptr, words_ptr, act_ptr,
                 S, K, P, IR, PS, NS, stride_w, cnt_w,
                 BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.program_id(0)
    b = r // S
    s = r % S
    Lb = tl.load(lens_ptr + b)
    mv = tl.maximum(Lb - S - 1, 0)
    ms = Lb - (S - 1 - s) - 1
    empty = (Lb <= 0) | (ms < 0)
    row = topk_ptr + r.to(tl.int64) * K

    m = tl.arange(0, 8)[:, None]                      # the row's 8 microtasks as one [8, P] tile
    p = tl.arange(0, BLOCK_P)[None, :]
    pm = (p < P) & (m >= 0)
    k = m * P + p
    x = tl.load(row + k, mask=pm, other=0)
    prev = tl.load(row + tl.maximum(m * P - 1, 0))    # [8, 1]
    look_back = (m > 0) & (prev < 0)                  # one-element look-back only
    neg = pm & (x < 0)
    negi = neg.to(tl.int32)
    stopped = look_back | ((tl.cumsum(negi, 1) - negi) > 0)

    in_range = pm & (x >= 0) & (x < IR)
    looked = tl.load(i2s_ptr + b.to(tl.int64) * IR + x, mask=in_range, other=-1)
    sl = tl.where(in_range & (looked >= 0) & (looked < PS), looked, -1)

    kind = tl.where(x > mv, DECODE_WINDOW, FULL_OLD_MISS)
    value = x
    hit = (sl >= 0) & (x <= mv)
    kind = tl.where(hit, POOL_HIT, kind)
    value = tl.where(hit, sl, value)
    kind = tl.where(empty | (x > ms), FUTURE_SKIP, kind)  # value = the id
    value = tl.where(empty | (x > ms), x, value)
    kind = tl.where(neg, NEGATIVE_STOP, kind)          # value = the negative id
    value = tl.where(neg, x, value)
    kind = tl.where(stopped, INVALID, kind)
    value = tl.where(stopped, -1, value)
    out = plan_ptr + (r.to(tl.int64) * K + k) * 2
    tl.store(out, kind, mask=pm)
    tl.store(out + 1, value, mask=pm)

    miss = pm & (kind == FULL_OLD_MISS)
    missi = miss.to(tl.int32)
    rank = tl.cumsum(missi, 1) - missi
    mt = (r * 8 + m).to(tl.int64)                      # [8, 1]
    slab = words_ptr + mt * stride_w + 4 * rank
    tl.store(slab, x & (NS - 1), mask=miss)
    tl.store(slab + 1, x, mask=miss)
    tl.store(slab + 2, tl.zeros_like(x) + s, mask=miss)
    tl.store(slab + 3, k, mask=miss)
    cnt = tl.sum(missi, 1)                             # [8]
    tl.store(words_ptr + cnt_w + (r * 8 + tl.arange(0, 8)).to(tl.int64) * 8, cnt)

    kk = tl.arange(0, BLOCK_K)
    km = kk < K
    xs = tl.load(row + kk, mask=km, other=0)
    negk = (km & (xs < 0)).to(tl.int32)
    before = km & (tl.cumsum(negk, 0) == 0)            # up to (excluding) the first negative
    actual = tl.sum((before & (xs <= ms)).to(tl.int32), 0)
    actual = tl.where(empty, 0, actual)
    tl.store(act_ptr + r, actual)


class _Launch(NamedTuple):
    """What a call signature fixes (computed once per signature with the validation)."""

    R: int
    S: int
    K: int
    PS: int
    lay: object  # _records.RecordsLayout
    block_p: int
    block_k: int


def _validate(a: tuple, op: str) -> _Launch:
    """The op's checks (``validate_dsa_plan``) and the launch constants of the signature."""
    B, S, K, PS, _ = M.validate_dsa_plan(*a)
    return _Launch(B * S, S, K, PS, records_layout(B, S, K), next_pow2(K // 8), next_pow2(K))


def launch(a: tuple, cfg: _Launch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the kernel on validated arguments; returns ``(plan, install_records, selection_kv_actual_seq)``."""
    selection_topk_indices, full_kv_actual_seq, pool_ids, id_to_slot = a[:4]
    for observe in M.PLAN_OBSERVERS:  # host hooks (offload_passes/trace/record.py), as the CPU kernel calls them
        observe(selection_topk_indices, full_kv_actual_seq, pool_ids, a[5])
    R, K, lay = cfg.R, cfg.K, cfg.lay
    dev = selection_topk_indices.device
    plan = torch.empty((R * K, 2), dtype=torch.int32, device=dev)
    records = torch.zeros(lay.alloc, dtype=torch.int8, device=dev)
    act = torch.empty(R, dtype=torch.int32, device=dev)
    words = records[: lay.required].view(torch.int32)  # byte 0 of a fresh allocation: aligned
    i2s = id_to_slot.contiguous()
    _plan_kernel[(R,)](
        selection_topk_indices.contiguous(), full_kv_actual_seq.contiguous(), i2s, plan, words, act,
        cfg.S, K, K // 8, i2s.size(1), cfg.PS, cfg.PS // 16, lay.stride // 4, lay.rec_bytes // 4,
        BLOCK_P=cfg.block_p, BLOCK_K=cfg.block_k,
    )
    return plan, records, act


#: ``custom::dsa_plan`` on CUDA (``_common.CudaOp``: bound once, validated once per signature)
KERNELS = CudaOp(M.SPEC, _validate, launch)
run, register = KERNELS.run, KERNELS.register

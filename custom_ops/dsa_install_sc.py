"""``offload_ref::dsa_install_sc`` — opt-in 16-way *second-chance* pool replacement (``offload-sim``'s
``sa_clock``), a drop-in for ``custom::dsa_install`` with one extra leading input, the step's ``plan``.

Why a separate op, not an attribute or a switch: ``custom::dsa_install``'s schema is CANN's and cannot
grow an attribute; a process-wide switch would make one graph mean two different things (FIFO on the
NPU, second chance on CPU) and would be invisible in dumps. The policy also needs to know the step's
*hits* (to set reference bits), which ``dsa_install`` never receives (its records are the misses), so
the schema has to change anyway: ``plan`` is the first input. The op lives in ``offload_ref::`` with the
other reference-only ops, so it can never clash with CANN's library.

State layout (no new tensor, same allocation as FIFO): ``lru_counter[b, set]`` bits 0..3 = the set's
pointer (as FIFO), bits 4..19 = one reference bit per way. Semantics per batch row: (1) every POOL_HIT
plan row sets the reference bit of its slot; (2) records install in record order with dsa_install's
validity filter and per-row dedupe; the victim search starts at the pointer, clears and skips ways
whose bit is set, takes the first clear way and leaves the pointer after it. ``metadata_update=0``
works on a private copy of the counters (same ways as the ``metadata_update=1`` call), exactly like FIFO.
The default ``custom::dsa_install`` (FIFO) is unchanged. The rewrite emits this op only when the backend
option ``replacement_policy="second_chance"`` is set (CPU modes; never the default).

What the NPU would need: a dsa_install variant that reads the plan's POOL_HIT rows of its batch row
(one extra pass over ``S*K`` int32 pairs, bit-OR into the set word) before the record loop, and a
victim loop of at most 17 probes per record instead of one pointer read.
"""
from __future__ import annotations

import logging

import torch

from . import _library as L
from ._attention_common import REF_NAMESPACE, ref_define
from ._records import decode_records
from .dsa_install import SPEC as INSTALL_SPEC
from .dsa_install import validate_dsa_install
from .opspec import Limit, OpSpec
from .plan_kind import PlanKind

log = logging.getLogger("offload_passes.custom_ops.dsa_install_sc")

SPEC = OpSpec(
    namespace=REF_NAMESPACE,
    name="dsa_install_sc",
    schema=(
        "dsa_install_sc(Tensor plan, Tensor install_records, Tensor selection_kv_cache, Tensor selection_k_rope, "
        "Tensor selection_kv_block_table, Tensor(a!) pool_kv_cache, Tensor(b!) pool_k_rope, Tensor(c!) pool_ids, "
        "Tensor(d!) id_to_slot, Tensor(e!) lru_counter, *, int raw_seq=1, int topk=2048, "
        "int selection_block_size=128, int metadata_update=1) -> ()"
    ),
    role="offload",
    summary="opt-in second-chance variant of dsa_install (CPU modes only; no CANN kernel, no GE type)",
    # dsa_install's limits (it runs dsa_install's validation) plus where the reference bits live
    limits=INSTALL_SPEC.limits + (Limit("REF_SHIFT", 4, "lru_counter bits 4..19 hold one reference bit per way"),),
    cuda_kernel="dsa_install_sc",
    arg_roles={"plan": "plan", **INSTALL_SPEC.arg_roles},
)
OP = SPEC.name
REF_SHIFT = SPEC.limit("REF_SHIFT")


def validate_dsa_install_sc(plan, install_records, selection_kv_cache, selection_k_rope, selection_kv_block_table,
                            pool_kv_cache, pool_k_rope, pool_ids, id_to_slot, lru_counter,
                            raw_seq=1, topk=2048, selection_block_size=128, metadata_update=1) -> tuple:
    """dsa_install's limits (docs/ops.md §4.1) plus ``plan`` int32 ``[B*raw_seq*topk, 2]``."""
    try:
        out = validate_dsa_install(install_records, selection_kv_cache, selection_k_rope, selection_kv_block_table,
                                   pool_kv_cache, pool_k_rope, pool_ids, id_to_slot, lru_counter,
                                   raw_seq, topk, selection_block_size, metadata_update, op=OP)
    except RuntimeError as e:
        raise RuntimeError(str(e).replace(f"custom::{OP}", f"offload_ref::{OP}", 1)) from None
    B = pool_kv_cache.size(0)
    rows = B * raw_seq * topk
    if plan.dtype != torch.int32 or plan.dim() != 2 or plan.size(0) != rows or plan.size(1) != 2:
        raise RuntimeError(f"offload_ref::{OP}: plan must be int32 [B*raw_seq*topk={rows}, 2], got "
                           f"{plan.dtype} {tuple(plan.shape)}")
    return out


def reference_dsa_install_sc(plan, install_records, selection_kv_cache, selection_k_rope, selection_kv_block_table,
                             pool_kv_cache, pool_k_rope, pool_ids, id_to_slot, lru_counter, *,
                             raw_seq=1, topk=2048, selection_block_size=128, metadata_update=1) -> None:
    """Pure-Python oracle (loops; small sizes only), in place."""
    B, PS = pool_kv_cache.size(0), pool_kv_cache.size(1)
    S, K, sbs, IR, NS = raw_seq, topk, selection_block_size, id_to_slot.size(1), PS // 16
    recs, _ = decode_records(install_records, B, S, K, base=0, clamp_to_cap=True)
    kinds = plan[:, 0].view(B, S * K).tolist()
    vals = plan[:, 1].view(B, S * K).tolist()
    ctr_all = lru_counter.tolist()
    sel_kv = selection_kv_cache.reshape(-1, selection_kv_cache.size(-1))
    kv_flat = pool_kv_cache.view(-1, pool_kv_cache.size(-1))
    Dr = selection_k_rope.size(-1)  # 0: the no-rope mode (a [-1, 0] view is undefined; nothing to move)
    sel_rope = selection_k_rope.reshape(-1, Dr) if Dr else None
    rope_flat = pool_k_rope.view(-1, Dr) if Dr else None
    by_b: list[list] = [[] for _ in range(B)]
    for mt, st, x, sq, pos in recs.tolist():
        by_b[mt // (S * 8)].append((st, x, sq, pos))
    for b in range(B):
        ctr = list(ctr_all[b])
        for kd, v in zip(kinds[b], vals[b]):
            if kd == PlanKind.POOL_HIT and 0 <= v < PS:
                ctr[v // 16] |= 1 << (REF_SHIFT + v % 16)
        seen = set()
        for st, x, sq, pos in by_b[b]:
            if not (0 <= x < IR and 0 <= st < NS and 0 <= sq < S and 0 <= pos < K) or x in seen:
                continue
            seen.add(x)
            c = ctr[st]
            way = c & 15
            while c & (1 << (REF_SHIFT + way)):
                c &= ~(1 << (REF_SHIFT + way))
                way = (way + 1) & 15
            ctr[st] = (c & ~15) | ((way + 1) & 15)
            slot = st * 16 + way
            if metadata_update == 1:
                old = int(pool_ids[b, slot])
                if 0 <= old < IR:
                    id_to_slot[b, old] = -1
                pool_ids[b, slot] = x
                id_to_slot[b, x] = slot
            src = ((b * S + sq) * ((K + sbs - 1) // sbs) + pos // sbs) * sbs + pos % sbs
            dst = b * (PS // sbs) * sbs + slot
            kv_flat[dst] = sel_kv[src]
            if Dr:
                rope_flat[dst] = sel_rope[src]
        if metadata_update == 1:
            lru_counter[b] = torch.tensor(ctr, dtype=torch.int32)


ref_define(SPEC.schema)
# CPU and fake kernels (custom_ops/_library.py: register_twins, in the offload_ref namespace); the CPU
# computation is csrc/dsa_install_sc.cpp (the op's arguments) or reference_dsa_install_sc
L.register_twins(SPEC, validate=lambda a, op: validate_dsa_install_sc(*a), run=L.cpu_run(SPEC, lambda **a: reference_dsa_install_sc(**a)))

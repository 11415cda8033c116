"""custom::dsa_plan — classify one IndexShare group's top-k once per step (docs/ops.md §2).

Outputs ``(plan, install_records, selection_kv_actual_seq)``:

* ``plan`` int32 ``[numel(topk), 2]``: row ``q = (b*S + s)*K + k`` is ``[src_kind, value]`` with kinds
  0 INVALID, 1 POOL_HIT (value = pool slot), 2 FULL_OLD_MISS (id; emits an install record),
  3 DECODE_WINDOW (id), 4 FUTURE_SKIP (id), 5 NEGATIVE_STOP (the negative id).
* ``install_records`` int8 ``[required + 4095]`` (layout in ``_records.py``).
* ``selection_kv_actual_seq`` int32 ``[numel(topk) / K]``.

Address independence: the NPU kernel writes the records at the first 4096-aligned address inside the
buffer (``base`` depends on ``data_ptr``), so on the NPU a clone between plan and install corrupts
decoding. **The CPU kernels (C++ and reference) use ``base = 0``**: records at byte 0, counts at byte
``rec_bytes``; they never look at the buffer's address, so clones are harmless here. The trailing
4095 bytes of slack stay zero.

Deviation (documented in the report): a 3-D top-k ``[B, X, K]`` with ``X != 1`` is rejected (the NPU
half-supports it, docs/ops.md §2.5 calls it unsupported). ``pool_ids`` and ``lru_counter`` are shape-checked
only, as on the NPU; ``group_id``/``owner_layer``/``group_kind`` are carried and ignored.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from . import _library as L
from ._pool import MAX_POOL, WAYS, check_pool_metadata, check_pool_size  # noqa: F401
from ._records import MICROTASKS, records_layout
from .opspec import GeOp, Limit, OpSpec, shared_limits
from .plan_kind import PlanKind

log = logging.getLogger("offload_passes.custom_ops.dsa_plan")

SPEC = OpSpec(
    namespace="custom",
    name="dsa_plan",
    schema=(
        "dsa_plan(Tensor selection_topk_indices, Tensor full_kv_actual_seq, Tensor pool_ids, "
        "Tensor id_to_slot, Tensor lru_counter, *, int raw_seq=1, int group_id=0, int owner_layer=0, "
        "int group_kind=0) -> (Tensor, Tensor, Tensor)"
    ),
    role="offload",
    summary="classify an IndexShare group's top-k once per step into a plan and install records",
    limits=shared_limits("MAX_TOPK", "MAX_RAW_SEQ", "MAX_POOL", "WAYS") + (
        Limit("TOPK_ALIGN", 64, "K must be a multiple of this (8 microtasks of K/8 entries, 8-aligned)"),
    ),
    ge=GeOp("DsaPlan", outputs=("plan", "install_records", "selection_kv_actual_seq")),
    cuda_kernel="dsa_plan",
    arg_roles={"pool_ids": "metadata", "id_to_slot": "metadata", "lru_counter": "metadata"},
)
OP = SPEC.name
L.define(SPEC.schema)

MAX_TOPK, MAX_RAW_SEQ, TOPK_ALIGN = SPEC.limit_values("MAX_TOPK", "MAX_RAW_SEQ", "TOPK_ALIGN")

#: Callables ``f(topk, full_kv_actual_seq, pool_ids, raw_seq)`` run on every ``dsa_plan`` call before
#: planning (trace recording: ``offload_passes.trace.record.PlanRecorder``). Empty by default; changed only
#: through :func:`add_plan_observer` / :func:`remove_plan_observer`.
PLAN_OBSERVERS: list = []


def validate_dsa_plan(*args: Any, **kwargs: Any) -> tuple:
    """Check every limit of docs/ops.md §2.1 (sizes and dtypes only; safe in fake mode).

    Returns ``(B, S, K, PS, IR)``.

    Takes the op's arguments as its schema does (positional or by name; ``L.bind``).
    """
    selection_topk_indices, full_kv_actual_seq, pool_ids, id_to_slot, lru_counter, raw_seq = \
        L.bind(SPEC, args, kwargs)[:6]
    topk = selection_topk_indices
    for name, t in (
        ("selection_topk_indices", topk),
        ("full_kv_actual_seq", full_kv_actual_seq),
        ("pool_ids", pool_ids),
        ("id_to_slot", id_to_slot),
        ("lru_counter", lru_counter),
    ):
        L.check(t.dtype == torch.int32, OP, f"{name} must be int32, got {t.dtype}")
    L.check(topk.dim() in (3, 4), OP, f"selection_topk_indices must be 3-D or 4-D, got {topk.dim()}-D")
    L.check(
        1 <= raw_seq <= MAX_RAW_SEQ, OP, f"raw_seq must be in [1, {MAX_RAW_SEQ}], got {raw_seq}"
    )
    B = topk.size(0)
    L.check(B > 0, OP, f"selection_topk_indices batch dim (B) must be > 0, got {B}")
    if topk.dim() == 4:
        L.check(
            topk.size(1) == raw_seq,
            OP,
            f"selection_topk_indices dim 1 must equal raw_seq={raw_seq}, got {topk.size(1)}",
        )
        L.check(topk.size(2) == 1, OP, f"selection_topk_indices dim 2 (heads) must be 1, got {topk.size(2)}")
    else:
        L.check(raw_seq == 1, OP, f"raw_seq must be 1 for a 3-D selection_topk_indices, got {raw_seq}")
        L.check(
            topk.size(1) == 1,
            OP,
            f"selection_topk_indices dim 1 must be 1 for a 3-D top-k (unsupported otherwise), "
            f"got {topk.size(1)}",
        )
    K = topk.size(-1)
    L.check(K > 0, OP, f"selection_topk_indices last dim (K) must be > 0, got {K}")
    L.check(K % TOPK_ALIGN == 0, OP,
            f"selection_topk_indices last dim (K) must be a multiple of {TOPK_ALIGN}, got {K}")
    L.check(K <= MAX_TOPK, OP, f"selection_topk_indices last dim (K) must be <= {MAX_TOPK}, got {K}")
    L.check(
        full_kv_actual_seq.dim() == 1 and full_kv_actual_seq.size(0) == B,
        OP,
        f"full_kv_actual_seq must be 1-D of length B={B}, got shape {tuple(full_kv_actual_seq.shape)} "
        f"(B = selection_topk_indices.size(0))",
    )
    L.check(
        pool_ids.dim() == 2 and pool_ids.size(0) == B,
        OP,
        f"pool_ids must be [B={B}, PS], got shape {tuple(pool_ids.shape)} (B = selection_topk_indices.size(0))",
    )
    PS = pool_ids.size(1)
    NS = check_pool_size(OP, "pool_ids dim 1", PS)
    IR = check_pool_metadata(OP, B, NS, id_to_slot, lru_counter, got="got shape",
                             b_src="selection_topk_indices.size(0)")
    return B, raw_seq, K, PS, IR


def _fake(a: tuple, geometry: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outputs on fake tensors (``geometry``: what validation returned): plan ``[n, 2]``, the records
    buffer, ``[n / K]`` lengths."""
    selection_topk_indices = a[0]
    B, S, K, _, _ = geometry
    n = selection_topk_indices.numel()
    lay = records_layout(B, S, K)
    plan = selection_topk_indices.new_empty([n, 2])
    records = selection_topk_indices.new_empty([lay.alloc], dtype=torch.int8)
    act = selection_topk_indices.new_empty([n // K])
    return plan, records, act


def reference_dsa_plan(
    selection_topk_indices: torch.Tensor,
    full_kv_actual_seq: torch.Tensor,
    pool_ids: torch.Tensor,
    id_to_slot: torch.Tensor,
    lru_counter: torch.Tensor,
    *,
    raw_seq: int = 1,
    group_id: int = 0,
    owner_layer: int = 0,
    group_kind: int = 0,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch oracle of docs/ops.md §2.4 (vectorised; CPU base = 0 records layout)."""
    if validate:
        validate_dsa_plan(
            selection_topk_indices, full_kv_actual_seq, pool_ids, id_to_slot, lru_counter, raw_seq
        )
    B, S, K = selection_topk_indices.size(0), raw_seq, selection_topk_indices.size(-1)
    PS, IR = pool_ids.size(1), id_to_slot.size(1)
    NS, P, R = PS // WAYS, K // MICROTASKS, B * raw_seq
    lay = records_layout(B, S, K)

    rows = selection_topk_indices.reshape(R, K).to(torch.int64)
    b_of = torch.arange(R) // S
    s_of = torch.arange(R) % S
    Lb = full_kv_actual_seq.to(torch.int64)[b_of]
    mv = (Lb - S - 1).clamp(min=0).unsqueeze(1)  # reuse limit max_valid
    ms = (Lb - (S - 1 - s_of) - 1).unsqueeze(1)  # causal limit max_sel
    empty = ((Lb <= 0) | (ms.squeeze(1) < 0)).unsqueeze(1)

    neg = rows < 0
    first_neg = torch.where(neg.any(1), neg.to(torch.int8).argmax(1), torch.full((R,), K))
    before = torch.arange(K).unsqueeze(0) < first_neg.unsqueeze(1)
    act = ((rows <= ms) & before).sum(1)
    act = torch.where(empty.squeeze(1), torch.zeros_like(act), act).to(torch.int32)

    # Stop state per microtask: a negative earlier in the microtask, or (one-element look-back) the
    # last entry of the previous microtask negative.
    negm = neg.view(R, MICROTASKS, P)
    look_back = torch.zeros(R, MICROTASKS, dtype=torch.bool)
    look_back[:, 1:] = negm[:, :-1, -1]
    stopped = look_back.unsqueeze(2) | ((negm.to(torch.int32).cumsum(2) - negm.to(torch.int32)) > 0)
    stopped = stopped.view(R, K)

    in_range = (rows >= 0) & (rows < IR)
    looked = id_to_slot.to(torch.int64)[b_of.unsqueeze(1), rows.clamp(0, IR - 1)]
    slot = torch.where(in_range & (looked >= 0) & (looked < PS), looked, torch.full_like(looked, -1))

    kind = torch.full((R, K), PlanKind.FULL_OLD_MISS, dtype=torch.int64)
    value = rows.clone()
    kind = torch.where(rows > mv, torch.full_like(kind, PlanKind.DECODE_WINDOW), kind)
    hit = (slot >= 0) & (rows <= mv)
    kind = torch.where(hit, torch.full_like(kind, PlanKind.POOL_HIT), kind)
    value = torch.where(hit, slot, value)
    future = empty | (rows > ms)
    kind = torch.where(future, torch.full_like(kind, PlanKind.FUTURE_SKIP), kind)
    value = torch.where(future, rows, value)
    kind = torch.where(neg, torch.full_like(kind, PlanKind.NEGATIVE_STOP), kind)
    value = torch.where(neg, rows, value)
    kind = torch.where(stopped, torch.full_like(kind, PlanKind.INVALID), kind)
    value = torch.where(stopped, torch.full_like(value, -1), value)

    plan = torch.stack([kind, value], dim=2).reshape(R * K, 2).to(torch.int32)
    if selection_topk_indices.numel() != R * K:  # only reachable with validate=False
        full = torch.zeros(selection_topk_indices.numel(), 2, dtype=torch.int32)
        full[: R * K] = plan
        plan = full

    words = torch.zeros(lay.required // 4, dtype=torch.int32)
    miss = (kind == PlanKind.FULL_OLD_MISS).view(R * MICROTASKS, P)
    counts = miss.sum(1)
    cells = words[lay.rec_bytes // 4 :][: lay.microtasks * 8].view(lay.microtasks, 8)
    cells[:, 0] = counts.to(torch.int32)
    if bool(miss.any()):
        mt_i, p_i = miss.nonzero(as_tuple=True)
        rank = (miss.to(torch.int64).cumsum(1) - 1)[mt_i, p_i]
        r_i, k_i = mt_i // MICROTASKS, (mt_i % MICROTASKS) * P + p_i
        x = rows[r_i, k_i]
        rec = torch.stack([x & (NS - 1), x, s_of[r_i], k_i], dim=1).to(torch.int32)
        slabs = words[: lay.microtasks * lay.stride // 4].view(lay.microtasks, lay.stride // 16, 4)
        slabs[mt_i, rank] = rec
    records = torch.zeros(lay.alloc, dtype=torch.int8)
    records[: lay.required] = words.view(torch.int8)
    act_full = torch.zeros(selection_topk_indices.numel() // K, dtype=torch.int32)
    act_full[:R] = act
    return plan, records, act_full


_run_cpu = L.cpu_run(SPEC, lambda **a: reference_dsa_plan(**a, validate=False))


def _run(a: tuple, checked: object = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU computation on the bound arguments ``a`` (schema order), after the observers saw the call."""
    for observe in PLAN_OBSERVERS:
        observe(a[0], a[1], a[2], a[5])
    return _run_cpu(a, checked)


def add_plan_observer(fn) -> None:
    """Call ``fn(topk, full_kv_actual_seq, pool_ids, raw_seq)`` before every CPU (and CUDA) ``dsa_plan``."""
    PLAN_OBSERVERS.append(fn)
    L.set_checked_bypass(SPEC, True)  # the C++ entry would run the kernel without the observers


def remove_plan_observer(fn) -> None:
    """Stop calling ``fn`` (ValueError if it was not added)."""
    PLAN_OBSERVERS.remove(fn)
    if not PLAN_OBSERVERS:
        L.set_checked_bypass(SPEC, False)


# CPU and fake kernels (custom_ops/_library.py: register_twins; dsa_plan has no twin); the CPU computation
# is csrc/dsa_plan.cpp (the op's arguments) or reference_dsa_plan
L.register_twins(SPEC, validate=lambda a, op: validate_dsa_plan(*a), run=_run, fake_returns=_fake)

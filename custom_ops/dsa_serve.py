"""custom::dsa_serve / dsa_serve_functional — fill a layer's selection buffer (docs/ops.md §3).

Every plan row ``q`` writes exactly one selection row: the pool row (kind 1), the full-cache row
(kinds 2/3) or zeros (kinds 0/4/5 and out-of-range values). A rope width of 0 (rope tensors ``[..., 0]``) is the
no-rope mode (docs/ops.md §3.3): only the kv rows move. ``compact_layout=1`` writes flat row ``q``
of the selection viewed as ``[nb*sbs, D]``; ``compact_layout=0`` (legacy) writes ``selection[q, 0]``.

CPU kernel: ``csrc/dsa_serve.cpp`` (byte copies of whole rows, ``at::parallel_for`` over plan rows), or
:func:`reference_dsa_serve` when ``OFFLOAD_PASSES_CPU_KERNELS=reference``.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from . import _library as L
from .opspec import GeOp, Limit, OpSpec, shared_limits
from .plan_kind import PlanKind

log = logging.getLogger("offload_passes.custom_ops.dsa_serve")

SPEC = OpSpec(
    namespace="custom",
    name="dsa_serve",
    schema=(
        "dsa_serve(Tensor plan, Tensor full_kv_cache, Tensor full_k_rope, Tensor pool_kv_cache, "
        "Tensor pool_k_rope, Tensor(a!) selection_kv_cache, Tensor(b!) selection_k_rope, *, "
        "int raw_seq=1, int topk=2048, int selection_block_size=128, int compact_layout=1) -> ()"
    ),
    role="offload",
    summary="fill a layer's selection buffer from the pool, the full cache or zeros, per plan row",
    functional="dsa_serve_functional",
    limits=shared_limits("MAX_RAW_SEQ", "MAX_TOPK", "MAX_POOL", "MAX_DKV", "MIN_DR", "MAX_DR", "TOPK_GRANULARITY",
                         "MIN_SELECTION_BLOCK_SIZE", "MAX_SELECTION_BLOCK_SIZE") + (
        # csrc/dsa_serve.cpp's compact_layout=0 ("legacy") path is smaller in every dimension
        Limit("LEGACY_MAX_TOPK", 64, "topk of compact_layout=0"),
        Limit("LEGACY_MAX_POOL", 256, "pool slots of compact_layout=0"),
        Limit("LEGACY_MAX_ROWS", 256, "plan rows of compact_layout=0"),
        Limit("LEGACY_MAX_BATCH", 16, "batch rows of compact_layout=0"),
        Limit("LEGACY_MAX_FULL_SEQ", 512, "full-cache tokens per batch row of compact_layout=0"),
    ),
    ge=GeOp("DsaServe", outputs=("selection_kv_cache", "selection_k_rope")),
    cuda_kernel="dsa_serve",
    arg_roles={"plan": "plan", "pool_kv_cache": "pool", "pool_k_rope": "pool", "selection_kv_cache": "selection",
               "selection_k_rope": "selection"},
)
OP, FUNCTIONAL_OP = SPEC.op_names
L.define(SPEC.schema)
L.define(SPEC.functional_schema)

#: Limits of csrc/dsa_serve.cpp: compact_layout=1 ("prod") and compact_layout=0 ("legacy").
PROD_LIMITS = {"raw_seq": SPEC.limit("MAX_RAW_SEQ"), "topk": SPEC.limit("MAX_TOPK"),
               "pool_size": SPEC.limit("MAX_POOL")}
LEGACY_LIMITS = {"raw_seq": SPEC.limit("MAX_RAW_SEQ"), "topk": SPEC.limit("LEGACY_MAX_TOPK"),
                 "pool_size": SPEC.limit("LEGACY_MAX_POOL"), "rows": SPEC.limit("LEGACY_MAX_ROWS"),
                 "batch": SPEC.limit("LEGACY_MAX_BATCH"), "full_seq": SPEC.limit("LEGACY_MAX_FULL_SEQ")}
TOPK_GRANULARITY, MIN_SELECTION_BLOCK_SIZE, MAX_SELECTION_BLOCK_SIZE, MAX_KV_DIM, MIN_ROPE_DIM, MAX_ROPE_DIM = (
    SPEC.limit_values("TOPK_GRANULARITY", "MIN_SELECTION_BLOCK_SIZE", "MAX_SELECTION_BLOCK_SIZE", "MAX_DKV", "MIN_DR",
                      "MAX_DR"))
PAYLOAD_DTYPES = (torch.float16, torch.bfloat16)


def validate_dsa_serve(*args: Any, op: str = OP, **kwargs: Any) -> None:
    """Every check of docs/ops.md §3.1; raises ``RuntimeError("custom::dsa_serve: ...")``.

    Takes the op's arguments as its schema does (positional or by name; ``L.bind``).
    """
    (plan, full_kv_cache, full_k_rope, pool_kv_cache, pool_k_rope, selection_kv_cache, selection_k_rope,
     raw_seq, topk, selection_block_size, compact_layout) = L.bind(SPEC, args, kwargs)
    c = L.check
    c(compact_layout in (0, 1), op, lambda: f"compact_layout must be 0 or 1, got {compact_layout}")
    compact = compact_layout == 1
    lim = PROD_LIMITS if compact else LEGACY_LIMITS
    mode = f"compact_layout={compact_layout}"
    c(plan.dtype == torch.int32, op, lambda: f"plan must be int32, got {plan.dtype}")
    payload = {
        "full_kv_cache": full_kv_cache,
        "full_k_rope": full_k_rope,
        "pool_kv_cache": pool_kv_cache,
        "pool_k_rope": pool_k_rope,
        "selection_kv_cache": selection_kv_cache,
        "selection_k_rope": selection_k_rope,
    }
    dt = full_kv_cache.dtype
    c(dt in PAYLOAD_DTYPES, op, lambda: f"full_kv_cache dtype must be float16 or bfloat16, got {dt}")
    for name, t in payload.items():
        c(t.dtype == dt, op, lambda: f"{name} dtype must equal full_kv_cache dtype {dt}, got {t.dtype}")
    c(0 < raw_seq <= lim["raw_seq"], op, lambda: f"raw_seq must be in [1, {lim['raw_seq']}], got {raw_seq}")
    c(0 < topk <= lim["topk"], op, lambda: f"topk must be in [1, {lim['topk']}] for {mode}, got {topk}")
    c(topk % TOPK_GRANULARITY == 0, op,
      lambda: f"topk must be a multiple of {TOPK_GRANULARITY}, got {topk}")
    sbs = selection_block_size
    c(
        MIN_SELECTION_BLOCK_SIZE <= sbs <= MAX_SELECTION_BLOCK_SIZE and (sbs & (sbs - 1)) == 0,
        op,
        lambda: f"selection_block_size must be a power of two in [{MIN_SELECTION_BLOCK_SIZE}, "
        f"{MAX_SELECTION_BLOCK_SIZE}], got {sbs}",
    )
    c(
        not compact or topk % sbs == 0,
        op,
        lambda: f"topk must be a multiple of selection_block_size ({sbs}) for {mode}, got {topk}",
    )
    c(plan.dim() == 2 and plan.size(1) == 2, op,
      lambda: f"plan must be 2-D [rows, 2], got shape {list(plan.shape)}")
    rows = plan.size(0)
    c(rows > 0, op, lambda: f"plan rows must be > 0, got {rows}")
    if not compact:
        c(rows <= lim["rows"], op, lambda: f"plan rows must be <= {lim['rows']} for {mode}, got {rows}")
    for name, t in payload.items():
        c(t.dim() == 3, op, lambda: f"{name} must be 3-D, got shape {list(t.shape)}")
    B = full_kv_cache.size(0)
    c(B > 0, op, lambda: f"full_kv_cache.size(0) (batch) must be > 0, got {B}")
    if not compact:
        c(B <= lim["batch"], op,
          lambda: f"full_kv_cache.size(0) (batch) must be <= {lim['batch']} for {mode}, got {B}")
    c(
        rows == B * raw_seq * topk,
        op,
        lambda: f"plan rows must equal batch*raw_seq*topk = {B}*{raw_seq}*{topk}, got {rows} "
        f"(batch = full_kv_cache.size(0))",
    )
    for name in ("full_k_rope", "pool_kv_cache", "pool_k_rope"):
        t = payload[name]
        c(t.size(0) == B, op,
          lambda: f"{name}.size(0) must equal batch {B}, got {t.size(0)} (batch = full_kv_cache.size(0))")
    F = full_kv_cache.size(1)
    c(F > 0, op, lambda: f"full_kv_cache.size(1) (full_seq) must be > 0, got {F}")
    if not compact:
        c(F <= lim["full_seq"], op,
          lambda: f"full_kv_cache.size(1) (full_seq) must be <= {lim['full_seq']} for {mode}, got {F}")
    c(full_k_rope.size(1) == F, op,
      lambda: f"full_k_rope.size(1) must equal full_seq {F}, got {full_k_rope.size(1)} "
              f"(full_seq = full_kv_cache.size(1))")
    PS = pool_kv_cache.size(1)
    c(0 < PS <= lim["pool_size"], op,
      lambda: f"pool_kv_cache.size(1) (pool_size) must be in [1, {lim['pool_size']}] for {mode}, got {PS}")
    c(pool_k_rope.size(1) == PS, op,
      lambda: f"pool_k_rope.size(1) must equal pool_size {PS}, got {pool_k_rope.size(1)} "
              f"(pool_size = pool_kv_cache.size(1))")
    Dkv = full_kv_cache.size(2)
    c(0 < Dkv <= MAX_KV_DIM, op,
      lambda: f"full_kv_cache.size(2) (kv dim) must be in [1, {MAX_KV_DIM}], got {Dkv}")
    c(pool_kv_cache.size(2) == Dkv, op,
      lambda: f"pool_kv_cache.size(2) must equal kv dim {Dkv}, got {pool_kv_cache.size(2)} "
              f"(kv dim = full_kv_cache.size(2))")
    Dr = full_k_rope.size(2)
    c(MIN_ROPE_DIM <= Dr <= MAX_ROPE_DIM, op,
      lambda: f"full_k_rope.size(2) (rope dim) must be in [{MIN_ROPE_DIM}, {MAX_ROPE_DIM}] (0: no-rope mode), got {Dr}")
    c(pool_k_rope.size(2) == Dr, op,
      lambda: f"pool_k_rope.size(2) must equal rope dim {Dr}, got {pool_k_rope.size(2)} "
              f"(rope dim = full_k_rope.size(2))")
    nb = (rows + sbs - 1) // sbs if compact else rows
    for name, D, src in (("selection_kv_cache", Dkv, "full_kv_cache"), ("selection_k_rope", Dr, "full_k_rope")):
        t = payload[name]
        c(
            t.size(0) == nb and t.size(1) == sbs and t.size(2) == D,
            op,
            lambda: f"{name} must have shape [{nb}, {sbs}, {D}] (blocks = "
            f"{'ceil(rows/selection_block_size)' if compact else 'rows'}) for {mode}, got {list(t.shape)} "
            f"(rows = plan.size(0), last dim = {src}.size(2))",
        )


# --------------------------------------------------------------------------------------------
# Reference (test oracle)
# --------------------------------------------------------------------------------------------

def reference_dsa_serve(
    plan: torch.Tensor,
    full_kv_cache: torch.Tensor,
    full_k_rope: torch.Tensor,
    pool_kv_cache: torch.Tensor,
    pool_k_rope: torch.Tensor,
    selection_kv_cache: torch.Tensor,
    selection_k_rope: torch.Tensor,
    raw_seq: int = 1,
    topk: int = 2048,
    selection_block_size: int = 128,
    compact_layout: int = 1,
) -> None:
    """Pure-torch §3.2: a straight gather by kind, written into the selection tensors in place.

    Rows are moved as raw 16-bit patterns (int16 views), so NaN payloads stay bit-identical.
    """
    rows = plan.size(0)
    F = full_kv_cache.size(1)
    PS = pool_kv_cache.size(1)
    kind = plan[:, 0].long()
    v = plan[:, 1].long()
    b = torch.arange(rows) // (raw_seq * topk)
    from_pool = ((kind == PlanKind.POOL_HIT) & (v >= 0) & (v < PS)).unsqueeze(1)
    from_full = (((kind == PlanKind.FULL_OLD_MISS) | (kind == PlanKind.DECODE_WINDOW)) & (v >= 0) & (v < F)).unsqueeze(1)
    pool_row = b * PS + v.clamp(0, PS - 1)
    full_row = b * F + v.clamp(0, F - 1)
    for full, pool, sel in (
        (full_kv_cache, pool_kv_cache, selection_kv_cache),
        (full_k_rope, pool_k_rope, selection_k_rope),
    ):
        D = sel.size(2)
        if D == 0:  # the no-rope mode: nothing to move (and a [-1, 0] view is undefined)
            continue
        f16 = full.view(torch.int16).reshape(-1, D)
        p16 = pool.view(torch.int16).reshape(-1, D)
        out = torch.where(from_pool, p16.index_select(0, pool_row),
                          torch.where(from_full, f16.index_select(0, full_row), torch.zeros((), dtype=torch.int16)))
        if compact_layout == 1:
            sel.view(torch.int16).copy_(out.view(sel.shape))  # rows == nb*sbs (validated)
        else:
            sel.view(torch.int16)[:rows, 0].copy_(out)


# --------------------------------------------------------------------------------------------
# CPU kernels
# --------------------------------------------------------------------------------------------

def functional_outputs(selection_kv_cache: torch.Tensor, selection_k_rope: torch.Tensor,
                       compact_layout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The functional twin's output buffers (every kernel of the twin, CPU and CUDA, uses these)."""
    if compact_layout == 1:
        # Compact mode overwrites every element (validation pins nb*sbs == rows), so no clone.
        return torch.empty_like(selection_kv_cache), torch.empty_like(selection_k_rope)
    # Legacy mode writes entry 0 of each block only; the rest keeps the input (the NPU leaves it
    # uninitialised).
    return selection_kv_cache.clone(), selection_k_rope.clone()


# CPU and fake kernels of the op and its twin, Functionalize (custom_ops/_library.py: register_twins); the
# CPU computation is csrc/dsa_serve.cpp (the op's arguments) or reference_dsa_serve
L.register_twins(
    SPEC,
    validate=lambda a, op: validate_dsa_serve(*a, op=op),
    run=L.cpu_run(SPEC, lambda **a: reference_dsa_serve(**a)),
    twin_outputs=lambda a: functional_outputs(a[5], a[6], a[10]),
)

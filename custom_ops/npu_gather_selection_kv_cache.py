"""custom::npu_gather_selection_kv_cache (+ _functional) — baseline gather with a reuse ledger (docs/ops.md §1).

Per query row ``r = b*S + s`` the status row is a ledger of what the selection buffer of row ``r``
holds (entry ``p < K``: id at selection position ``p``; entry ``K``: the length written last time).
The op gathers the valid top-k ids of the row into the selection buffer, reusing entries that the
ledger says are already there.

Reference choices (docs/ops.md §1, the intended behaviour, not the [NPU] deviations):

* ``K > 32`` (``bsz == 1``): §1.4 exactly. When an id occurs several times in the old ledger, the
  lowest position is the one that may be kept (the spec leaves this open).
* ``K <= 32``: §1.5 as written (scan stops at the first negative id, hits only at old positions
  ``< old_actual // bsz``, no ``max_reuse`` limit, max block swapped to position ``n-1``), with the
  per-batch arrays indexed by ``b`` and ``Lr = L[b] - (S-1-s)`` for every ``S`` (the NPU indexes them
  by ``r``, which is only correct for ``S = 1``; for ``S = 1`` both agree).
* ``full_q_actual_seq`` is validated but not read (as on the NPU's K > 32 path).
* Empty rows (``L[b] <= 0`` or ``Lr <= 0``) write nothing and report ``actual_seq = 0``; rows
  ``>= B*S`` of the returned ``actual_seq`` are 0 (the NPU leaves both uninitialised).
* Data-dependent bounds (every block-table entry the op would dereference) are checked before
  anything is written; a bad entry raises ``RuntimeError`` naming the table.
* A selection block table that maps two positions onto the same storage gives undefined content
  (never out of bounds); GLM's table is the identity.

CPU kernel: ``csrc/npu_gather_selection_kv_cache.cpp`` (``at::parallel_for`` over query rows), or
:func:`reference_npu_gather_selection_kv_cache` when ``OFFLOAD_PASSES_CPU_KERNELS=reference``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from . import _library as L
from .opspec import GeOp, Limit, OpSpec, shared_limits

log = logging.getLogger("offload_passes.custom_ops.npu_gather_selection_kv_cache")

SPEC = OpSpec(
    namespace="custom",
    name="npu_gather_selection_kv_cache",
    schema=(
        "npu_gather_selection_kv_cache(Tensor(a!) selection_k_rope, Tensor(b!) selection_kv_cache, "
        "Tensor(c!) selection_kv_block_table, Tensor(d!) selection_kv_block_status, "
        "Tensor selection_topk_indices, Tensor full_k_rope, Tensor full_kv_cache, "
        "Tensor full_kv_block_table, Tensor full_kv_actual_seq, Tensor full_q_actual_seq, *, "
        "int selection_topk_block_size=64) -> Tensor"
    ),
    role="offload",
    summary="baseline gather of the selected KV rows with a reuse ledger (the unmodified model's op)",
    functional="npu_gather_selection_kv_cache_functional",
    # limits of tiling/gather_selection_kv_cache
    limits=shared_limits("MAX_TOPK") + (
        Limit("SMALL_TOPK", 32, "K <= 32 uses the block-size path (§1.5); above it bsz must be 1 (§1.4)"),
        Limit("DEFAULT_BLOCK_SIZE", 64, "replaces selection_topk_block_size <= 0"),
        Limit("MAX_KV_DIM", 656, "selection/full kv cache last dim"),
        Limit("MAX_SEQ_EXCLUSIVE", 8, "query tokens per batch row S must be below this"),
    ),
    ge=GeOp("GatherSelectionKvCache", ref_known=True,
            outputs=("selection_k_rope", "selection_kv_cache", "selection_kv_block_table",
                     "selection_kv_block_status", "selection_kv_actual_seq")),
    cuda_kernel="npu_gather_selection_kv_cache",
    arg_roles={"selection_k_rope": "selection", "selection_kv_cache": "selection",
               "selection_kv_block_table": "selection_table"},
)
OP, FUNCTIONAL_OP = SPEC.op_names
L.define(SPEC.schema)
L.define(SPEC.functional_schema)

MAX_TOPK, SMALL_TOPK, DEFAULT_BLOCK_SIZE, MAX_KV_DIM, MAX_SEQ_EXCLUSIVE = SPEC.limit_values(
    "MAX_TOPK", "SMALL_TOPK", "DEFAULT_BLOCK_SIZE", "MAX_KV_DIM", "MAX_SEQ_EXCLUSIVE")
PAYLOAD_DTYPES = (torch.float16, torch.bfloat16, torch.int8)


@dataclass(frozen=True)
class GatherGeometry:
    """Sizes resolved by validation (``bsz`` after the ``<= 0 -> 64`` replacement; ``no_rope``: no rope bytes
    move, the rope tensors are 1-D empty or ``[..., 0]``)."""

    B: int
    S: int
    K: int
    bsz: int
    no_rope: bool


def validate_npu_gather_selection_kv_cache(*args: Any, op: str = OP, **kwargs: Any) -> GatherGeometry:
    """Every check of docs/ops.md §1.2 (plus shape agreements the copies rely on).

    Takes the op's arguments as its schema does (positional or by name; ``L.bind``).
    """
    (selection_k_rope, selection_kv_cache, selection_kv_block_table, selection_kv_block_status,
     selection_topk_indices, full_k_rope, full_kv_cache, full_kv_block_table, full_kv_actual_seq,
     full_q_actual_seq, selection_topk_block_size) = L.bind(SPEC, args, kwargs)
    c = L.check
    sel_rope, sel_kv, sbt, status, topk = (
        selection_k_rope, selection_kv_cache, selection_kv_block_table, selection_kv_block_status,
        selection_topk_indices,
    )
    full_rope, full_kv, fbt = full_k_rope, full_kv_cache, full_kv_block_table
    # dtypes
    dt = sel_kv.dtype
    c(dt in PAYLOAD_DTYPES, op,
      lambda: f"selection_kv_cache dtype must be float16, bfloat16 or int8, got {dt}")
    for name, t in (("selection_k_rope", sel_rope), ("full_k_rope", full_rope), ("full_kv_cache", full_kv)):
        c(t.dtype == dt, op,
          lambda: f"{name} dtype must equal selection_kv_cache dtype {dt}, got {t.dtype}")
    for name, t in (
        ("selection_kv_block_table", sbt), ("selection_kv_block_status", status),
        ("selection_topk_indices", topk), ("full_kv_block_table", fbt),
        ("full_kv_actual_seq", full_kv_actual_seq), ("full_q_actual_seq", full_q_actual_seq),
    ):
        c(t.dtype == torch.int32, op, lambda: f"{name} must be int32, got {t.dtype}")
    # selection payload
    c(sel_kv.dim() == 3, op, lambda: f"selection_kv_cache must be 3-D, got shape {list(sel_kv.shape)}")
    c(sel_rope.dim() in (1, 3), op,
      lambda: f"selection_k_rope must be 3-D or 1-D empty, got shape {list(sel_rope.shape)}")
    no_rope = sel_rope.dim() == 1
    if no_rope:
        c(sel_rope.numel() == 0, op,
          lambda: f"selection_k_rope must be empty when 1-D (no-rope mode), got shape {list(sel_rope.shape)}")
    else:
        c(
            sel_rope.size(0) == sel_kv.size(0) and sel_rope.size(1) == sel_kv.size(1),
            op,
            lambda: f"selection_k_rope dims 0,1 must equal selection_kv_cache's {list(sel_kv.shape)[:2]}, got "
                    f"{list(sel_rope.shape)}",
        )
    bsz = selection_topk_block_size if selection_topk_block_size > 0 else DEFAULT_BLOCK_SIZE
    SBS = sel_kv.size(1)
    c(SBS > 0, op, lambda: f"selection_kv_cache.size(1) (block size) must be > 0, got {SBS}")
    c(SBS % bsz == 0, op,
      lambda: f"selection_kv_cache.size(1) ({SBS}) must be a multiple of selection_topk_block_size {bsz}")
    # full payload
    c(full_kv.dim() == 3, op, lambda: f"full_kv_cache must be 3-D, got shape {list(full_kv.shape)}")
    FBS = full_kv.size(1)
    c(FBS > 0, op, lambda: f"full_kv_cache.size(1) (block size) must be > 0, got {FBS}")
    c(FBS % bsz == 0, op,
      lambda: f"full_kv_cache.size(1) ({FBS}) must be a multiple of selection_topk_block_size {bsz}")
    c(full_rope.dim() in (1, 3), op,
      lambda: f"full_k_rope must be 3-D or 1-D empty, got shape {list(full_rope.shape)}")
    if full_rope.dim() == 1:
        c(full_rope.numel() == 0, op,
          lambda: f"full_k_rope must be empty when 1-D (no-rope mode), got shape {list(full_rope.shape)}")
    else:
        c(
            full_rope.size(0) == full_kv.size(0) and full_rope.size(1) == FBS,
            op,
            lambda: f"full_k_rope dims 0,1 must equal full_kv_cache's {list(full_kv.shape)[:2]}, got "
                    f"{list(full_rope.shape)}",
        )
    c(
        (full_rope.dim() == 1) == no_rope,
        op,
        lambda: f"full_k_rope and selection_k_rope must both be 3-D or both 1-D empty, got "
                f"{list(full_rope.shape)} and {list(sel_rope.shape)}",
    )
    c(
        full_kv.size(2) == sel_kv.size(2),
        op,
        lambda: f"full_kv_cache.size(2) must equal selection_kv_cache.size(2) {sel_kv.size(2)}, got "
                f"{full_kv.size(2)}",
    )
    if not no_rope:
        c(
            full_rope.size(2) == sel_rope.size(2),
            op,
            lambda: f"full_k_rope.size(2) must equal selection_k_rope.size(2) {sel_rope.size(2)}, got "
                    f"{full_rope.size(2)}",
        )
    # indices and ledger
    c(
        topk.dim() in (3, 4) and status.dim() == topk.dim(),
        op,
        lambda: f"selection_topk_indices and selection_kv_block_status must both be 3-D (TND) or both 4-D "
                f"(BSND), "
        f"got {list(topk.shape)} and {list(status.shape)}",
    )
    K = topk.size(-1)
    c(
        list(status.shape)[:-1] == list(topk.shape)[:-1] and status.size(-1) == K + 1,
        op,
        lambda: f"selection_kv_block_status must have shape {list(topk.shape)[:-1] + [K + 1]} (last dim K+1), "
                f"got {list(status.shape)} (from selection_topk_indices shape {list(topk.shape)})",
    )
    H = topk.size(-2)
    c(H == 1, op, lambda: f"selection_topk_indices head dim (H) must be 1, got {H}")
    c(0 < K <= MAX_TOPK, op,
      lambda: f"selection_topk_indices last dim (K) must be in [1, {MAX_TOPK}], got {K}")
    c(
        K <= SMALL_TOPK or bsz == 1,
        op,
        lambda: f"selection_topk_block_size must be 1 when K > {SMALL_TOPK}, got {bsz} (K = {K})",
    )
    c(fbt.dim() == 2, op, lambda: f"full_kv_block_table must be 2-D [B, maxblk], got shape {list(fbt.shape)}")
    if topk.dim() == 4:
        B, S = topk.size(0), topk.size(1)
        c(fbt.size(0) == B, op,
          lambda: f"full_kv_block_table.size(0) must equal B {B} (BSND), got {fbt.size(0)}")
    else:
        B, T = fbt.size(0), topk.size(0)
        c(B > 0, op, lambda: f"full_kv_block_table.size(0) (B) must be > 0 (TND), got {B}")
        c(T % B == 0, op,
          lambda: f"selection_topk_indices.size(0) (T = {T}) must be a multiple of B {B} (TND)")
        S = T // B
    c(B > 0, op, lambda: f"batch B must be > 0, got {B}")
    c(0 < S < MAX_SEQ_EXCLUSIVE, op,
      lambda: f"S (query tokens per batch row) must be in [1, {MAX_SEQ_EXCLUSIVE - 1}], got {S}")
    # selection block table
    c(sbt.dim() == 2, op, lambda: f"selection_kv_block_table must be 2-D, got shape {list(sbt.shape)}")
    rows = B * S * H
    c(sbt.size(0) >= rows, op,
      lambda: f"selection_kv_block_table.size(0) must be >= B*S*H = {rows}, got {sbt.size(0)}")
    s_maxblk = sbt.size(1)
    need_blk = (K * bsz + SBS - 1) // SBS
    c(
        s_maxblk >= need_blk,
        op,
        lambda: f"selection_kv_block_table.size(1) must be >= ceil(K*bsz/block_size) = {need_blk}, got "
                f"{s_maxblk}",
    )
    c(
        sel_kv.size(0) >= rows * s_maxblk,
        op,
        lambda: f"selection_kv_cache.size(0) (blocks) must be >= B*S*H*maxblk = {rows * s_maxblk}, got "
                f"{sel_kv.size(0)} (maxblk = selection_kv_block_table.size(1))",
    )
    Dkv = sel_kv.size(2)
    c(Dkv <= MAX_KV_DIM, op,
      lambda: f"selection_kv_cache.size(2) (kv dim) must be <= {MAX_KV_DIM}, got {Dkv}")
    for name, t in (("full_kv_actual_seq", full_kv_actual_seq), ("full_q_actual_seq", full_q_actual_seq)):
        c(t.dim() == 1 and t.size(0) == B, op,
          lambda: f"{name} must be 1-D of length B {B}, got shape {list(t.shape)}")
    # no rope: the 1-D empty form (CANN's int8 mode) or a zero-width 3-D rope (docs/ops.md §1.2)
    return GatherGeometry(B=B, S=S, K=K, bsz=bsz, no_rope=sel_rope.size(-1) == 0)


# --------------------------------------------------------------------------------------------
# Reference (test oracle)
# --------------------------------------------------------------------------------------------

#: The block-table errors, in the order a row is checked (the C++ kernel's order, and the kind the CUDA kernel
#: writes into its error word, ``cuda/npu_gather_selection_kv_cache.py``).
TABLE_SELECTION, TABLE_COLUMNS, TABLE_FULL = 1, 2, 3


def table_error(kind: int, r: int, b: int, max_id: int, L_b: int, n_sel_blocks: int, need_blk: int,
                fbt_cols: int, n_full_blocks: int) -> str:
    """The message (after ``custom::<op>: ``) of a block-table entry the op would dereference out of range:
    row ``r`` (batch row ``b``); ``max_id`` and ``L_b`` are the row's largest valid id and cache length."""
    if kind == TABLE_SELECTION:
        return (f"selection_kv_block_table[{r}] has an entry outside [0, {n_sel_blocks}) in its first "
                f"{need_blk} columns")
    if kind == TABLE_COLUMNS:
        return (f"full_kv_block_table[{b}] has {fbt_cols} columns, too few for id {max_id} "
                f"(full_kv_actual_seq[{b}] = {L_b})")
    return f"full_kv_block_table[{b}] has an entry outside [0, {n_full_blocks}) for a valid id"


def _check_tables(rows_active: list, sbt: torch.Tensor, fbt: torch.Tensor, topk2: torch.Tensor,
                  L_: torch.Tensor, geo: GatherGeometry, n_sel_blocks: int, n_full_blocks: int,
                  FBS: int, SBS: int, op: str) -> None:
    """Every block-table entry the op may dereference must be in range (checked before writing)."""
    need_blk = (geo.K * geo.bsz + SBS - 1) // SBS
    for r, b, max_sel in rows_active:
        row = topk2[r]
        ids = row[(row >= 0) & (row <= max_sel)].long()
        max_id = int(ids.max()) if ids.numel() else -1

        def fail(kind: int) -> str:
            return table_error(kind, r, b, max_id, int(L_[b]), n_sel_blocks, need_blk, fbt.size(1), n_full_blocks)

        ent = sbt[r, :need_blk]
        L.check(not bool(((ent < 0) | (ent >= n_sel_blocks)).any()), op, lambda: fail(TABLE_SELECTION))
        if ids.numel() == 0:
            continue
        col = ids * geo.bsz // FBS
        L.check(bool((col < fbt.size(1)).all()), op, lambda: fail(TABLE_COLUMNS))
        blk = fbt[b, col]
        L.check(bool(((blk >= 0) & (blk < n_full_blocks)).all()), op, lambda: fail(TABLE_FULL))


def reference_npu_gather_selection_kv_cache(
    selection_k_rope: torch.Tensor,
    selection_kv_cache: torch.Tensor,
    selection_kv_block_table: torch.Tensor,
    selection_kv_block_status: torch.Tensor,
    selection_topk_indices: torch.Tensor,
    full_k_rope: torch.Tensor,
    full_kv_cache: torch.Tensor,
    full_kv_block_table: torch.Tensor,
    full_kv_actual_seq: torch.Tensor,
    full_q_actual_seq: torch.Tensor,
    selection_topk_block_size: int = 64,
) -> torch.Tensor:
    """Pure-torch §1.4 / §1.5 (see module doc for the choices). Mutates selection and status in place."""
    geo = validate_npu_gather_selection_kv_cache(
        selection_k_rope, selection_kv_cache, selection_kv_block_table, selection_kv_block_status,
        selection_topk_indices, full_k_rope, full_kv_cache, full_kv_block_table, full_kv_actual_seq,
        full_q_actual_seq, selection_topk_block_size,
    )
    B, S, K, bsz = geo.B, geo.S, geo.K, geo.bsz
    R = B * S
    sbt, fbt = selection_kv_block_table, full_kv_block_table
    topk2 = selection_topk_indices.reshape(R, K)
    # Work on a view when possible so the ledger is updated in place; else copy back at the end.
    st_contig = selection_kv_block_status.is_contiguous()
    status2 = (selection_kv_block_status.view(R, K + 1) if st_contig
               else selection_kv_block_status.reshape(R, K + 1).clone())
    SBS, FBS = selection_kv_cache.size(1), full_kv_cache.size(1)
    actual_seq = torch.zeros(sbt.size(0), dtype=torch.int32)

    active = []
    for r in range(R):
        b, s = divmod(r, S)
        Lb = int(full_kv_actual_seq[b])
        Lr = Lb - (S - 1 - s)
        if Lb <= 0 or Lr <= 0:
            continue
        active.append((r, b, (Lr + bsz - 1) // bsz - 1))
    _check_tables(active, sbt, fbt, topk2, full_kv_actual_seq, geo, selection_kv_cache.size(0),
                  full_kv_cache.size(0), FBS, SBS, OP)

    payload = [(selection_kv_cache, full_kv_cache)]
    if not geo.no_rope:
        payload.append((selection_k_rope, full_k_rope))
    for r, b, max_sel in active:
        s = r % S
        Lr = int(full_kv_actual_seq[b]) - (S - 1 - s)
        if K > SMALL_TOPK:
            act = _ledger_row_vec(r, b, s, max_sel, topk2[r], status2[r], sbt, fbt, payload, SBS, FBS)
        else:
            act = _ledger_row_small(r, b, Lr, max_sel, bsz, topk2[r], status2[r], sbt, fbt, payload, SBS, FBS)
        actual_seq[r] = act
    if not st_contig:
        selection_kv_block_status.copy_(status2.view(selection_kv_block_status.shape))
    return actual_seq


def _ledger_row_vec(r: int, b: int, s: int, max_sel: int, row: torch.Tensor, status: torch.Tensor,
                    sbt: torch.Tensor, fbt: torch.Tensor, payload: list, SBS: int, FBS: int) -> int:
    """§1.4 for one row (bsz == 1, so one id = one token), vectorised over the K entries."""
    K = row.numel()
    max_reuse = max(max_sel - s - 1, 0)
    ids = row[(row >= 0) & (row <= max_sel)].long()  # all K scanned, negatives anywhere dropped
    n = ids.numel()
    old = status[:K].long().clone()
    # Lowest old position of each id (stable sort keeps equal values in position order).
    vals, order = torch.sort(old, stable=True)
    pos = torch.searchsorted(vals, ids).clamp(max=K - 1)
    found = (vals[pos] == ids) & (ids <= max_reuse)
    first = order[pos]
    keep = torch.full((K,), -1, dtype=torch.long)  # old position -> j kept there (last j wins)
    j_all = torch.arange(n)
    keep.scatter_reduce_(0, first[found], j_all[found], reduce="amax")
    moved_from = torch.full((n,), -1, dtype=torch.long)
    kept_pos = torch.nonzero(keep >= 0).flatten()
    top = int(kept_pos.max()) if kept_pos.numel() else -1
    if top + 1 - n > 0:  # kept entries at/after position n are evicted and moved below n
        ev = kept_pos[kept_pos >= n]
        moved_from[keep[ev]] = ev
        keep[ev] = -1
    is_kept = torch.zeros(n, dtype=torch.bool)
    is_kept[keep[keep >= 0]] = True
    todo = torch.nonzero(~is_kept).flatten()        # ids to write, in order
    dst = torch.nonzero(keep < 0).flatten()[: todo.numel()]  # ascending free positions (all < n)
    src_pos = moved_from[todo]
    mv = src_pos >= 0
    x = ids[todo]
    for sel, full in payload:
        data = full[fbt[b, x // FBS].long(), x % FBS]
        if bool(mv.any()):
            sp = src_pos[mv]
            data[mv] = sel[sbt[r, sp // SBS].long(), sp % SBS]
        sel[sbt[r, dst // SBS].long(), dst % SBS] = data
    status[dst] = x.to(torch.int32)
    status[n:K] = -1
    status[K] = n
    return n


def _ledger_row_small(r: int, b: int, Lr: int, max_sel: int, bsz: int, row: torch.Tensor,
                      status: torch.Tensor, sbt: torch.Tensor, fbt: torch.Tensor, payload: list,
                      SBS: int, FBS: int) -> int:
    """§1.5 for one row (K <= 32, any bsz): plain Python, block by block."""
    K = row.numel()
    ids = []
    for x in row.tolist():
        if x < 0:
            break  # scanning stops at the first negative id
        if x <= max_sel:
            ids.append(x)
    n = len(ids)
    old = status.tolist()
    old_actual = old[K]
    eligible = min(old_actual // bsz, K) if old_actual > 0 else 0  # full blocks of the last write
    first_at = {}
    for p in range(eligible):
        first_at.setdefault(old[p], p)
    keep = {}
    for j, x in enumerate(ids):
        if x in first_at:
            keep[first_at[x]] = j
    moved = {}
    top = max(keep) if keep else -1
    if top + 1 - n > 0:
        for p in range(top, n - 1, -1):
            if p in keep:
                moved[keep.pop(p)] = p
    kept_j = set(keep.values())
    tail_len = Lr - max_sel * bsz

    def blen(x: int) -> int:
        return tail_len if x == max_sel else bsz

    def sel_loc(p: int) -> tuple:
        tok = p * bsz
        return int(sbt[r, tok // SBS]), tok % SBS

    free = [p for p in range(K) if p not in keep]
    fi = 0
    actual = 0
    new_status = old[:K]
    for j, x in enumerate(ids):
        actual += blen(x)
        if j in kept_j:
            continue
        dst = free[fi]
        fi += 1
        db, do = sel_loc(dst)
        ln = blen(x)
        for sel, full in payload:
            if j in moved:
                sb_, so = sel_loc(moved[j])
                src = sel[sb_, so:so + ln].clone()
            else:
                tok = x * bsz
                src = full[int(fbt[b, tok // FBS]), tok % FBS:tok % FBS + ln]
            sel[db, do:do + ln] = src
        new_status[dst] = x
    if n > 0:
        mx = max(ids)
        if new_status[n - 1] != mx:  # the max (possibly partial) block must end the selection
            pm = new_status[:n].index(mx)
            ln = blen(mx)
            (ab, ao), (zb, zo) = sel_loc(pm), sel_loc(n - 1)
            for sel, _ in payload:
                blk_max = sel[ab, ao:ao + ln].clone()
                blk_last = sel[zb, zo:zo + bsz].clone()
                sel[zb, zo:zo + ln] = blk_max
                sel[ab, ao:ao + bsz] = blk_last
            new_status[pm], new_status[n - 1] = new_status[n - 1], new_status[pm]
    for p in range(n, K):
        new_status[p] = -1
    status[:K] = torch.tensor(new_status, dtype=torch.int32)
    status[K] = actual
    return actual


# --------------------------------------------------------------------------------------------
# CPU kernels
# --------------------------------------------------------------------------------------------

# CPU and fake kernels of the op and its twin, Functionalize (custom_ops/_library.py: register_twins); the
# CPU computation is csrc/npu_gather_selection_kv_cache.cpp (the op's arguments; it checks the block-table
# entries the data makes it read) or the reference. The twin's outputs start from the inputs (default
# clones): the ledger keeps stale rows and reuses hits.
L.register_twins(
    SPEC,
    validate=lambda a, op: validate_npu_gather_selection_kv_cache(*a, op=op),
    run=L.cpu_run(SPEC, lambda **a: reference_npu_gather_selection_kv_cache(**a)),
    fake_returns=lambda a, _geo: a[2].new_empty([a[2].size(0)], dtype=torch.int32),  # act: one per table row
)

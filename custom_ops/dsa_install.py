"""custom::dsa_install / dsa_install_functional — refill a layer's pool after attention (docs/ops.md §4).

For every valid record of ``install_records`` (written by ``dsa_plan``), per batch row and in slab
order, with per-row dedupe (first occurrence wins), the id gets the next FIFO way of its set
(``way = ctr[set] & 15``) and the served selection row of its first occurrence is copied into the pool.
``metadata_update=1`` also writes ``pool_ids``/``id_to_slot``/``lru_counter``; ``metadata_update=0``
advances a private copy of the counters and changes only the pool payload.

Address independence: the NPU kernel decodes the records from the first 4096-aligned address inside
the buffer, so there a clone between plan and install corrupts decoding. **The CPU kernels (C++ and
reference) use ``base = 0``** (records at byte 0, counts at byte ``rec_bytes``) and never look at the
buffer address; the buffer only has to hold ``required`` bytes (plan's ``+4095`` slack is not needed).

A rope width of 0 (rope tensors ``[..., 0]``) is the no-rope mode (docs/ops.md §3.3): only kv rows move.

``dst = b*(PS//sbs)*sbs + slot`` is kept exactly as on the NPU; with ``PS % selection_block_size != 0``
(never the case in GLM) batch rows overlap in the flat pool, and the C++ kernel then runs the batch
rows sequentially so that the result stays deterministic and equal to the reference.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from . import _library as L
from ._pool import MAX_POOL, WAYS, check_pool_metadata, check_pool_size  # noqa: F401
from ._records import decode_records, records_layout
from .opspec import GeOp, Limit, OpSpec, shared_limits

log = logging.getLogger("offload_passes.custom_ops.dsa_install")

SPEC = OpSpec(
    namespace="custom",
    name="dsa_install",
    schema=(
        "dsa_install(Tensor install_records, Tensor selection_kv_cache, Tensor selection_k_rope, "
        "Tensor selection_kv_block_table, Tensor(a!) pool_kv_cache, Tensor(b!) pool_k_rope, "
        "Tensor(c!) pool_ids, Tensor(d!) id_to_slot, Tensor(e!) lru_counter, *, int raw_seq=1, "
        "int topk=2048, int selection_block_size=128, int metadata_update=1) -> ()"
    ),
    role="offload",
    summary="install the step's missed selection rows into the pool (16-way FIFO) and its metadata",
    functional="dsa_install_functional",
    limits=shared_limits("MAX_RAW_SEQ", "MAX_TOPK", "MAX_DKV", "MIN_DR", "MAX_DR", "MAX_POOL", "WAYS", "TOPK_GRANULARITY",
                         "MIN_SELECTION_BLOCK_SIZE", "MAX_SELECTION_BLOCK_SIZE")
    + (Limit("MAX_ID_RANGE", (192 - 12 - 8) * 1024 * 8,
             "id_to_slot width IR: the NPU kernel keeps a ceil(IR/32)*4-byte bitset in its 192 KiB UB beside "
             "~12 KiB of buffers and an 8 KiB pad (the CPU kernels do not need it; options.py enforces it)"),),
    ge=GeOp("DsaInstall", outputs=("pool_kv_cache", "pool_k_rope", "pool_ids", "id_to_slot", "lru_counter")),
    cuda_kernel="dsa_install",
    arg_roles={"install_records": "records", "selection_kv_cache": "selection", "selection_k_rope": "selection",
               "selection_kv_block_table": "selection_table", "pool_kv_cache": "pool", "pool_k_rope": "pool",
               "pool_ids": "metadata", "id_to_slot": "metadata", "lru_counter": "metadata"},
)
OP, FUNCTIONAL_OP = SPEC.op_names
L.define(SPEC.schema)
L.define(SPEC.functional_schema)

MAX_RAW_SEQ, MAX_TOPK, MAX_DKV, MIN_DR, MAX_DR, TOPK_GRANULARITY, MIN_SBS, MAX_SBS = SPEC.limit_values(
    "MAX_RAW_SEQ", "MAX_TOPK", "MAX_DKV", "MIN_DR", "MAX_DR", "TOPK_GRANULARITY", "MIN_SELECTION_BLOCK_SIZE",
    "MAX_SELECTION_BLOCK_SIZE")
PAYLOAD_DTYPES = (torch.float16, torch.bfloat16)


def validate_dsa_install(*args: Any, op: str = OP, **kwargs: Any) -> tuple:
    """Check every limit of docs/ops.md §4.1 (sizes and dtypes only; safe in fake mode).

    Returns ``(B, S, K, PS, IR)``. ``op`` names the op in messages (in-place or functional twin).

    Takes the op's arguments as its schema does (positional or by name; ``L.bind``).
    """
    (install_records, selection_kv_cache, selection_k_rope, selection_kv_block_table, pool_kv_cache,
     pool_k_rope, pool_ids, id_to_slot, lru_counter, raw_seq, topk, selection_block_size,
     metadata_update) = L.bind(SPEC, args, kwargs)
    rec = install_records
    L.check(rec.dtype == torch.int8, op, f"install_records must be int8, got {rec.dtype}")
    L.check(rec.dim() == 1, op, f"install_records must be 1-D, got {rec.dim()}-D")
    L.check(rec.numel() > 0, op, "install_records must be non-empty, got 0 bytes")
    dt = selection_kv_cache.dtype
    L.check(
        dt in PAYLOAD_DTYPES, op, f"selection_kv_cache dtype must be float16 or bfloat16, got {dt}"
    )
    for name, t in (
        ("selection_k_rope", selection_k_rope),
        ("pool_kv_cache", pool_kv_cache),
        ("pool_k_rope", pool_k_rope),
    ):
        L.check(t.dtype == dt, op, f"{name} dtype must equal selection_kv_cache's {dt}, got {t.dtype}")
    for name, t in (
        ("selection_kv_block_table", selection_kv_block_table),
        ("pool_ids", pool_ids),
        ("id_to_slot", id_to_slot),
        ("lru_counter", lru_counter),
    ):
        L.check(t.dtype == torch.int32, op, f"{name} must be int32, got {t.dtype}")
    L.check(0 < raw_seq <= MAX_RAW_SEQ, op, f"raw_seq must be in [1, {MAX_RAW_SEQ}], got {raw_seq}")
    L.check(0 < topk <= MAX_TOPK, op, f"topk must be in [1, {MAX_TOPK}], got {topk}")
    L.check(topk % TOPK_GRANULARITY == 0, op, f"topk must be a multiple of {TOPK_GRANULARITY}, got {topk}")
    sbs = selection_block_size
    L.check(
        MIN_SBS <= sbs <= MAX_SBS and L.is_pow2(sbs),
        op,
        f"selection_block_size must be a power of two in [{MIN_SBS}, {MAX_SBS}], got {sbs}",
    )
    L.check(topk % sbs == 0, op, f"topk must be a multiple of selection_block_size={sbs}, got {topk}")
    L.check(metadata_update in (0, 1), op, f"metadata_update must be 0 or 1, got {metadata_update}")
    for name, t in (
        ("selection_kv_cache", selection_kv_cache),
        ("selection_k_rope", selection_k_rope),
        ("pool_kv_cache", pool_kv_cache),
        ("pool_k_rope", pool_k_rope),
    ):
        L.check(t.dim() == 3, op, f"{name} must be 3-D, got {t.dim()}-D")
    L.check(
        selection_kv_block_table.dim() == 2,
        op,
        f"selection_kv_block_table must be 2-D, got {selection_kv_block_table.dim()}-D",
    )
    B, PS = pool_kv_cache.size(0), pool_kv_cache.size(1)
    L.check(B > 0, op, f"pool_kv_cache dim 0 (B) must be > 0, got {B}")
    NS = check_pool_size(op, "pool_kv_cache dim 1", PS)
    need = B * raw_seq * topk
    L.check(
        selection_kv_cache.size(0) * selection_kv_cache.size(1) >= need,
        op,
        f"selection_kv_cache must hold >= B*raw_seq*topk = {need} rows (dims 0*1), got "
        f"{selection_kv_cache.size(0) * selection_kv_cache.size(1)} (B = pool_kv_cache.size(0))",
    )
    L.check(
        selection_k_rope.size(0) == selection_kv_cache.size(0)
        and selection_k_rope.size(1) == selection_kv_cache.size(1),
        op,
        f"selection_k_rope dims 0,1 must equal selection_kv_cache's "
        f"{tuple(selection_kv_cache.shape[:2])}, got {tuple(selection_k_rope.shape[:2])}",
    )
    L.check(
        selection_kv_block_table.size(0) == B * raw_seq
        and selection_kv_block_table.size(1) >= topk // sbs,
        op,
        f"selection_kv_block_table must be [B*raw_seq={B * raw_seq}, >= topk/selection_block_size="
        f"{topk // sbs}], got {tuple(selection_kv_block_table.shape)} (B = pool_kv_cache.size(0))",
    )
    Dkv, Dr = pool_kv_cache.size(2), pool_k_rope.size(2)
    L.check(0 < Dkv <= MAX_DKV, op, f"pool_kv_cache dim 2 (Dkv) must be in (0, {MAX_DKV}], got {Dkv}")
    L.check(MIN_DR <= Dr <= MAX_DR, op, f"pool_k_rope dim 2 (Dr) must be in [{MIN_DR}, {MAX_DR}] (0: no-rope mode), "
                                         f"got {Dr}")
    L.check(
        selection_kv_cache.size(2) == Dkv,
        op,
        f"selection_kv_cache dim 2 must equal pool_kv_cache's Dkv={Dkv}, got {selection_kv_cache.size(2)}",
    )
    L.check(
        selection_k_rope.size(2) == Dr,
        op,
        f"selection_k_rope dim 2 must equal pool_k_rope's Dr={Dr}, got {selection_k_rope.size(2)}",
    )
    L.check(
        pool_k_rope.size(0) == B and pool_k_rope.size(1) == PS,
        op,
        f"pool_k_rope must be [B={B}, PS={PS}, Dr], got {tuple(pool_k_rope.shape)} (B, PS = pool_kv_cache dims 0, 1)",
    )
    L.check(
        pool_ids.dim() == 2 and pool_ids.size(0) == B and pool_ids.size(1) == PS,
        op,
        f"pool_ids must be [B={B}, PS={PS}], got {tuple(pool_ids.shape)} (B, PS = pool_kv_cache dims 0, 1)",
    )
    IR = check_pool_metadata(op, B, NS, id_to_slot, lru_counter, got="got", b_src="pool_kv_cache.size(0)")
    required = records_layout(B, raw_seq, topk).required
    L.check(
        rec.numel() >= required,
        op,
        f"install_records must hold >= {required} bytes (layout for B={B}, raw_seq={raw_seq}, "
        f"topk={topk}), got {rec.numel()}",
    )
    return B, raw_seq, topk, PS, IR


def _install_order(install_records, B, S, K, NS, IR):
    """Valid records in install order: ``(b, set, id, seq, pos)`` int64 rows, before dedupe."""
    recs, _ = decode_records(install_records, B, S, K, base=0, clamp_to_cap=True)
    mt, st, x, sq, pos = recs.unbind(1)
    ok = (x >= 0) & (x < IR) & (st >= 0) & (st < NS) & (sq >= 0) & (sq < S) & (pos >= 0) & (pos < K)
    b = mt // (S * 8)
    return b[ok], st[ok], x[ok], sq[ok], pos[ok]


def reference_dsa_install(
    install_records: torch.Tensor,
    selection_kv_cache: torch.Tensor,
    selection_k_rope: torch.Tensor,
    selection_kv_block_table: torch.Tensor,
    pool_kv_cache: torch.Tensor,
    pool_k_rope: torch.Tensor,
    pool_ids: torch.Tensor,
    id_to_slot: torch.Tensor,
    lru_counter: torch.Tensor,
    *,
    raw_seq: int = 1,
    topk: int = 2048,
    selection_block_size: int = 128,
    metadata_update: int = 1,
    validate: bool = True,
) -> None:
    """Pure-torch oracle of docs/ops.md §4.2, in place (CPU base = 0 records layout).

    Decoding, validity filter, dedupe and way assignment are vectorised; only the metadata eviction
    chain (whose result depends on the order when ways collide) runs as a Python loop over installs.
    """
    if validate:
        validate_dsa_install(
            install_records, selection_kv_cache, selection_k_rope, selection_kv_block_table,
            pool_kv_cache, pool_k_rope, pool_ids, id_to_slot, lru_counter,
            raw_seq, topk, selection_block_size, metadata_update,
        )
    B, PS = pool_kv_cache.size(0), pool_kv_cache.size(1)
    S, K, sbs, IR, NS = raw_seq, topk, selection_block_size, id_to_slot.size(1), PS // WAYS
    b, st, x, sq, pos = _install_order(install_records, B, S, K, NS, IR)
    n = b.numel()
    if n == 0:
        return
    # Dedupe per batch row, first occurrence (in install order) wins.
    key = b * IR + x
    uniq, inv = torch.unique(key, return_inverse=True)
    first = torch.full((uniq.numel(),), n, dtype=torch.int64).scatter_reduce(
        0, inv, torch.arange(n), reduce="amin"
    )
    keep = torch.zeros(n, dtype=torch.bool)
    keep[first] = True
    b, st, x, sq, pos = b[keep], st[keep], x[keep], sq[keep], pos[keep]
    n = b.numel()
    # Way = (counter + number of earlier installs into the same (b, set) in this call) & 15.
    grp = b * NS + st
    order = torch.sort(grp, stable=True).indices
    sorted_grp = grp[order]
    start = torch.searchsorted(sorted_grp, sorted_grp, right=False)
    rank = torch.empty(n, dtype=torch.int64)
    rank[order] = torch.arange(n) - start
    ctr0 = lru_counter.to(torch.int64)[b, st]
    slot = st * WAYS + ((ctr0 + rank) & 15)

    # Payload: last writer wins per flat destination row (batch rows may overlap when PS % sbs != 0).
    src = ((b * S + sq) * ((K + sbs - 1) // sbs) + pos // sbs) * sbs + pos % sbs
    dst = b * (PS // sbs) * sbs + slot
    rev = torch.arange(n - 1, -1, -1)
    ud, uinv = torch.unique(dst[rev], return_inverse=True)
    last = torch.full((ud.numel(),), n, dtype=torch.int64).scatter_reduce(
        0, uinv, torch.arange(n), reduce="amin"
    )
    winners = rev[last]
    for pool, sel in ((pool_kv_cache, selection_kv_cache), (pool_k_rope, selection_k_rope)):
        if sel.size(-1) == 0:  # the no-rope mode: nothing to move (and a [-1, 0] view is undefined)
            continue
        flat_sel = sel.reshape(-1, sel.size(-1))
        pool_flat = pool.view(-1, pool.size(-1)) if pool.is_contiguous() else None
        rows = flat_sel[src[winners]]
        if pool_flat is not None:
            pool_flat[dst[winners]] = rows
        else:
            tmp = pool.reshape(-1, pool.size(-1)).clone()
            tmp[dst[winners]] = rows
            pool.copy_(tmp.view_as(pool))

    if metadata_update != 1:
        return
    # Counters: advance by the installs into each set (mod 16); untouched sets keep their raw value.
    cnt = torch.zeros(B * NS, dtype=torch.int64).index_add_(0, grp, torch.ones(n, dtype=torch.int64))
    base = lru_counter.to(torch.int64).reshape(-1)
    new_ctr = torch.where(cnt > 0, (base + cnt) & 15, base).to(torch.int32).view(B, NS)
    lru_counter.copy_(new_ctr)
    # Metadata in install order: evict the slot's previous occupant, then claim the slot.
    pid = pool_ids.tolist()
    i2s_updates: dict[tuple[int, int], int] = {}
    for bi, xi, si in zip(b.tolist(), x.tolist(), slot.tolist()):
        old = pid[bi][si]
        if 0 <= old < IR:
            i2s_updates[(bi, old)] = -1
        pid[bi][si] = xi
        i2s_updates[(bi, xi)] = si
    pool_ids.copy_(torch.tensor(pid, dtype=torch.int32))
    if i2s_updates:
        idx = torch.tensor(list(i2s_updates.keys()), dtype=torch.int64)
        val = torch.tensor(list(i2s_updates.values()), dtype=torch.int32)
        id_to_slot[idx[:, 0], idx[:, 1]] = val


def reference_dsa_install_functional(*args, **kwargs) -> tuple[torch.Tensor, ...]:
    """Functional twin of :func:`reference_dsa_install`: returns updated clones, inputs untouched."""
    a = SPEC.twin_binder(args, kwargs)
    return L.run_twin(SPEC, a, None, lambda b, _: reference_dsa_install(**dict(zip(SPEC.arg_names, b))))


# CPU and fake kernels of the op and its twin, Functionalize (custom_ops/_library.py: register_twins); the
# CPU computation is csrc/dsa_install.cpp (the op's arguments) or reference_dsa_install
L.register_twins(SPEC, validate=lambda a, op: validate_dsa_install(*a, op=op),
                 run=L.cpu_run(SPEC, lambda **a: reference_dsa_install(**a, validate=False)))

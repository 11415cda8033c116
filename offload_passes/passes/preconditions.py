"""Pass 3 — the precondition checks: per group, decide pool size / sets / id_range and check every limit.

Anything unmet becomes a ``Refusal`` (reason code + detail naming the argument and the limit); the
backend then compiles the graph unmodified (or raises under ``strict``). The group-level rules every
front-end shares live here once (:class:`Checker`, :func:`check_topk_width`, :func:`check_raw_seq`,
:func:`check_pool_size`, :func:`group_geometry`, the ops' limits); :func:`check_preconditions` is the
recipe form's step (``passes/frontends/recipe.py``), the Hugging Face form's is
``passes/frontends/hf/frontend.py::check_hf_preconditions``.

Recipe form: shapes come from the nodes' example values; the selection block table's identity layout is
checked on the real example inputs (serve writes the selection positionally), and the full block table's
layout on them picks how misses are read (identity: serve's ``[B, F, D]`` view; any other: through the
table).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import fx

from ..custom_ops import spec_for
from ..custom_ops._library import is_pow2
from ..custom_ops._pool import id_range_for, pool_size_problem
from ..options import OffloadOptions
from ._fx import bind, example, input_values, is_graph_input_or_attr, strip_views
from .group import Group, GroupReport
from .producers import producer_of_call
from .refusal import Refusal

if TYPE_CHECKING:
    from .frontends.recipe import Site

# A group's limits are those of the ops the rewrite emits (their OpSpecs; one definition each).
_PLAN, _INSTALL = spec_for("dsa_plan"), spec_for("dsa_install")
MAX_TOPK = _PLAN.limit("MAX_TOPK")
MAX_RAW_SEQ = _PLAN.limit("MAX_RAW_SEQ")
TOPK_ALIGN = _PLAN.limit("TOPK_ALIGN")
MAX_DKV = _INSTALL.limit("MAX_DKV")
MAX_DR = _INSTALL.limit("MAX_DR")
MIN_SBS = _INSTALL.limit("MIN_SELECTION_BLOCK_SIZE")
MAX_SBS = _INSTALL.limit("MAX_SELECTION_BLOCK_SIZE")
FLOAT8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


@dataclass
class SiteGeometry:
    layer: int
    full_kv: fx.Node
    full_rope: fx.Node
    sel_kv: fx.Node
    sel_rope: fx.Node
    sel_table: fx.Node
    status: fx.Node
    F: int  # tokens per batch row of the full cache (maxblk * FBS)
    Dkv: int
    Dr: int
    dtype: torch.dtype
    # the full block table and its block size; ``paged``: it was not the identity layout on the example
    # inputs (or the cache is not ``B*maxblk`` blocks), so serve reads only the pool and the model's own
    # gather reads every other row through the table (docs/new-requests.md, "Paged KV")
    block_table: Optional[fx.Node] = None
    FBS: int = 0
    paged: bool = False


@dataclass
class GroupGeometry:
    group_id: int
    owner_layer: int
    last_layer: int
    layers: list[int]
    B: int
    S: int
    K: int
    BS: int  # selection block size
    pool_size: int
    num_sets: int
    id_range: int
    lengths: fx.Node  # full_kv_actual_seq of the owner's gather
    topk: fx.Node
    topk_node: str
    geometry: dict[int, SiteGeometry] = field(repr=False)

    @property
    def paged(self) -> bool:
        """Served through the block table (any site's table not the identity layout)."""
        return any(g.paged for g in self.geometry.values())

    def to_dict(self) -> dict:
        return {"group_id": self.group_id, "owner_layer": self.owner_layer, "layers": list(self.layers),
                "topk_node": self.topk_node, "K": self.K, "S": self.S, "B": self.B, "BS": self.BS,
                "pool_size": self.pool_size, "num_sets": self.num_sets, "id_range": self.id_range,
                "paged": self.paged}


@dataclass
class PreconditionReport:
    groups: list[GroupGeometry]  # the groups that pass (empty when the front-end refuses them all)
    refusals: list[Refusal]


class Checker:
    """``chk(cond, reason, detail)``: records a :class:`Refusal` at ``layer`` when ``cond`` is false;
    returns ``cond``. ``layer`` may be given per call (a group's check naming one of its sites)."""

    def __init__(self, layer: Optional[int], refusals: Optional[list[Refusal]] = None):
        self.layer = layer
        self.refusals: list[Refusal] = [] if refusals is None else refusals

    def __call__(self, cond: bool, reason: str, detail: str, layer: Optional[int] = None) -> bool:
        if not cond:
            self.refusals.append(Refusal(reason, detail, self.layer if layer is None else layer))
        return cond


def check_topk_width(chk: Checker, K: int, bounded_by_producer: bool) -> None:
    """The top-k width the plan takes: a multiple of ``TOPK_ALIGN``, at most ``MAX_TOPK``.
    ``bounded_by_producer``: the top-k producer's own schema already limits K to ``MAX_TOPK`` (every
    lightning indexer the recipe detection accepts limits sparse_count to INDEXER_MAX_SPARSE_COUNT =
    MAX_TOPK, as does the gather), so only the alignment is checked."""
    if bounded_by_producer:
        chk(K % TOPK_ALIGN == 0, "topk_alignment", f"top-k width K={K} must be a multiple of {TOPK_ALIGN}")
    else:
        chk(K % TOPK_ALIGN == 0 and 0 < K <= MAX_TOPK, "topk_alignment",
            f"top-k width K={K} must be a multiple of {TOPK_ALIGN} and <= {MAX_TOPK}")


def check_raw_seq(chk: Checker, S: int, opts: OffloadOptions) -> None:
    """Query tokens per step: ``1 <= S <= MAX_RAW_SEQ``, and ``S == next_n + 1`` when ``next_n`` is set."""
    chk(1 <= S <= MAX_RAW_SEQ, "raw_seq", f"raw_seq S={S} must be in [1, {MAX_RAW_SEQ}]")
    if opts.next_n is not None:
        chk(S == opts.next_n + 1, "next_n", f"graph has raw_seq S={S}, config next_n={opts.next_n}")


def check_pool_size(chk: Checker, pool_size: int, selection_block_size: int) -> None:
    """The pool geometry rule (``custom_ops/_pool.py::pool_size_problem``) for this group's block size."""
    problem = pool_size_problem(pool_size, selection_block_size)
    chk(problem is None, "pool_size", f"pool_size={pool_size} {problem[0]}" if problem else "")


def group_geometry(g: Group, B: int, S: int, K: int, SBS: int, F: int, lengths: fx.Node,
                   geometry: dict[int, SiteGeometry], opts: OffloadOptions) -> GroupGeometry:
    """A group's geometry: pool size and sets from the options, the id range from the longest cache ``F``."""
    PS = opts.resolved_pool_size
    return GroupGeometry(g.group_id, g.owner.layer, g.last.layer, g.layers, B, S, K, SBS, PS, PS // 16,
                         id_range_for(F, opts.id_range), lengths, g.owner.topk, g.producer.name, geometry)


def is_identity_table(t: torch.Tensor, rows: int, cols: int) -> bool:
    """The first ``cols`` columns of the ``[rows, >= cols]`` table ``t`` are ``arange(rows * cols).view(rows,
    cols)`` (compared on ``t``'s own device: a CUDA table)."""
    return t.dim() == 2 and t.size(0) == rows and t.size(1) >= cols and bool(torch.equal(
        t[:, :cols], torch.arange(rows * cols, dtype=t.dtype, device=t.device).view(rows, cols)))


def _real(node: Any, real_inputs: dict[fx.Node, torch.Tensor]) -> Optional[torch.Tensor]:
    root = strip_views(node)
    t = real_inputs.get(root)
    if t is None or not isinstance(node, fx.Node):
        return None
    ex = example(node)
    if ex is not None and tuple(ex.shape) != tuple(t.shape):
        try:
            t = t.reshape(ex.shape)
        except RuntimeError:
            return None
    return t


def _site(site: "Site", opts: OffloadOptions, real: dict, chk: Checker) -> Optional[tuple]:
    a = site.args
    chk(a["selection_topk_block_size"] == 1, "gather_block_size",
        f"selection_topk_block_size={a['selection_topk_block_size']} (only 1, the K > 32 ledger path, is supported)")
    tk, fkv, frp = example(site.topk), example(a["full_kv_cache"]), example(a["full_k_rope"])
    skv, srp, stb = example(a["selection_kv_cache"]), example(a["selection_k_rope"]), example(a["selection_kv_block_table"])
    sts, fbt, L = example(a["selection_kv_block_status"]), example(a["full_kv_block_table"]), example(a["full_kv_actual_seq"])
    if any(t is None for t in (tk, fkv, frp, skv, srp, stb, sts, fbt, L)):
        chk(False, "no_example_values", f"{site.gather.name}: tensor shapes unknown")
        return None
    # (a quantised cache was refused by detect already)
    if not chk(srp.dim() == 3 and frp.dim() == 3, "no_rope",
               f"selection_k_rope {tuple(srp.shape)}, full_k_rope {tuple(frp.shape)}: only a KV cache with a "
               f"rope cache is offloaded (the no-rope gather mode keeps the gather path)"):
        return None
    if not chk(fkv.dim() == 3 and skv.dim() == 3 and fbt.dim() == 2, "paged_layout",
               f"full_kv_cache {tuple(fkv.shape)} must be [blocks, block_size, Dkv] with a 2-D block table"):
        return None
    K = tk.size(-1)
    check_topk_width(chk, K, bounded_by_producer=True)
    B, maxblk = fbt.shape
    T = tk.numel() // max(K, 1)
    S = T // max(B, 1)
    chk(tk.dim() in (3, 4) and T == B * S and (tk.dim() == 3 or (tk.size(0) == B and tk.size(2) == 1)),
        "topk_layout", f"selection_topk_indices {tuple(tk.shape)} is not [B, S, 1, K] / [B*S, 1, K] with B={B}")
    check_raw_seq(chk, S, opts)
    F_blocks, FBS, Dkv = fkv.shape
    Dr = frp.size(-1)
    chk(tuple(frp.shape[:2]) == (F_blocks, FBS), "paged_layout",
        f"full_k_rope {tuple(frp.shape)} must match full_kv_cache blocks {(F_blocks, FBS)}")
    # Any block table is served: the identity layout (the static batch) through serve's [B, F, D] view of
    # the full cache, any other one (an engine's cache manager) through the model's gather, which takes
    # the table (docs/new-requests.md, "Paged KV"). The choice is made on the example inputs.
    t = _real(a["full_kv_block_table"], real)
    identity = (F_blocks == B * maxblk and t is not None and t.dtype == torch.int32
                and is_identity_table(t, B, maxblk))
    chk(fbt.dtype == torch.int32, "paged_layout", f"full_kv_block_table dtype {fbt.dtype} must be int32")
    if opts.pa_block_size is not None:
        chk(FBS == opts.pa_block_size, "pa_block_size", f"graph block size {FBS} != config pa_block_size {opts.pa_block_size}")
    chk(0 < Dkv <= MAX_DKV, "dims", f"Dkv={Dkv} must be in (0, {MAX_DKV}]")
    chk(0 < Dr <= MAX_DR, "dims", f"Dr={Dr} must be in (0, {MAX_DR}]")
    nb, SBS = skv.size(0), skv.size(1)
    chk(is_pow2(SBS) and MIN_SBS <= SBS <= MAX_SBS, "selection_layout",
        f"selection block size {SBS} must be a power of two in [{MIN_SBS}, {MAX_SBS}]")
    chk(K % SBS == 0, "selection_layout", f"K={K} must be a multiple of the selection block size {SBS}")
    chk(nb * SBS == B * S * K, "selection_layout",
        f"selection_kv_cache {tuple(skv.shape)} must hold exactly B*S*K = {B * S * K} rows")
    chk(tuple(srp.shape) == (nb, SBS, Dr) and tuple(skv.shape) == (nb, SBS, Dkv), "selection_layout",
        f"selection buffers {tuple(skv.shape)} / {tuple(srp.shape)} do not match Dkv={Dkv}, Dr={Dr}")
    chk(skv.dtype == fkv.dtype == frp.dtype == srp.dtype, "kv_dtype", "selection and full caches differ in dtype")
    chk(stb.dim() == 2 and stb.size(0) == B * S, "selection_layout",
        f"selection_kv_block_table {tuple(stb.shape)} must have B*S = {B * S} rows")
    st = _real(a["selection_kv_block_table"], real)
    if chk(st is not None, "selection_layout", "selection_kv_block_table is not a graph input"):
        smax = K // SBS if SBS else 0
        ok = is_identity_table(st, B * S, smax)
        chk(ok, "selection_layout", "selection_kv_block_table is not the identity layout")
    chk(sts.numel() == B * S * (K + 1), "selection_layout", f"selection_kv_block_status {tuple(sts.shape)} != [B, S, 1, K+1]")
    chk(L.dim() == 1 and L.size(0) == B and L.dtype == torch.int32, "lengths",
        f"full_kv_actual_seq {tuple(L.shape)} {L.dtype} must be int32 [B={B}]")
    for name in ("selection_kv_cache", "selection_k_rope", "selection_kv_block_status", "selection_kv_block_table"):
        chk(is_graph_input_or_attr(a[name]), "selection_not_input",
            f"{name} of {site.gather.name} is not a graph input (in-place serve needs the buffer itself)")
    geo = SiteGeometry(site.layer, a["full_kv_cache"], a["full_k_rope"], a["selection_kv_cache"],
                       a["selection_k_rope"], a["selection_kv_block_table"], a["selection_kv_block_status"],
                       maxblk * FBS, Dkv, Dr, fkv.dtype, a["full_kv_block_table"], FBS, not identity)
    return geo, (B, S, K, SBS)


def check_preconditions(gm: fx.GraphModule, groups: GroupReport, example_inputs: Sequence[Any],
                        opts: OffloadOptions) -> PreconditionReport:
    """The recipe form's precondition step: every site's arguments (shapes, layouts, block tables on the
    real example inputs), then each group's consistency and pool geometry."""
    real = input_values(gm, example_inputs)  # graph inputs, and module buffers Dynamo left as attributes
    out: list[GroupGeometry] = []
    refusals: list[Refusal] = []
    PS = opts.resolved_pool_size
    for g in groups.groups:
        geos: dict[int, SiteGeometry] = {}
        dims = set()
        for s in g.sites:
            chk = Checker(s.layer)
            r = _site(s, opts, real, chk)
            refusals.extend(chk.refusals)
            if r is not None:
                geos[s.layer] = r[0]
                dims.add(r[1])
        chk = Checker(g.owner.layer)
        if len(dims) > 1:
            chk(False, "group_inconsistent", f"group {g.group_id}: sites disagree on (B, S, K, BS): {sorted(dims)}")
        roots = {strip_views(s.args["full_kv_actual_seq"], casts=True) for s in g.sites}
        chk(len(roots) == 1, "group_inconsistent", f"group {g.group_id}: sites use different cache lengths")
        # Float8 indexer caches (Ascend 950) have no CPU reference to verify a rewrite against.
        ik = example(bind(g.producer).get(producer_of_call(g.producer).key_arg))
        chk(ik is None or ik.dtype not in FLOAT8_DTYPES, "float8_indexer_cache",
            f"group {g.group_id}: {g.producer.name} reads a {getattr(ik, 'dtype', None)} indexer key cache; "
            f"float8 indexer caches (Ascend 950) are not supported (int8 / float16 / bfloat16 are)")
        refusals.extend(chk.refusals)
        if len(geos) != len(g.sites) or len(dims) != 1:
            continue
        B, S, K, SBS = dims.pop()
        F = max(geo.F for geo in geos.values())
        chk = Checker(g.owner.layer)
        check_pool_size(chk, PS, SBS)
        refusals.extend(chk.refusals)
        out.append(group_geometry(g, B, S, K, SBS, F, g.owner.args["full_kv_actual_seq"], geos, opts))
    return PreconditionReport(out, refusals)

"""The recipe-form front-end: the graph of cann-recipes' GLM-5.2 modeling (and of models/glm).

**Detection**, from data flow: a top-k producer (``producers.TOPK_PRODUCERS``) → views →
``custom.npu_gather_selection_kv_cache`` → the sparse flash attention that reads the gather's result and
selection buffers; anything else touching the gather is a refusal. **Preconditions**: every site's shapes
and layouts, the selection table's identity layout on the example inputs, and the full block table's
(identity: serve reads ``[B, F, D]``; any other: through the table, the paged site). **Emission**::

    act = gather(sel, topk, full, table)       serve = dsa_serve(plan, full, pool, sel); status.copy_(ledger)
    out = sfa(q, sel, act)               ->    out = sfa(q, sel, plan.act)

A paged site keeps the gather after a pool-only serve. Everything else is the core's (``passes/rewrite.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch import fx

from ...custom_ops._library import is_pow2
from ...custom_ops.plan_kind import PlanKind
from ...options import OffloadOptions
from .. import _fx
from .._fx import (ancestors, bind, example, input_values, is_graph_input_or_attr, is_op, op_name, strip_views,
                   view_users)
from ..emit import LEDGER_SERVED, Builder, GroupNodes, RewriteCtx, SiteEmission, emit_serve, emit_serve_pool
from ..group import Group, GroupReport
from ..preconditions import (MAX_DKV, MAX_SBS, MIN_SBS, Checker, GroupGeometry, PreconditionReport,
                             SiteGeometry, check_pool_size, check_raw_seq, check_rope_width, check_topk_width, group_geometry)
from ..producers import PRODUCER_NAMES, producer_of_call, topk_source
from ..refusal import Refusal
from .protocol import PartialRefusal, Screening, Summary

__all__ = ["RecipeFrontEnd", "RECIPE", "Site", "DetectReport", "detect", "check_preconditions", "is_identity_table",
           "GATHER", "SFA"]

GATHER = "npu_gather_selection_kv_cache"
SFA = "npu_sparse_flash_attention"


@dataclass
class Site:
    layer: int
    gather: fx.Node
    sfa: fx.Node
    producer: fx.Node  # the top-k producer call (an indexer op of producers.TOPK_PRODUCERS)
    topk: fx.Node  # the tensor the gather received (e.g. topk.view(B, S, 1, K))
    args: dict[str, Any] = field(repr=False)  # bound gather arguments
    sfa_args: dict[str, Any] = field(repr=False)

    @property
    def anchor(self) -> fx.Node:
        """The gather: the serve replaces it, the group's plan goes before the owner's."""
        return self.gather


@dataclass
class DetectReport:
    sites: list[Site]
    gathers: int  # gather calls seen (sites + refused)
    indexers: list[str]  # names of top-k producer (indexer) nodes, any kind of producers.TOPK_PRODUCERS
    other_topk: list[str]  # other top-k producers (torch.topk ...), never DSA producers
    refusals: list[Refusal]

    @property
    def has_dsa(self) -> bool:
        return self.gathers > 0

    def summary(self) -> Summary:
        return Summary({"gathers": self.gathers, "sites": len(self.sites), "indexers": self.indexers,
                        "other_topk": self.other_topk}, None)

    def screening(self) -> Screening:
        return Screening(tuple(self.refusals))  # every detection refusal blocks; nothing is dense by design


def _same(a: Any, b: Any) -> bool:
    """``a`` (through views) is the tensor ``b``: the same node, or two reads of the same module attribute
    (FX and Dynamo without inlined nn modules emit one ``get_attr`` node per read)."""
    a, b = strip_views(a), strip_views(b)
    if a is b:
        return True
    return (isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.op == b.op == "get_attr"
            and a.target == b.target)


def _find_sfa(gather: fx.Node, b: dict[str, Any]) -> tuple[Optional[fx.Node], str]:
    sel_kv, sel_rope, sel_table = b["selection_kv_cache"], b["selection_k_rope"], b["selection_kv_block_table"]
    candidates = [u for u in view_users(gather) if is_op(u, SFA)]
    why = "no sparse-flash-attention consumes the gather's actual_seq"
    for u in candidates:
        s = bind(u)
        if strip_views(s["actual_seq_lengths_kv"]) is not gather:
            why = f"{u.name}: actual_seq_lengths_kv is not the gather's result"
            continue
        sr = example(sel_rope)
        no_rope = s["key_rope"] is None and sr is not None and sr.dim() == 1  # the gather's no-rope mode
        if not _same(s["key"], sel_kv) or (not no_rope and not _same(s["key_rope"], sel_rope)):
            why = f"{u.name}: key/key_rope are not the gather's selection buffers"
            continue
        if not _same(s["block_table"], sel_table):
            why = f"{u.name}: block_table is not the gather's selection block table"
            continue
        si = s["sparse_indices"]
        if not isinstance(si, fx.Node) or gather not in ancestors(si):
            why = f"{u.name}: sparse_indices are not derived from the gather's result"
            continue
        return u, ""
    if len(candidates) > 1:
        why = f"{len(candidates)} attention calls read the gather's result"
    return None, why


def detect(gm: fx.GraphModule) -> DetectReport:
    sites: list[Site] = []
    refusals: list[Refusal] = []
    gathers = 0
    indexers: list[str] = []
    other: list[str] = []
    # one walk over the graph; per site only its local neighbourhood is visited (linear in graph size)
    for n in gm.graph.nodes:
        if producer_of_call(n) is not None:
            indexers.append(n.name)
            continue
        if _fx.calls(n, "topk"):
            other.append(n.name)
            continue
        if not is_op(n, GATHER, ("custom",)):
            continue
        layer = gathers
        gathers += 1
        b = bind(n)
        topk = b["selection_topk_indices"]
        root = strip_views(topk)
        producer = topk_source(root)
        if producer is None:
            what = op_name(root) or getattr(root, "target", root)
            refusals.append(Refusal("unknown_topk_producer",
                                    f"{n.name}: top-k indices come from {what!s}, not a lightning indexer "
                                    f"({', '.join(sorted(PRODUCER_NAMES))})", layer))
            continue
        kv = example(b["full_kv_cache"])
        if kv is not None and kv.dtype not in (torch.float16, torch.bfloat16):
            # checked before the attention: a quantised cache is dequantised (or read by a quantised
            # attention op) on its way to attention, and that is not what makes the site unfit
            refusals.append(Refusal("quantised_kv", f"{n.name}: full_kv_cache dtype {kv.dtype}: only unquantised "
                                    f"float16/bfloat16 KV is offloaded (int8 KV keeps the gather path)", layer))
            continue
        sfa, why = _find_sfa(n, b)
        if sfa is None:
            refusals.append(Refusal("site_not_verified", f"{n.name}: {why}", layer))
            continue
        sites.append(Site(layer, n, sfa, producer, topk, b, bind(sfa)))
    return DetectReport(sites, gathers, indexers, other, refusals)


# -- preconditions ---------------------------------------------------------------------------------
#: The float8 dtypes of an indexer key cache (Ascend 950), refused by check_preconditions.
FLOAT8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


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


class _Examples(NamedTuple):
    """The example values of a site's tensors."""

    tk: torch.Tensor  # the top-k the gather reads
    fkv: torch.Tensor
    frp: torch.Tensor
    skv: torch.Tensor
    srp: torch.Tensor
    stb: torch.Tensor  # the selection block table
    sts: torch.Tensor  # the gather ledger (selection status)
    fbt: torch.Tensor  # the full block table
    L: torch.Tensor


def _site(site: Site, opts: OffloadOptions, real: dict, chk: Checker) -> Optional[tuple]:
    """One site's geometry and its group key ``(B, S, K, SBS)``, or None; every unmet limit goes to ``chk``."""
    a = site.args
    chk(a["selection_topk_block_size"] == 1, "gather_block_size",
        f"selection_topk_block_size={a['selection_topk_block_size']} (only 1, the K > 32 ledger path, is supported)")
    ex = _examples(site, chk)
    no_rope = _layout(ex, chk) if ex is not None else None
    if no_rope is None:
        return None
    B, S, K, maxblk = _batch(ex, opts, chk)
    FBS, Dkv, Dr, identity = _full_cache(site, ex, no_rope, (B, maxblk), real, opts, chk)
    SBS = _selection(site, ex, no_rope, (B, S, K, Dkv, Dr), real, chk)
    geo = SiteGeometry(site.layer, a["full_kv_cache"], a["full_k_rope"], a["selection_kv_cache"],
                       a["selection_k_rope"], a["selection_kv_block_table"], a["selection_kv_block_status"],
                       maxblk * FBS, Dkv, Dr, ex.fkv.dtype, a["full_kv_block_table"], FBS, not identity)
    return geo, (B, S, K, SBS)


def _examples(site: Site, chk: Checker) -> Optional[_Examples]:
    a = site.args
    ex = [example(site.topk)] + [example(a[n]) for n in (
        "full_kv_cache", "full_k_rope", "selection_kv_cache", "selection_k_rope", "selection_kv_block_table",
        "selection_kv_block_status", "full_kv_block_table", "full_kv_actual_seq")]
    if any(t is None for t in ex):
        chk(False, "no_example_values", f"{site.gather.name}: tensor shapes unknown")
        return None
    return _Examples(*ex)


def _layout(ex: _Examples, chk: Checker) -> Optional[bool]:
    """Whether the site is in the no-rope mode (1-D empty rope tensors, the ops' Dr = 0, docs/ops.md §3.3);
    None when the caches are not paged ``[blocks, block_size, D]`` (a quantised cache was refused by detect)."""
    srp, frp = ex.srp, ex.frp
    no_rope = srp.dim() == 1 and frp.dim() == 1 and srp.numel() == 0 and frp.numel() == 0
    if not chk(no_rope or (srp.dim() == 3 and frp.dim() == 3), "selection_layout",
               f"selection_k_rope {tuple(srp.shape)}, full_k_rope {tuple(frp.shape)}: the rope tensors must be "
               f"3-D, or both 1-D empty (the no-rope mode)"):
        return None
    if not chk(ex.fkv.dim() == 3 and ex.skv.dim() == 3 and ex.fbt.dim() == 2, "paged_layout",
               f"full_kv_cache {tuple(ex.fkv.shape)} must be [blocks, block_size, Dkv] with a 2-D block table"):
        return None
    return no_rope


def _batch(ex: _Examples, opts: OffloadOptions, chk: Checker) -> tuple[int, int, int, int]:
    """``(B, S, K, maxblk)``: the batch from the block table, the query tokens and width from the top-k."""
    tk = ex.tk
    K = tk.size(-1)
    check_topk_width(chk, K, bounded_by_producer=True)
    B, maxblk = ex.fbt.shape
    T = tk.numel() // max(K, 1)
    S = T // max(B, 1)
    chk(tk.dim() in (3, 4) and T == B * S and (tk.dim() == 3 or (tk.size(0) == B and tk.size(2) == 1)),
        "topk_layout", f"selection_topk_indices {tuple(tk.shape)} is not [B, S, 1, K] / [B*S, 1, K] with B={B}")
    check_raw_seq(chk, S, opts)
    return B, S, K, maxblk


def _full_cache(site: Site, ex: _Examples, no_rope: bool, batch: tuple[int, int], real: dict,
                opts: OffloadOptions, chk: Checker) -> tuple[int, int, int, bool]:
    """``(FBS, Dkv, Dr, identity)`` of the full caches. Any block table is served: the identity layout (the
    static batch) through serve's ``[B, F, D]`` view, any other (an engine's cache manager) through the
    model's gather, which takes the table (docs/new-requests.md, "Paged KV"); chosen on the example inputs."""
    B, maxblk = batch
    F_blocks, FBS, Dkv = ex.fkv.shape
    Dr = 0 if no_rope else ex.frp.size(-1)
    chk(no_rope or tuple(ex.frp.shape[:2]) == (F_blocks, FBS), "paged_layout",
        f"full_k_rope {tuple(ex.frp.shape)} must match full_kv_cache blocks {(F_blocks, FBS)}")
    t = _real(site.args["full_kv_block_table"], real)
    identity = (F_blocks == B * maxblk and t is not None and t.dtype == torch.int32
                and is_identity_table(t, B, maxblk))
    chk(ex.fbt.dtype == torch.int32, "paged_layout", f"full_kv_block_table dtype {ex.fbt.dtype} must be int32")
    if opts.pa_block_size is not None:
        chk(FBS == opts.pa_block_size, "pa_block_size", f"graph block size {FBS} != config pa_block_size {opts.pa_block_size}")
    chk(0 < Dkv <= MAX_DKV, "dims", f"Dkv={Dkv} must be in (0, {MAX_DKV}]")
    check_rope_width(chk, Dr, opts)
    return FBS, Dkv, Dr, identity


def _selection(site: Site, ex: _Examples, no_rope: bool, dims: tuple[int, ...], real: dict, chk: Checker) -> int:
    """The selection block size; the selection buffers, table (the identity layout: serve writes the
    selection positionally), ledger and lengths checked against the site's sizes."""
    B, S, K, Dkv, Dr = dims
    skv, srp, stb, fkv, frp = ex.skv, ex.srp, ex.stb, ex.fkv, ex.frp
    nb, SBS = skv.size(0), skv.size(1)
    chk(is_pow2(SBS) and MIN_SBS <= SBS <= MAX_SBS, "selection_layout",
        f"selection block size {SBS} must be a power of two in [{MIN_SBS}, {MAX_SBS}]")
    chk(K % SBS == 0, "selection_layout", f"K={K} must be a multiple of the selection block size {SBS}")
    chk(nb * SBS == B * S * K, "selection_layout",
        f"selection_kv_cache {tuple(skv.shape)} must hold exactly B*S*K = {B * S * K} rows")
    chk((no_rope or tuple(srp.shape) == (nb, SBS, Dr)) and tuple(skv.shape) == (nb, SBS, Dkv), "selection_layout",
        f"selection buffers {tuple(skv.shape)} / {tuple(srp.shape)} do not match Dkv={Dkv}, Dr={Dr}")
    chk(skv.dtype == fkv.dtype == frp.dtype == srp.dtype, "kv_dtype", "selection and full caches differ in dtype")
    chk(stb.dim() == 2 and stb.size(0) == B * S, "selection_layout",
        f"selection_kv_block_table {tuple(stb.shape)} must have B*S = {B * S} rows")
    a = site.args
    st = _real(a["selection_kv_block_table"], real)
    if chk(st is not None, "selection_layout", "selection_kv_block_table is not a graph input"):
        smax = K // SBS if SBS else 0
        chk(is_identity_table(st, B * S, smax), "selection_layout", "selection_kv_block_table is not the identity layout")
    chk(ex.sts.numel() == B * S * (K + 1), "selection_layout",
        f"selection_kv_block_status {tuple(ex.sts.shape)} != [B, S, 1, K+1]")
    L = ex.L
    chk(L.dim() == 1 and L.size(0) == B and L.dtype == torch.int32, "lengths",
        f"full_kv_actual_seq {tuple(L.shape)} {L.dtype} must be int32 [B={B}]")
    for name in ("selection_kv_cache", "selection_k_rope", "selection_kv_block_status", "selection_kv_block_table"):
        chk(is_graph_input_or_attr(a[name]), "selection_not_input",
            f"{name} of {site.gather.name} is not a graph input (in-place serve needs the buffer itself)")
    return SBS


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


aten = torch.ops.aten


class RecipeFrontEnd:
    """The recipe form (see the module doc); implements ``frontends/protocol.py::FrontEnd``."""

    name = "recipe"
    #: the rewrite *is* the offload: a failed precondition leaves the graph unmodified
    on_offload_refusal = PartialRefusal.NOTHING

    def detect(self, gm: fx.GraphModule) -> DetectReport:
        return detect(gm)

    def check_preconditions(self, gm: fx.GraphModule, grp: GroupReport, example_inputs: Sequence[Any],
                            opts: OffloadOptions) -> PreconditionReport:
        return check_preconditions(gm, grp, example_inputs, opts)

    def emit_site(self, ctx: RewriteCtx, grp: Group, gn: Optional[GroupNodes], s: Site) -> SiteEmission:
        """``dsa_serve`` (and the ledger write) replaces the gather; installs go after the SFA."""
        assert gn is not None, "the recipe form is only rewritten with offload"
        b = ctx.b
        geo = gn.p.geometry[s.layer]
        before = ([s.producer.name] if s is grp.owner else []) + [s.gather.name, s.sfa.name]
        if gn.p.paged:
            return self._emit_paged_site(ctx, gn, s, geo, before)
        with ctx.g.inserting_before(s.gather):
            serve = emit_serve(ctx, gn, s.layer, geo.full_kv, geo.full_rope)
            ledger = [_emit_ledger(b, geo, gn, gn.p.K) if ctx.settings.update_ledger else _emit_ledger_reset(b, geo)]
        gather_name = s.gather.name
        s.gather.replace_all_uses_with(gn.act)
        ctx.g.erase_node(s.gather)
        return SiteEmission(gather_name, s.sfa, serve, [serve, *ledger, s.sfa], before, s.sfa)

    def _emit_paged_site(self, ctx: RewriteCtx, gn: GroupNodes, s: Site, geo: SiteGeometry,
                         before: list[str]) -> SiteEmission:
        """A paged group (any block table): serve places the pool hits at their top-k positions (it reads
        no full cache: the plan it gets has no miss / window rows), the ledger says which positions now
        hold their id, and the model's own gather, kept, keeps those and reads every other row from the
        full cache through the block table (docs/ops.md §1.4: a kept id stays at its position, the rest
        fill the free positions in order, so position k holds ``topk[k]`` as serve would have placed it)."""
        b = ctx.b
        with ctx.g.inserting_before(s.gather):
            serve = emit_serve_pool(ctx, gn, s.layer)
            ledger = _emit_ledger_hits(b, geo, gn, gn.p.K)
        return SiteEmission(s.gather.name, s.sfa, serve, [serve, ledger, s.gather, s.sfa], before, s.sfa)

    def finish(self, ctx: RewriteCtx) -> dict[str, Any]:
        return {}


def _emit_ledger_reset(b: Builder, geo: Any) -> fx.Node:
    """Without the ledger update (``update_ledger=False``, the NPU modes' default) the ledger still must
    not claim rows serve overwrote: every id column -1 ("nothing reusable"), so a step through the
    unmodified module in between gathers every row afresh, and the count column ``emit.LEDGER_SERVED``
    (-2), not the -1 of a model's or an engine's reset, so the next step still reads an engine's reset as
    a new request (``rewrite.invalidate_new_rows``). One ``[B, S, 1, K+1]`` int32 write per layer."""
    ex = geo.status.meta["example_value"]
    K = int(ex.size(-1)) - 1
    ids = b(aten.full.default, [*ex.shape[:-1], K], -1, dtype=ex.dtype, device=ex.device)
    cnt = b(aten.full.default, [*ex.shape[:-1], 1], LEDGER_SERVED, dtype=ex.dtype, device=ex.device)
    return b(aten.copy_.default, geo.status, b(aten.cat.default, [ids, cnt], -1))


def _emit_ledger_hits(b: Builder, geo: Any, gn: GroupNodes, K: int) -> fx.Node:
    """Paged groups: the ledger before the kept gather: position k holds ``topk[k]`` where serve placed a
    pool hit, -1 elsewhere (so the gather keeps exactly the hits and reads the rest through the table)."""
    hit = b(aten.eq.Scalar, b(aten.view.default, gn.kinds, [gn.p.B * gn.p.S, K]), int(PlanKind.POOL_HIT))
    vals = b(aten.where.ScalarOther, hit, gn.tk2, -1)
    row = b(aten.cat.default, [vals, b(aten.unsqueeze.default, gn.act, 1)], 1)
    shape = list(geo.status.meta["example_value"].shape)
    return b(aten.copy_.default, geo.status, b(aten.view.default, row, shape))


def _emit_ledger(b: Builder, geo: Any, gn: GroupNodes, K: int) -> fx.Node:
    """Keep the model's gather ledger valid for what serve placed (position k <- topk[k], then the count)."""
    ar = b(aten.arange.default, K, dtype=torch.int32, device=gn.dev)
    lt = b(aten.lt.Tensor, b(aten.unsqueeze.default, ar, 0), b(aten.unsqueeze.default, gn.act, 1))
    vals = b(aten.where.ScalarOther, lt, gn.tk2, -1)
    row = b(aten.cat.default, [vals, b(aten.unsqueeze.default, gn.act, 1)], 1)
    shape = list(geo.status.meta["example_value"].shape)
    return b(aten.copy_.default, geo.status, b(aten.view.default, row, shape))


RECIPE = RecipeFrontEnd()

"""Pass 4 (Hugging Face form) — dense DSA → sparse attention, then (optionally) the shared-indexer offload.

For every site found by ``detect_hf`` the dense attention over all T cached positions is replaced by
one call that attends over the K selected positions only:

* **sparse** (always): gather the K selected latent rows ``[B, S, K, C]`` and rope rows ``[B, S, K, r]``
  from the caches, expand only those through ``kv_b_proj``, attend. The mask is the model's own base
  mask (causal limit, padding) gathered at the selected ids, and an id outside ``[0, T)`` (``-1``
  padding) is masked: the same terms the dense softmax keeps, so the result is the same attention
  (only the summation order differs). K is the graph's top-k width, i.e. already ``min(index_topk, T)``.
* **offload** (``enable_offload`` and ``shared_indexer_offload``, f16/bf16 caches, the op limits of
  spec/ops.md): the gather becomes the shared-indexer scheme exactly as for the recipe graph — one
  ``dsa_plan`` per group before the owner's attention, a ``dsa_serve`` per layer filling a per-layer
  selection buffer (state) from the pool / the full cache (the HF cache viewed ``[B, T, D]``), the
  attention reads the selection buffer, ``dsa_install`` ``metadata_update=0`` after every non-owner
  layer and the owner's ``metadata_update=1`` after the group's last layer. Pools and metadata are
  ``OffloadState`` buffers of the GraphModule. An offload precondition that fails leaves the sparse
  rewrite in place (it is exact) and is reported / logged; ``strict`` raises.

The dense nodes (scatter-mask, full expansion, dense attention) are then removed by a local dead-code
walk from each replaced attention: only pure nodes and writes into dead fresh allocations
(``key_states = new_empty(...)``) are erased; cache writes and other in-place ops always stay.
"""
from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import fx

from ..options import OffloadOptions
from .. import _compat
from ..state import OffloadState, build_state
from . import _fx
from .detect import Refusal
from .detect_hf import HfDetectReport, HfSite, detect_hf
from .group import GroupReport, group
from ..custom_ops._library import is_pow2
from .preconditions import GroupPlan, SiteGeometry
from .preconditions import MAX_DKV, MAX_DR, MAX_POOL, MAX_RAW_SEQ, MAX_TOPK, TOPK_ALIGN, WAYS  # the ops' specs
from .rewrite import OffloadRefused, _Builder, emit_plan_stats, state_attr

log = logging.getLogger("offload_passes.passes.rewrite_hf")
aten = torch.ops.aten
custom = torch.ops.custom

__all__ = ["hf_sparse_attention", "hf_sparse_attention_rows", "rewrite_hf", "HfRewriteReport"]

OFFLOAD_DTYPES = (torch.float16, torch.bfloat16)


# -- the sparse attention (traced into the graph by AOT / run directly in eager) ----------------------
def _attend(query: torch.Tensor, rows: torch.Tensor, rope_rows: torch.Tensor, weight: torch.Tensor,
            idx: torch.Tensor, base_mask: torch.Tensor, T: int, scaling: float, nope: int, vdim: int,
            kind: str, fill: float) -> torch.Tensor:
    B, H, S, D = query.shape
    K = idx.shape[-1]
    R = rope_rows.shape[-1]
    idx = idx.long()
    valid = (idx >= 0) & (idx < T)
    safe = idx.clamp(0, T - 1)
    msel = torch.gather(base_mask.expand(B, 1, S, T)[:, 0], 2, safe)  # the model's mask at the selected ids
    kv = F.linear(rows, weight).view(B, S, K, H, nope + vdim)
    k_nope, v = kv.split([nope, vdim], dim=-1)
    # one copy (the concatenated key, as the model builds it); heads-first are views, not copies
    k = torch.cat([k_nope, rope_rows.view(B, S, K, 1, R).expand(B, S, K, H, R)], dim=-1)
    k = k.view(B * S, K, H, D).transpose(1, 2)
    v = v.reshape(B * S, K, H, vdim).transpose(1, 2)
    q = query.transpose(1, 2).reshape(B * S, H, 1, D)
    if kind == "sdpa":
        allowed = (msel & valid).view(B * S, 1, 1, K)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=0.0, scale=scaling)
    else:
        add = torch.where(valid, msel, torch.full_like(msel, fill)).view(B * S, 1, 1, K)
        w = torch.matmul(q, k.transpose(2, 3)) * scaling + add
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(w, v)
    return out.view(B, S, H, vdim).transpose(1, 2)


def hf_sparse_attention(query: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, weight: torch.Tensor,
                        topk: torch.Tensor, base_mask: torch.Tensor, scaling: float, nope: int, vdim: int,
                        kind: str, fill: float) -> torch.Tensor:
    """Attention of ``query [B,H,S,n+r]`` over the ``topk [B,S,K]`` rows of the latent / rope caches
    ``[B,1,T,C]`` / ``[B,1,T,r]``, expanded through ``weight`` (kv_b_proj); returns ``[B,H,S,v]``."""
    B, _, T, C = latent.shape
    S, K = topk.shape[1], topk.shape[2]
    safe = topk.long().clamp(0, T - 1).reshape(B, S * K)
    bidx = torch.arange(B, device=topk.device).view(B, 1)
    rows = latent[:, 0][bidx, safe].view(B, S, K, C)  # row gather (indexing kernel: ~8x torch.gather here)
    rrows = rope[:, 0][bidx, safe].view(B, S, K, rope.shape[-1])
    return _attend(query, rows, rrows, weight, topk, base_mask, T, scaling, nope, vdim, kind, fill)


def hf_sparse_attention_rows(query: torch.Tensor, sel_kv: torch.Tensor, sel_rope: torch.Tensor,
                             weight: torch.Tensor, topk: torch.Tensor, base_mask: torch.Tensor, T: int,
                             scaling: float, nope: int, vdim: int, kind: str, fill: float) -> torch.Tensor:
    """As :func:`hf_sparse_attention`, reading the rows ``dsa_serve`` placed in the selection buffers
    (top-k column k of query row r at flat row ``r*K + k``)."""
    B, S, K = topk.shape
    rows = sel_kv.reshape(B, S, K, sel_kv.shape[-1])
    rrows = sel_rope.reshape(B, S, K, sel_rope.shape[-1])
    return _attend(query, rows, rrows, weight, topk, base_mask, T, scaling, nope, vdim, kind, fill)


# -- dead code removal, local to the replaced attentions ------------------------------------------------
_FRESH = {"new_empty", "new_zeros", "new_ones", "new_full", "empty", "zeros", "ones", "full", "empty_like",
          "zeros_like"}


def _name(n: fx.Node) -> str:
    if n.op == "call_method":
        return str(n.target)
    return getattr(n.target, "__name__", "") or ""


_OPERATOR_INPLACE = {operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
                     operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                     operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}


def _is_inplace(n: fx.Node) -> bool:
    if n.op == "call_function" and getattr(n.target, "__module__", None) == "_operator":
        return n.target in _OPERATOR_INPLACE  # operator.and_ / or_ are not in-place
    if isinstance(n.target, _compat.OpOverload):
        return n.target._schema.is_mutable
    nm = _name(n)
    return nm.endswith("_") and not nm.startswith("_")


def _write_only(u: fx.Node) -> bool:
    """A view / slice of a fresh allocation whose only users are unused in-place writes into it."""
    if not (_fx.is_view(u) or (u.op == "call_function" and u.target is operator.getitem)):
        return False
    return all(_is_inplace(w) and w.args and w.args[0] is u and not w.users for w in u.users)


def _dce(g: fx.Graph, seeds: Sequence[fx.Node]) -> int:
    erased = 0
    todo = list(seeds)
    dead: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in dead or n.op not in ("call_function", "call_method"):
            continue
        if n.users and _name(n) in _FRESH and all(_write_only(u) for u in n.users):
            for u in list(n.users):
                for w in list(u.users):
                    todo.extend(a for a in w.all_input_nodes if a is not u)
                    g.erase_node(w)
                    dead.add(w)
                    erased += 1
                g.erase_node(u)
                dead.add(u)
                erased += 1
        if n.users or n.is_impure() or _is_inplace(n):
            continue
        inputs = n.all_input_nodes
        g.erase_node(n)
        dead.add(n)
        erased += 1
        todo.extend(inputs)
    return erased


# -- reports ----------------------------------------------------------------------------------------
@dataclass
class HfSiteRewrite:
    layer: int
    group_id: int
    kind: str
    dense_attn: str
    sparse_node: str
    serve_node: Optional[str] = None
    install_nodes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"layer": self.layer, "group_id": self.group_id, "kind": self.kind, "gather_node": self.dense_attn,
                "sfa_node": self.sparse_node, "serve_node": self.serve_node, "install_nodes": list(self.install_nodes)}


@dataclass
class HfRewriteReport:
    sites: list[HfSiteRewrite]
    offload: bool
    buffers: dict[str, str]
    erased: int
    layer_nodes_before: dict[int, list[str]]
    layer_nodes_after: dict[int, list[str]]


# -- offload preconditions ----------------------------------------------------------------------------
def _cache_length(site: HfSite) -> Optional[fx.Node]:
    """The index the model writes this step's latent rows at (``index_copy_`` into the latent cache)."""
    for u in site.latent.users:
        if _name(u) in ("index_copy_", "index_copy") and u.args and u.args[0] is site.latent and len(u.args) >= 3:
            return u.args[2]
    return None


def _selection_block(K: int) -> int:
    sbs = 128
    while sbs > 16 and K % sbs:
        sbs //= 2
    return sbs


def offload_plan(gm: fx.GraphModule, grp: GroupReport, opts: OffloadOptions) -> tuple[list[GroupPlan], dict, list[Refusal]]:
    """GroupPlans (as the recipe graph's plan step) plus per group the cache-position node; refusals."""
    refusals: list[Refusal] = []
    plans: list[GroupPlan] = []
    positions: dict[int, fx.Node] = {}
    PS = opts.resolved_pool_size
    for g in grp.groups:
        def chk(cond: bool, reason: str, detail: str, layer: Optional[int] = None) -> bool:
            if not cond:
                refusals.append(Refusal(reason, detail, g.owner.layer if layer is None else layer))
            return cond

        d0 = g.owner.dims
        B, S, K = d0["B"], d0["S"], d0["K"]
        for s in g.sites:
            d = s.dims
            chk((d["B"], d["S"], d["K"]) == (B, S, K), "group_inconsistent",
                f"group {g.group_id}: layer {s.layer} has (B, S, K) {(d['B'], d['S'], d['K'])} != {(B, S, K)}", s.layer)
            chk(s.dtype in OFFLOAD_DTYPES, "kv_dtype",
                f"latent cache dtype {s.dtype}: the offload ops take float16/bfloat16 KV (sparse attention kept)", s.layer)
            chk(0 < d["C"] <= MAX_DKV and 0 < d["R"] <= MAX_DR, "dims",
                f"Dkv={d['C']} must be in (0, {MAX_DKV}], Dr={d['R']} in (0, {MAX_DR}]", s.layer)
            chk(_cache_length(s) is not None, "cache_layout",
                f"{s.latent.name}: no index_copy_ write into the latent cache (cache length unknown)", s.layer)
        chk(K % TOPK_ALIGN == 0 and 0 < K <= MAX_TOPK, "topk_alignment",
            f"top-k width K={K} must be a multiple of {TOPK_ALIGN} and <= {MAX_TOPK}")
        chk(1 <= S <= MAX_RAW_SEQ, "raw_seq", f"raw_seq S={S} must be in [1, {MAX_RAW_SEQ}]")
        if opts.next_n is not None:
            chk(S == opts.next_n + 1, "next_n", f"graph has raw_seq S={S}, config next_n={opts.next_n}")
        SBS = _selection_block(K)
        chk(PS % SBS == 0 and PS % WAYS == 0 and is_pow2(PS // WAYS) and PS <= MAX_POOL, "pool_size",
            f"pool_size={PS}: needs PS % {SBS} == 0, PS % {WAYS} == 0, PS/{WAYS} a power of two, PS <= {MAX_POOL}")
        if refusals:
            continue
        T = max(s.dims["T"] for s in g.sites)
        IR = opts.id_range if opts.id_range is not None else max(131072, T)
        geos = {s.layer: SiteGeometry(s.layer, s.latent, s.rope, None, None, None, None, s.dims["T"], s.dims["C"],
                                      s.dims["R"], s.dtype) for s in g.sites}
        plans.append(GroupPlan(g.group_id, g.owner.layer, g.last.layer, g.layers, B, S, K, SBS, PS, PS // 16, IR,
                               _cache_length(g.owner), g.owner.topk, g.producer.name, geos))
        positions[g.group_id] = _cache_length(g.owner)
    return plans, positions, refusals


# -- the rewrite --------------------------------------------------------------------------------------
@dataclass
class _HfCtx:
    """One HF rewrite's graph, builder and accumulating results."""

    gm: fx.GraphModule
    b: _Builder
    first: fx.Node
    buffers: dict[str, str] = field(default_factory=dict)
    after: dict[int, list[str]] = field(default_factory=dict)
    sites: list[HfSiteRewrite] = field(default_factory=list)
    seeds: list[fx.Node] = field(default_factory=list)  # replaced dense attentions (dead-code roots)

    def attr(self, name: str, t: torch.Tensor) -> fx.Node:
        return state_attr(self.gm, name, t, self.buffers, self.first, self.b.fake_mode)


@dataclass
class _HfGroup:
    """One offloaded group's state nodes and plan outputs."""

    p: GroupPlan
    meta: dict[str, fx.Node]
    table: fx.Node  # the identity selection block table
    sel: dict[int, tuple[fx.Node, fx.Node]]  # layer -> selection buffers (kv, rope)
    pools: dict[int, tuple[fx.Node, fx.Node]]  # layer -> pools (kv, rope)
    plan: Optional[fx.Node] = None
    plan_n: Optional[fx.Node] = None
    rec: Optional[fx.Node] = None


def rewrite_sparse(gm: fx.GraphModule, grp: GroupReport, plans: Optional[list[GroupPlan]] = None,
                   state: Optional[OffloadState] = None) -> HfRewriteReport:
    """Replace every site's dense attention; with ``plans`` + ``state`` through plan/serve/install."""
    g = gm.graph
    _fx.hoist_attrs(g)  # caches as get_attr (torch 2.8, no nn-module inlining) become usable at every site
    ctx = _HfCtx(gm, _Builder(g, [s.query for gr in grp.groups for s in gr.sites][:1]),
                 next(n for n in g.nodes if n.op != "placeholder"))
    offload = plans is not None and state is not None
    before = {s.layer: [s.scatter.name, s.combine.name, s.attn.name] for gr in grp.groups for s in gr.sites}
    pplans = {p.group_id: p for p in plans or []}
    gstates = {gs.group_id: gs for gs in state.groups} if offload else {}
    for gr in grp.groups:
        hg = _hf_group(ctx, gr, pplans[gr.group_id], gstates[gr.group_id], state) if offload else None
        done = {s.layer: _hf_site(ctx, gr, s, hg) for s in gr.sites}
        recs = {layer: rw for layer, (rw, _) in done.items()}
        if hg is not None:
            for s in gr.sites:
                _hf_installs(ctx, gr, s, hg, recs, done[s.layer][1])
    erased = _dce(g, ctx.seeds)
    g.lint()
    gm.recompile()
    ctx.sites.sort(key=lambda r: r.layer)
    return HfRewriteReport(ctx.sites, offload, ctx.buffers, erased, before, ctx.after)


def _hf_group(ctx: _HfCtx, gr: Any, p: GroupPlan, gs: Any, state: OffloadState) -> _HfGroup:
    """The group's metadata, selection buffers and pools as attributes; its plan before the owner."""
    B, S, K, SBS = p.B, p.S, p.K, p.BS
    dev = gs.stats.device
    meta = {n: ctx.attr(f"{n}_g{gr.group_id}", t) for n, t in
            (("pool_ids", gs.pool_ids), ("id_to_slot", gs.id_to_slot), ("lru_counter", gs.lru_counter),
             ("stats", gs.stats))}
    table = ctx.attr(f"sel_table_g{gr.group_id}",
                     torch.arange(B * S * K // SBS, dtype=torch.int32, device=dev).view(B * S, K // SBS))
    hg = _HfGroup(p, meta, table, {}, {})
    nb = B * S * K // SBS
    for s in gr.sites:
        geo = p.geometry[s.layer]
        hg.sel[s.layer] = (ctx.attr(f"sel_kv_l{s.layer}", torch.zeros(nb, SBS, geo.Dkv, dtype=geo.dtype, device=dev)),
                           ctx.attr(f"sel_rope_l{s.layer}", torch.zeros(nb, SBS, geo.Dr, dtype=geo.dtype, device=dev)))
        kv, rope = state.pools[s.layer]
        hg.pools[s.layer] = (ctx.attr(f"pool_kv_l{s.layer}", kv), ctx.attr(f"pool_rope_l{s.layer}", rope))
    b = ctx.b
    with ctx.gm.graph.inserting_before(gr.owner.attn):
        pos = p.lengths  # this step's cache positions [S]; L = last position + 1, one per batch row
        L = b(aten.add.Tensor, b(aten.amax.default, pos, [0]), 1)
        L = b(aten.repeat.default, b(aten.view.default, b(aten._to_copy.default, L, dtype=torch.int32), [1]), [B])
        tk = p.topk
        if _fx.example(tk) is None or _fx.example(tk).dtype != torch.int32:
            tk = b(aten._to_copy.default, tk, dtype=torch.int32)
        tk = b(aten.view.default, tk, [B, S, 1, K])
        hg.plan = b(custom.dsa_plan.default, tk, L, meta["pool_ids"], meta["id_to_slot"], meta["lru_counter"],
                    raw_seq=S, group_id=gr.group_id, owner_layer=gr.owner.layer)
        hg.plan_n, hg.rec = b.item(hg.plan, 0), b.item(hg.plan, 1)
        emit_plan_stats(b, hg.plan_n, meta["stats"], dev)
    return hg


def _hf_site(ctx: _HfCtx, gr: Any, s: HfSite, hg: Optional[_HfGroup]) -> tuple[HfSiteRewrite, fx.Node]:
    """Layer ``s``: the sparse attention (reading what ``dsa_serve`` placed when offloaded) replaces the
    dense one."""
    b, d = ctx.b, s.dims
    fill = float(s.combine.args[2]) if s.kind == "eager" else 0.0
    serve = None
    with ctx.gm.graph.inserting_before(s.attn):
        if hg is not None:
            p = hg.p
            geo = p.geometry[s.layer]
            fkv = b(aten.view.default, s.latent, [p.B, geo.F, geo.Dkv])
            frp = b(aten.view.default, s.rope, [p.B, geo.F, geo.Dr])
            skv, srp = hg.sel[s.layer]
            serve = b(custom.dsa_serve.default, hg.plan_n, fkv, frp, hg.pools[s.layer][0], hg.pools[s.layer][1],
                      skv, srp, raw_seq=p.S, topk=p.K, selection_block_size=p.BS, compact_layout=1)
            new_attn = b(hf_sparse_attention_rows, s.query, skv, srp, s.weight, s.topk, s.base_mask, d["T"],
                         s.scaling, d["n"], d["v"], s.kind, fill)
        else:
            new_attn = b(hf_sparse_attention, s.query, s.latent, s.rope, s.weight, s.topk, s.base_mask, s.scaling,
                         d["n"], d["v"], s.kind, fill)
    if "example_value" in s.attn.meta:  # Dynamo's key, as on the node it replaces
        new_attn.meta["example_value"] = s.attn.meta["example_value"]
    dense_name = s.attn.name
    s.attn.replace_all_uses_with(new_attn)
    ctx.seeds.append(s.attn)
    rw = HfSiteRewrite(s.layer, gr.group_id, s.kind, dense_name, new_attn.name,
                       serve.name if serve is not None else None)
    ctx.sites.append(rw)
    ctx.after[s.layer] = ([hg.plan.name] if hg is not None and s is gr.owner else []) + \
        ([serve.name] if serve is not None else []) + [new_attn.name]
    return rw, new_attn


def _hf_installs(ctx: _HfCtx, gr: Any, s: HfSite, hg: _HfGroup, recs: dict[int, HfSiteRewrite],
                 cursor: fx.Node) -> None:
    """After layer ``s``'s sparse attention: its ``metadata_update=0`` install (not the owner), and on the
    group's last layer the owner's ``metadata_update=1`` install."""
    p = hg.p
    placed = []
    todo = ([(s.layer, 0)] if s is not gr.owner else []) + ([(gr.owner.layer, 1)] if s is gr.last else [])
    for layer, md in todo:
        skv, srp = hg.sel[layer]
        kv, rp = hg.pools[layer]
        with ctx.gm.graph.inserting_after(cursor):
            cursor = ctx.b(custom.dsa_install.default, hg.rec, skv, srp, hg.table, kv, rp, hg.meta["pool_ids"],
                           hg.meta["id_to_slot"], hg.meta["lru_counter"], raw_seq=p.S, topk=p.K,
                           selection_block_size=p.BS, metadata_update=md)
        placed.append(cursor)
        recs[layer].install_nodes.append(cursor.name)
    ctx.after[s.layer] += [n.name for n in placed]


def dense_masks_left(graph: fx.Graph) -> int:
    """Boolean scatter-masks still in ``graph`` (0 after a complete rewrite)."""
    n_left = 0
    for n in graph.nodes:
        if _name(n) == "scatter" and n.args:
            ex = _fx.example(n.args[0])
            if ex is not None and ex.dtype == torch.bool:
                n_left += 1
    return n_left


# -- pipeline entry (called by the backend when the graph has no recipe-form DSA site) ----------------
def rewrite_hf(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: OffloadOptions, graph_id: str,
               timings: dict, ops_before: dict, shared_state: bool = False,
               ) -> Optional[tuple[fx.GraphModule, Optional[OffloadState], dict]]:
    """Detect / group / (plan) / rewrite the HF form. None when the graph holds no HF DSA pattern;
    otherwise ``(gm, state, report)`` like ``backend.rewrite_for_offload``."""
    t0 = time.perf_counter()
    det: HfDetectReport = detect_hf(gm)
    timings["detect_s"] = timings.get("detect_s", 0.0) + time.perf_counter() - t0
    if not det.has_dsa:
        return None
    t1 = time.perf_counter()
    grp = group(det)  # same grouping as the recipe graph: by the shared top-k node
    timings["group_s"] = time.perf_counter() - t1
    report = _hf_report(graph_id, opts, det, ops_before, timings)
    timings["rewrite_s"] = 0.0
    if _left_as_is(det, opts, graph_id, report):
        return gm, None, report
    t1 = time.perf_counter()
    plans, state, off_ref = None, None, []
    if opts.enable_offload and opts.shared_indexer_offload:
        plans, off_ref = _offload_plans(gm, grp, opts, graph_id)
    timings["plan_s"] = time.perf_counter() - t1
    if plans:
        t1 = time.perf_counter()
        state = build_state(gm, plans, example_inputs, graph_id, shared_state)
        timings["alloc_s"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    rr = rewrite_sparse(gm, grp, plans, state)
    timings["rewrite_s"] = time.perf_counter() - t1
    _record(report, gm, grp, plans, state, rr, off_ref)
    return gm, state, report


def _hf_report(graph_id: str, opts: OffloadOptions, det: HfDetectReport, ops_before: dict, timings: dict) -> dict:
    """The GraphReport of an HF graph before (or without) its rewrite."""
    return {
        "graph_id": graph_id, "rewritten": False, "mode": opts.exe_mode, "options": opts.to_dict(),
        "groups": [], "sites": [], "layer_nodes": {"before": {}, "after": {}},
        "ops": {"before": ops_before, "after": ops_before}, "state": [],
        "refusals": [r.to_dict() for r in det.refusals], "timings": timings,
        "passes": [{"name": "detect", "file": "passes/detect_hf.py"}, {"name": "group", "file": "passes/group.py"},
                   {"name": "rewrite", "file": "passes/rewrite_hf.py"}],
        "detect": {"gathers": det.candidates, "sites": len(det.sites), "indexers": det.topk_nodes, "other_topk": []},
        "hf": {"form": "transformers", "sites": [s.to_dict() for s in det.sites], "offload": False,
               "offload_refusals": []},
    }


def _left_as_is(det: HfDetectReport, opts: OffloadOptions, graph_id: str, report: dict) -> bool:
    """True (reported, logged; ``OffloadRefused`` under strict) when a site is not verified or the dense
    attention is cheaper."""
    if det.refusals:
        msg = (f"{graph_id}: HF DSA rewrite not applied (hf_site_not_verified): "
               + "; ".join(r.detail for r in det.refusals[:4]) + (" ..." if len(det.refusals) > 4 else ""))
        if opts.strict:
            raise OffloadRefused(msg)
        log.warning("%s; compiling the graph unmodified", msg)
        return True
    dense = [s for s in det.sites if s.dims["S"] * s.dims["K"] >= s.dims["T"]]
    if dense:
        # e.g. a prefill graph (S = prompt length): S*K selected rows cost more than the T dense ones
        d = dense[0].dims
        r = Refusal("dense_cheaper", f"S*K = {d['S']}*{d['K']} >= T = {d['T']} cached positions: the dense "
                    "attention reads fewer rows; graph left as it is", dense[0].layer)
        report["refusals"].append(r.to_dict())
        log.info("%s: %s", graph_id, r.detail)
        return True
    return False


def _offload_plans(gm: fx.GraphModule, grp: GroupReport, opts: OffloadOptions, graph_id: str
                   ) -> tuple[Optional[list[GroupPlan]], list[Refusal]]:
    """The offload's group plans, or None with the refusals (the sparse rewrite stays: it is exact)."""
    plans, _, off_ref = offload_plan(gm, grp, opts)
    if not off_ref:
        return plans, off_ref
    msg = (f"{graph_id}: shared-indexer offload not applied to the HF graph "
           f"({', '.join(sorted({r.reason for r in off_ref}))}): " + "; ".join(r.detail for r in off_ref[:3]))
    if opts.strict:
        raise OffloadRefused(msg)
    log.warning("%s; sparse attention only", msg)
    return None, off_ref


def _record(report: dict, gm: fx.GraphModule, grp: GroupReport, plans: Optional[list[GroupPlan]],
            state: Optional[OffloadState], rr: HfRewriteReport, off_ref: list[Refusal]) -> None:
    report.update({
        "rewritten": True,
        "groups": [p.to_dict() for p in plans] if plans else
        [{"group_id": g.group_id, "owner_layer": g.owner.layer, "layers": g.layers, "topk_node": g.producer.name,
          "K": g.owner.dims["K"], "S": g.owner.dims["S"], "B": g.owner.dims["B"]} for g in grp.groups],
        "sites": [s.to_dict() for s in rr.sites],
        "layer_nodes": {"before": rr.layer_nodes_before, "after": rr.layer_nodes_after},
        "ops": {"before": report["ops"]["before"], "after": _fx.count_ops(gm.graph)},
        "state": state.describe() if state is not None else [],
        "state_bytes": state.total_bytes if state is not None else 0,
        "buffers": rr.buffers,
    })
    report["hf"].update({"offload": rr.offload, "offload_refusals": [r.to_dict() for r in off_ref],
                         "erased_nodes": rr.erased, "dense_masks_left": dense_masks_left(gm.graph)})
    log.info("%s: HF DSA: %d layers in %d groups %s -> sparse attention%s", report["graph_id"], len(rr.sites),
             len(grp.groups), [g.layers for g in grp.groups], " + shared-indexer offload" if rr.offload else "")

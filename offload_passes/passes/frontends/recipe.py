"""The recipe-form front-end: the graph of cann-recipes' GLM-5.2 modeling (and of models/glm).

**Detection** (pass 1), from data flow: top-k producer → (views) → gather → SFA. A site is one
``custom.npu_gather_selection_kv_cache`` call whose ``selection_topk_indices`` comes (through views only)
from the ids of a top-k producer of ``producers.TOPK_PRODUCERS`` (output 0 of ``npu_lightning_indexer``,
the single output of ``npu_quant_lightning_indexer``; any namespace), and whose result and selection
buffers feed one sparse-flash-attention call (``actual_seq_lengths_kv`` = the gather's result, ``key`` /
``key_rope`` / ``block_table`` = the gather's selection buffers). Anything else touching the gather is a
refusal. Layers are numbered by the order of sites in the graph; module names are never read.

**Preconditions**: ``passes/preconditions.py::check_preconditions`` (shapes, layouts, block tables).

**Emission** at a site, identity block table: the gather becomes ``dsa_serve`` into the model's own
selection buffers (the SFA already reads them), the model's gather ledger is written for what serve placed
(so switching back to the unmodified path is never wrong), and every use of the gather's result is replaced
by the plan's active count. Any other block table (paged KV): serve places only the pool hits and the
gather stays, reading the rest through the table. Everything else is the shared core
(``passes/rewrite.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import fx

from .. import _fx
from .._fx import ancestors, bind, example, is_op, op_name, strip_views, view_users
from ..group import GroupReport
from ..preconditions import GroupGeometry, PreconditionReport, check_preconditions
from ..producers import PRODUCER_NAMES, producer_of_call, topk_source
from ..refusal import Refusal
from ..rewrite import (LEDGER_SERVED, Builder, GroupNodes, RewriteCtx, SiteRewrite, emit_serve, emit_serve_pool, guard,
                       input_name)
from . import PartialRefusal, PassFiles

__all__ = ["RecipeFrontEnd", "RECIPE", "Site", "DetectReport", "detect", "GATHER", "SFA"]

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


def _is_topk_other(n: fx.Node) -> bool:
    if n.op == "call_method" and n.target == "topk":
        return True
    if n.op == "call_function" and getattr(n.target, "__name__", "") == "topk":
        return True
    name = op_name(n)
    return name is not None and name.endswith("::topk")


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
        if _is_topk_other(n):
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


aten = torch.ops.aten


class RecipeFrontEnd:
    """The recipe form (see the module doc); implements ``frontends.FrontEnd``."""

    name = "recipe"
    files = PassFiles(detect="passes/frontends/recipe.py", preconditions="passes/preconditions.py",
                      emit="passes/frontends/recipe.py")
    #: the rewrite *is* the offload: a failed precondition leaves the graph unmodified
    on_offload_refusal = PartialRefusal.NOTHING

    def detect(self, gm: fx.GraphModule) -> DetectReport:
        return detect(gm)

    def detect_summary(self, det: DetectReport) -> dict:
        return {"gathers": det.gathers, "sites": len(det.sites), "indexers": det.indexers,
                "other_topk": det.other_topk}

    def report_extras(self, det: DetectReport) -> None:
        return None

    def screen(self, det: DetectReport) -> tuple[list[Refusal], list[Refusal]]:
        return list(det.refusals), []  # every detection refusal blocks; nothing is dense by design

    def dense_by_design(self, gm: fx.GraphModule, det: DetectReport, blocking: Sequence[Refusal]) -> None:
        return None

    def sparse_by_design(self, det: DetectReport, offload_refusals: Sequence[Refusal]) -> None:
        return None

    def check_preconditions(self, gm: fx.GraphModule, grp: GroupReport, example_inputs: Sequence[Any],
                            opts: Any) -> PreconditionReport:
        return check_preconditions(gm, grp, example_inputs, opts)

    def plan_anchor(self, grp: Any) -> fx.Node:
        return grp.owner.gather

    def lengths(self, b: Builder, p: GroupGeometry) -> fx.Node:
        return p.lengths  # full_kv_actual_seq: int32 [B] (checked by check_preconditions)

    def topk(self, b: Builder, p: GroupGeometry) -> fx.Node:
        return b(aten.view.default, p.topk, [p.B, p.S, 1, p.K])

    def selection(self, ctx: RewriteCtx, grp: Any, p: GroupGeometry) -> dict:
        return {l: (geo.sel_kv, geo.sel_rope, geo.sel_table) for l, geo in p.geometry.items()}

    def ledger(self, p: GroupGeometry, layer: int) -> Optional[fx.Node]:
        return p.geometry[layer].status

    def layer_nodes_before(self, grp: GroupReport) -> dict[int, list[str]]:
        return {s.layer: [s.producer.name, s.gather.name, s.sfa.name] if s is g.owner else [s.gather.name, s.sfa.name]
                for g in grp.groups for s in g.sites}

    def emit_site(self, ctx: RewriteCtx, grp: Any, gn: Optional[GroupNodes], s: Any) -> fx.Node:
        """``dsa_serve`` (and the ledger write) replaces the gather; installs go after the SFA."""
        assert gn is not None, "the recipe form is only rewritten with offload"
        b = ctx.b
        geo = gn.p.geometry[s.layer]
        if gn.p.paged:
            return self._emit_paged_site(ctx, grp, gn, s, geo)
        with ctx.g.inserting_before(s.gather):
            serve = emit_serve(ctx, gn, s.layer, geo.full_kv, geo.full_rope)
            ledger = [_emit_ledger(b, geo, gn, gn.p.K) if ctx.update_ledger else _emit_ledger_reset(b, geo)]
        gather_name = s.gather.name
        s.gather.replace_all_uses_with(gn.act)
        ctx.g.erase_node(s.gather)
        sr = SiteRewrite(s.layer, grp.group_id, gather_name, s.sfa.name, serve.name)
        gn.by_layer[s.layer] = sr
        ctx.after[s.layer] = (([gn.plan.name] if s is grp.owner else []) + [serve.name]
                              + [n.name for n in ledger] + [s.sfa.name])
        ctx.sites.append(sr)
        return s.sfa

    def _emit_paged_site(self, ctx: RewriteCtx, grp: Any, gn: GroupNodes, s: Any, geo: Any) -> fx.Node:
        """A paged group (any block table): serve places the pool hits at their top-k positions (it reads
        no full cache: the plan it gets has no miss / window rows), the ledger says which positions now
        hold their id, and the model's own gather, kept, keeps those and reads every other row from the
        full cache through the block table (docs/ops.md §1.4: a kept id stays at its position, the rest
        fill the free positions in order, so position k holds ``topk[k]`` as serve would have placed it)."""
        b = ctx.b
        with ctx.g.inserting_before(s.gather):
            serve = emit_serve_pool(ctx, gn, s.layer)
            ledger = _emit_ledger_hits(b, geo, gn, gn.p.K)
        sr = SiteRewrite(s.layer, grp.group_id, s.gather.name, s.sfa.name, serve.name)
        gn.by_layer[s.layer] = sr
        ctx.after[s.layer] = (([gn.plan.name] if s is grp.owner else []) + [serve.name, ledger.name,
                                                                            s.gather.name, s.sfa.name])
        ctx.sites.append(sr)
        return s.sfa

    def add_guards(self, ctx: RewriteCtx, groups: GroupReport, plans: dict) -> None:
        """The identity selection block table, and the identity full block table of a group compiled on it
        (a paged group reads through any table), as check_preconditions verified them on the example inputs.
        Shapes and dtypes are static in the graph, so Dynamo's own guards recompile on any change."""
        b = ctx.b
        for grp in groups.groups:
            p = plans.get(grp.group_id)
            if p is None:
                continue
            smax = p.K // p.BS
            for s in grp.sites:
                bt = s.args["full_kv_block_table"]
                ex = _fx.example(bt)
                # a paged group reads through whatever table it gets: nothing to guard
                if not p.paged and ex is not None and ex.dim() == 2 and strip_views(bt) not in ctx.guarded:
                    ctx.guarded.add(strip_views(bt))
                    rows, cols = int(ex.size(0)), int(ex.size(1))
                    guard(ctx, bt, lambda bt=bt, rows=rows, cols=cols, ex=ex: b(
                        aten.all.default, b(aten.eq.Tensor, bt, b(aten.view.default, b(
                            aten.arange.default, rows * cols, dtype=ex.dtype, device=ex.device), [rows, cols]))),
                        f"offload guard: block table {input_name(bt)!r} is no longer the identity layout "
                        f"arange({rows}*{cols}).view({rows}, {cols}) this graph was rewritten for (it reads the "
                        f"full cache as [B, F, D]); a graph compiled on any other table reads through the table "
                        f"and serves every layout (recompile after torch._dynamo.reset() with the engine's "
                        f"table, docs/new-requests.md)")
                st = s.args["selection_kv_block_table"]
                ex = _fx.example(st)
                if ex is not None and ex.dim() == 2 and strip_views(st) not in ctx.guarded:
                    ctx.guarded.add(strip_views(st))
                    rows = int(ex.size(0))
                    guard(ctx, st, lambda st=st, rows=rows, ex=ex: b(
                        aten.all.default, b(aten.eq.Tensor, b(aten.slice.Tensor, st, 1, 0, smax), b(
                            aten.view.default, b(aten.arange.default, rows * smax, dtype=ex.dtype, device=ex.device),
                            [rows, smax]))),
                        f"offload guard: selection block table {input_name(st)!r} is no longer the identity layout "
                        f"arange({rows}*{smax}).view({rows}, {smax}) this graph was rewritten for")

    def finish(self, ctx: RewriteCtx) -> dict:
        return {}


def _emit_ledger_reset(b: Builder, geo: Any) -> fx.Node:
    """Without the ledger update (``update_ledger=False``, the NPU modes' default) the ledger still must
    not claim rows serve overwrote: every id column -1 ("nothing reusable"), so a step through the
    unmodified module in between gathers every row afresh, and the count column ``rewrite.LEDGER_SERVED``
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
    hit = b(aten.eq.Scalar, b(aten.view.default, gn.kinds, [gn.p.B * gn.p.S, K]), 1)
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

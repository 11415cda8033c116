"""The rewrite core: each group's top-k becomes plan / serve / install, pre-AOT, for every front-end.

A front-end emits each site's serve and attention (``FrontEnd.emit_site``); everything else is here: the
guards, the new-request invalidation, ``dsa_plan`` and its statistics, the selection buffers, the installs
and the site bookkeeping. Per group g (owner O, last layer Z), before / after::

    topk = indexer(...)                     topk = indexer(...)
    act_O = gather(sel_O, topk, full_O)     <invalidate new rows of g>; plan = dsa_plan(topk, L, meta_g)
    out_O = sfa(q, sel_O, act_O)            serve_O = dsa_serve(plan, full_O, pool_O, sel_O)   # front-end
    act_l = gather(sel_l, topk, full_l)     out_O = sfa(q, sel_O, plan.act)
    out_l = sfa(q, sel_l, act_l)            serve_l = ...; out_l = sfa(q, sel_l, plan.act)
                                            dsa_install(plan.rec, sel_l, pool_l, meta_g, metadata_update=0)
                                            dsa_install(plan.rec, sel_O, pool_O, meta_g, metadata_update=1)  # after Z

A layer sharing an earlier layer's full caches shares its pool and installs nothing. Installs stay in
program order after their layer's attention; a lowering that moves them gets each layer's installs through
``RewriteSettings.install_hook``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import fx

from ..custom_ops.plan_kind import NUM_PLAN_KINDS, PlanKind
from ..modes import check_replacement_policy
from ..state import GroupState, OffloadState
from . import _fx
from ._fx import hoist_attrs
from .emit import (Builder, GroupNodes, RewriteCtx, RewriteSettings, SelectionBuffers, SiteEmission, SiteRewrite)
from .frontends.protocol import FrontEnd
from .group import Group, GroupedSite, GroupReport
from .guards import lengths_guard, table_guards
from .preconditions import GroupGeometry

__all__ = ["rewrite", "RewriteReport", "RewriteSettings", "invalidate_new_rows", "emit_plan_stats",
           "selection_buffers", "step_lengths"]

aten = torch.ops.aten
custom = torch.ops.custom


@dataclass
class RewriteReport:
    sites: list[SiteRewrite]
    buffers: dict[str, str]  # state tensor name -> attribute name on the GraphModule
    layer_nodes_before: dict[int, list[str]]
    layer_nodes_after: dict[int, list[str]]
    guards: list[str] = field(default_factory=list)  # names of the in-graph run-time checks
    offload: bool = True  # False: the front-end's rewrite without plan / serve / install (HF sparse only)
    extra: dict = field(default_factory=dict)  # front-end specific facts (HF: erased nodes, masks left)


@dataclass
class _Filed:
    """The site bookkeeping of one rewrite, kept by the core alone (front-ends return a ``SiteEmission``)."""

    rows: dict[int, SiteRewrite] = field(default_factory=dict)  # layer -> its report row
    before: dict[int, list[str]] = field(default_factory=dict)
    after: dict[int, list[str]] = field(default_factory=dict)

    def site(self, grp: Group, gn: Optional[GroupNodes], s: GroupedSite, e: SiteEmission) -> fx.Node:
        """File what the front-end emitted at site ``s``; returns the node its installs go after."""
        self.rows[s.layer] = SiteRewrite(s.layer, grp.group_id, e.replaced, e.attention.name,
                                         e.serve.name if e.serve is not None else None, kind=e.kind)
        self.before[s.layer] = list(e.before)
        plan = [gn.plan.name] if gn is not None and s is grp.owner else []
        self.after[s.layer] = plan + [n.name for n in e.nodes]
        return e.install_after

    def installs(self, layer: int, placed: list[fx.Node], owners: list[int]) -> None:
        """Installs placed after ``layer``'s attention; ``owners[i]``: the layer ``placed[i]`` refills."""
        for node, owner in zip(placed, owners):
            self.rows[owner].install_nodes.append(node.name)
        self.after[layer] += [n.name for n in placed]


def emit_plan_stats(b: Callable[..., fx.Node], plan_n: fx.Node, stats: fx.Node, dev: Any) -> None:
    """In-graph counters after a plan: ``stats[0]`` = this step's one-hot count of the plan kinds
    (``custom_ops/plan_kind.py``) plus the step, ``stats[1]`` = the running total. ``b(target, *args,
    **kwargs)`` emits one node."""
    kinds = b(aten.select.int, plan_n, 1, 0)
    eq = b(aten.eq.Tensor, b(aten.unsqueeze.default, kinds, 1),
           b(aten.arange.default, NUM_PLAN_KINDS, dtype=torch.int32, device=dev))
    cnt = b(aten.sum.dim_IntList, eq, [0])
    new = b(aten.cat.default, [cnt, b(aten.ones.default, [1], dtype=torch.int64, device=dev)])
    cum = b(aten.add.Tensor, b(aten.select.int, stats, 0, 1), new)
    b(aten.copy_.default, stats, b(aten.stack.default, [new, cum]))


def rewrite(gm: fx.GraphModule, fe: FrontEnd, groups: GroupReport, plans: Sequence[GroupGeometry],
            state: Optional[OffloadState], settings: RewriteSettings = RewriteSettings()) -> RewriteReport:
    """Rewrite every group of ``groups`` through the front-end ``fe``; ``plans`` / ``state`` empty / None:
    the front-end's rewrite without the offload (HF: sparse attention only)."""
    check_replacement_policy(settings.replacement_policy)
    g = gm.graph
    hoist_attrs(g)  # module buffers as get_attr (no nn-module inlining) become usable anywhere
    first = next(n for n in g.nodes if n.op not in ("placeholder", "get_attr"))
    pl = {p.group_id: p for p in plans}
    hints = [p.topk for p in plans] or [s.topk for gr in groups.groups for s in gr.sites][:1]
    ctx = RewriteCtx(gm, Builder(g, hints), first, state, settings)
    offload = bool(pl) and state is not None
    if settings.in_graph_guards and offload:
        table_guards(ctx, groups, pl)
    gstates = {gs.group_id: gs for gs in state.groups} if offload else {}
    filed = _Filed()
    for grp in groups.groups:
        p = pl.get(grp.group_id) if offload else None
        if p is None:
            for s in grp.sites:
                filed.site(grp, None, s, fe.emit_site(ctx, grp, None, s))
            continue
        gn = _group_nodes(ctx, grp, p, gstates[grp.group_id])
        _emit_plan(ctx, grp, gn)
        cursors = {s.layer: filed.site(grp, gn, s, fe.emit_site(ctx, grp, gn, s)) for s in grp.sites}
        for s in grp.sites:
            _emit_installs(ctx, grp, gn, s, cursors[s.layer], filed)
    extra = fe.finish(ctx)
    g.lint()
    gm.recompile()
    rows = [filed.rows[layer] for layer in sorted(filed.rows)]
    return RewriteReport(rows, ctx.buffers, filed.before, filed.after, ctx.guards, offload, extra)


_META = ("pool_ids", "id_to_slot", "lru_counter", "stats", "seen_len", "external_write")


def _group_nodes(ctx: RewriteCtx, grp: Group, p: GroupGeometry, gs: GroupState) -> GroupNodes:
    """The group's metadata and its layers' pools as graph attributes; its selection buffers."""
    meta = {n: ctx.attr(f"{n}_g{grp.group_id}", getattr(gs, n)) for n in _META}
    if gs.seen_table is not None:  # paged groups
        meta["seen_table"] = ctx.attr(f"seen_table_g{grp.group_id}", gs.seen_table)
    pools = {}
    for s in grp.sites:  # a layer sharing an earlier layer's caches reads that layer's pool nodes
        src = p.pool_source.get(s.layer)
        if src is not None:
            pools[s.layer] = pools[src]
            continue
        kv, rope = ctx.state.pools[s.layer]
        pools[s.layer] = (ctx.attr(f"pool_kv_l{s.layer}", kv), ctx.attr(f"pool_rope_l{s.layer}", rope))
    gn = GroupNodes(p, meta, pools, gs.stats.device)
    gn.sel = selection_buffers(ctx, grp, p)
    return gn


def selection_buffers(ctx: RewriteCtx, grp: Group, p: GroupGeometry) -> dict[int, SelectionBuffers]:
    """Per layer the buffers serve fills and install reads: the model's own where its geometry names them
    (the recipe form), else scratch of the graph (the HF form)."""
    if all(geo.sel_kv is not None for geo in p.geometry.values()):
        return _model_selection(ctx, p)
    return _scratch_selection(ctx, grp, p)


def _model_selection(ctx: RewriteCtx, p: GroupGeometry) -> dict[int, SelectionBuffers]:
    """The model's buffers; a no-rope layer's 1-D empty rope viewed ``[nb, SBS, 0]``, the zero-width rope
    serve and install take."""
    out = {}
    for layer, geo in p.geometry.items():
        rope = geo.sel_rope
        if geo.Dr == 0:
            with ctx.g.inserting_before(ctx.first):
                rope = ctx.b(aten.view.default, rope, [p.B * p.S * p.K // p.BS, p.BS, 0])
        out[layer] = SelectionBuffers(geo.sel_kv, rope, geo.sel_table)
    return out


def _scratch_selection(ctx: RewriteCtx, grp: Group, p: GroupGeometry) -> dict[int, SelectionBuffers]:
    """Scratch buffers and one identity block table per group; a layer sharing an earlier layer's pool
    reads the rows that layer's serve placed, in its buffers."""
    B, S, K, SBS = p.B, p.S, p.K, p.BS
    dev = ctx.state.pools[grp.owner.layer][0].device
    nb = B * S * K // SBS
    # a tensor of its own, not a view of the arange (a graph buffer; fake-tensor conversion keeps a view's base)
    table = ctx.attr(f"sel_table_g{grp.group_id}",
                     torch.arange(nb, dtype=torch.int32, device=dev).view(B * S, K // SBS).clone())
    out = {}
    for s in grp.sites:
        if s.layer in p.pool_source:
            out[s.layer] = out[p.pool_source[s.layer]]
            continue
        geo = p.geometry[s.layer]
        out[s.layer] = SelectionBuffers(
            ctx.attr(f"sel_kv_l{s.layer}", torch.zeros(nb, SBS, geo.Dkv, dtype=geo.dtype, device=dev)),
            ctx.attr(f"sel_rope_l{s.layer}", torch.zeros(nb, SBS, geo.Dr, dtype=geo.dtype, device=dev)),
            table)
    return out


def step_lengths(ctx: RewriteCtx, grp: Group, p: GroupGeometry) -> fx.Node:
    """This step's cache length per row, ``[B]`` int32, as the plan reads it: the geometry's lengths, or
    from this step's cache positions ``[S]`` (``lengths_are_positions``) ``max + 1`` repeated per row,
    emitted before the owner's anchor."""
    b = ctx.b
    if p.lengths_are_cache_size:  # [B, 1, T, C] grown this step: every row holds T positions
        with ctx.g.inserting_before(grp.owner.anchor):
            T = b(aten.sym_size.int, p.lengths, 2)
            dev = _fx.example(p.topk).device
            return b(aten.full.default, [p.B], T, dtype=torch.int32, device=dev)
    if not p.lengths_are_positions:
        return p.lengths
    with ctx.g.inserting_before(grp.owner.anchor):
        L = b(aten.add.Tensor, b(aten.amax.default, p.lengths, [0]), 1)
        return b(aten.repeat.default, b(aten.view.default, b(aten._to_copy.default, L, dtype=torch.int32), [1]),
                 [p.B])


def _plan_topk(b: Builder, p: GroupGeometry) -> fx.Node:
    """The group's top-k as the plan reads it: ``[B, S, 1, K]`` int32 (a cast only where it is another dtype).
    A top-k narrower than ``K`` (``p.ids_width``) has its negative ids moved to the end of each row (a
    stable sort on ``id < 0``: the plan stops a microtask at a negative id, docs/ops.md §2.4) and -1
    appended up to ``K``."""
    tk = p.topk
    ex = _fx.example(tk)
    if ex is None or ex.dtype != torch.int32:
        tk = b(aten._to_copy.default, tk, dtype=torch.int32)
    if p.ids_width is not None:
        symbolic = isinstance(p.ids_width, torch.SymInt)  # min(index_topk, length) of a grown cache
        tk = b(aten.view.default, tk, [p.B, p.S, -1 if symbolic else p.ids_width])
        neg = b(aten._to_copy.default, b(aten.lt.Scalar, tk, 0), dtype=torch.uint8)
        order = b.item(b(aten.sort.stable, neg, stable=True, dim=-1), 1)
        tk = b(aten.gather.default, tk, -1, order)
        if symbolic:  # constant_pad_nd takes no symbolic padding, and a pad of symbolic width K - w would be
            # guarded (a size is specialised at 0): append K of -1 and keep the first K
            fill = b(aten.full.default, [p.B, p.S, p.K], -1, dtype=torch.int32, device=_fx.example(tk).device)
            tk = b(aten.slice.Tensor, b(aten.cat.default, [tk, fill], -1), -1, 0, p.K)
        else:
            tk = b(aten.constant_pad_nd.default, tk, [0, p.K - p.ids_width], -1)
    return b(aten.view.default, tk, [p.B, p.S, 1, p.K])


def _emit_plan(ctx: RewriteCtx, grp: Group, gn: GroupNodes) -> None:
    """Before the owner's anchor: this step's lengths (guarded), the new-request invalidation,
    ``dsa_plan`` and its statistics."""
    b, p = ctx.b, gn.p
    B, S, K = p.B, p.S, p.K
    L = gn.lengths = step_lengths(ctx, grp, p)
    if ctx.settings.in_graph_guards:
        lengths_guard(ctx, grp, p, L)
    with ctx.g.inserting_before(grp.owner.anchor):
        if ctx.settings.detect_new_requests:
            # the model's gather ledger (the recipe form keeps one per layer, the HF form none): the owner's
            geo = p.geometry[grp.owner.layer]
            table = ((geo.block_table, geo.FBS) if "seen_table" in gn.meta and geo.block_table is not None
                     else None)
            invalidate_new_rows(b, p, gn.meta, L, geo.status, table)
        tk = _plan_topk(b, p)
        gn.plan = b(custom.dsa_plan.default, tk, L, gn.meta["pool_ids"], gn.meta["id_to_slot"],
                    gn.meta["lru_counter"], raw_seq=S, group_id=grp.group_id, owner_layer=grp.owner.layer)
        gn.plan_n, gn.rec, gn.act = b.item(gn.plan, 0), b.item(gn.plan, 1), b.item(gn.plan, 2)
        emit_plan_stats(b, gn.plan_n, gn.meta["stats"], gn.dev)
        gn.tk2 = b(aten.view.default, tk, [B * S, K])
        if p.paged:
            # serve reads the pool only: the full-cache rows (misses, window) become FUTURE_SKIP (zeros) and
            # the model's gather reads them through the block table (frontends/recipe.py, the paged site)
            gn.kinds = b(aten.select.int, gn.plan_n, 1, 0)
            far = b(aten.logical_or.default, b(aten.eq.Scalar, gn.kinds, int(PlanKind.FULL_OLD_MISS)),
                    b(aten.eq.Scalar, gn.kinds, int(PlanKind.DECODE_WINDOW)))
            gn.plan_pool = b(aten.stack.default, [b(aten.where.ScalarSelf, far, int(PlanKind.FUTURE_SKIP), gn.kinds),
                                                  b(aten.select.int, gn.plan_n, 1, 1)], 1)


def _emit_installs(ctx: RewriteCtx, grp: Group, gn: GroupNodes, s: GroupedSite, cursor: fx.Node,
                   filed: _Filed) -> None:
    """After layer ``s``'s attention (``cursor``): its ``metadata_update=0`` install (not the owner), and
    on the group's last layer the owner's ``metadata_update=1`` install; then the install hook."""
    placed: list[fx.Node] = []
    # a layer sharing another's pool installs nothing: its source's install writes the same rows
    own = s is not grp.owner and s.layer not in gn.p.pool_source
    todo = ([(s.layer, 0)] if own else []) + ([(grp.owner.layer, 1)] if s is grp.last else [])
    for layer, md in todo:  # the owner's metadata install goes last: after every metadata_update=0 install
        cursor = _emit_install(ctx, gn, layer, md, cursor)
        placed.append(cursor)
    filed.installs(s.layer, placed, [layer for layer, _ in todo])
    if ctx.settings.install_hook is not None and placed:
        ctx.settings.install_hook(ctx.g, placed, s.layer)


def _emit_install(ctx: RewriteCtx, gn: GroupNodes, layer: int, md: int, cursor: fx.Node) -> fx.Node:
    p, meta = gn.p, gn.meta
    sel = gn.sel[layer]
    kv, rp = gn.pools[layer]
    args = (gn.rec, sel.kv, sel.rope, sel.table, kv, rp, meta["pool_ids"], meta["id_to_slot"], meta["lru_counter"])
    kw = dict(raw_seq=p.S, topk=p.K, selection_block_size=p.BS, metadata_update=md)
    with ctx.g.inserting_after(cursor):
        if ctx.settings.replacement_policy == "second_chance":
            return ctx.b(torch.ops.offload_ref.dsa_install_sc.default, gn.plan_n, *args, **kw)
        return ctx.b(custom.dsa_install.default, *args, **kw)


def invalidate_new_rows(b: Builder, p: GroupGeometry, meta: dict, L: fx.Node, ledger: Optional[fx.Node],
                        table: Optional[tuple[fx.Node, int]] = None) -> None:
    """Batch rows that started a new request lose their pool rows, in the graph, before the plan.

    A row is new when its cache length left the continuation window ``[seen, seen + S]``; when its gather
    ledger (``ledger``, the owner layer's, recipe form) has the count -1 of a reset at any of its S
    positions; for paged groups (``table = (block_table, block_size)``) when a block of the prefix it
    already served changed; and every row when the host saw the full caches written outside this graph
    (``external_write``). The rules and their reasons: docs/new-requests.md. The updates are ``copy_``
    writes (reinplacing keeps them in place); one masked pass over the group's metadata, no host sync::

        new = (L < seen) | (L > seen + S) | ledger_reset | moved_blocks | external_write
        pool_ids.copy_(where(new, -1, pool_ids)); id_to_slot...; lru_counter...; seen.copy_(L)
    """
    B, S, K = p.B, p.S, p.K
    seen = meta["seen_len"]
    new = b(aten.logical_or.default, b(aten.lt.Tensor, L, seen),
            b(aten.gt.Tensor, L, b(aten.add.Tensor, seen, S)))
    if ledger is not None:
        cnt = b(aten.select.int, b(aten.view.default, ledger, [B, -1, K + 1]), 2, K)  # [B, S]
        new = b(aten.logical_or.default, new, b(aten.any.dim, b(aten.eq.Scalar, cnt, -1), 1))
    if table is not None:
        bt, FBS = table
        prev = meta["seen_table"]
        cols = int(_fx.example(prev).size(1))
        served = b(aten.floor_divide.default, b(aten.add.Tensor, seen, FBS - 1), FBS)  # blocks of [0, seen)
        in_prefix = b(aten.lt.Tensor, b(aten.unsqueeze.default, b(aten.arange.default, cols, dtype=torch.int32,
                                                                  device=_fx.example(prev).device), 0),
                      b(aten.unsqueeze.default, served, 1))
        moved = b(aten.logical_and.default, b(aten.ne.Tensor, bt, prev), in_prefix)
        new = b(aten.logical_or.default, new, b(aten.any.dim, moved, 1))
    external = b(aten.ne.Scalar, meta["external_write"], 0)  # [1]
    new = b(aten.logical_or.default, new, external)  # [B] | [1] -> [B]
    col = b(aten.view.default, new, [B, 1])
    for name, fill in (("pool_ids", -1), ("id_to_slot", -1), ("lru_counter", 0)):
        buf = meta[name]
        b(aten.copy_.default, buf, b(aten.where.ScalarSelf, col, fill, buf))
    b(aten.copy_.default, seen, L)
    if table is not None:
        b(aten.copy_.default, meta["seen_table"], table[0])

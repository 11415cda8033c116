"""Pass 4 — the one rewrite core: each group's top-k becomes plan / serve / install, pre-AOT.

Every front-end (``passes/frontends/``: the recipe form, ``frontends/recipe.py``; the Hugging Face form,
``frontends/hf/``) goes through :func:`rewrite`; a front-end only says where a site's attention is and how
it is emitted (the emit hooks of ``frontends/protocol.py::FrontEnd``, built with ``passes/emit.py``) and
returns what it emitted. Everything else exists once, here: the run-time guards, the new-request
invalidation, ``dsa_plan`` and its statistics, the top-k the plan reads, the site bookkeeping (report
rows, per-layer nodes), the installs (``replacement_policy``) and the ``install_hook`` of the NPU / CUDA
lowerings.

Per group g (owner O, last layer Z), on the Dynamo graph (op semantics: docs/ops.md):

* before O's attention: the new-request invalidation (below), then ``plan, rec, act =
  custom.dsa_plan(topk[B,S,1,K], L, pool_ids[g], id_to_slot[g], lru[g], raw_seq=S, group_id=g,
  owner_layer=O)`` and the in-graph statistics;
* at every layer l: the front-end's ``dsa_serve`` (pool hits and host misses into l's selection buffers)
  and the attention reading them;
* right after layer l's attention: ``dsa_install(..., metadata_update=0)`` for l != O; on Z after its
  own install, the owner's ``metadata_update=1`` install. A layer that reads an earlier layer's full
  caches (``GroupGeometry.pool_source``, cross-layer KV sharing) shares that layer's pool and has no
  install of its own.

Ordering (docs/ops.md, "ordering"): installs sit in program order after their layer's attention, Z's own
install precedes the owner's, and the next step's plan / serves run in the next graph call. On CPU
program order plus data dependencies *is* the join; lowerings that move installs to a side stream get
each layer's install nodes through ``install_hook`` and add the events.

New requests (docs/new-requests.md): before the plan, a batch row's pool metadata is invalidated when
its cache length left the continuation window ``[seen, seen + S]``, when the model reset its gather
ledger (recipe form, every mode), when (paged groups) the blocks of the prefix it already served
changed, or when the host saw the full caches written outside this graph (``external_write``, set by
``state.StateRegistry.activate`` from the caches' version counters; then every row, a counter cannot say
which rows were written, unless the engine announced them: ``OffloadState.begin_request`` /
``move_rows``).
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
from ._fx import hoist_attrs, strip_views
from .emit import Builder, GroupNodes, InstallHook, RewriteCtx, SiteEmission, SiteRewrite, guard, input_name
from .frontends.protocol import FrontEnd
from .group import Group, GroupedSite, GroupReport
from .preconditions import GroupGeometry

__all__ = ["rewrite", "RewriteReport", "invalidate_new_rows", "emit_plan_stats"]

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
            state: Optional[OffloadState], update_ledger: bool = True, install_hook: Optional[InstallHook] = None,
            in_graph_guards: bool = True, detect_new_requests: bool = True,
            replacement_policy: str = "fifo") -> RewriteReport:
    """Rewrite every group of ``groups`` through the front-end ``fe``.

    ``plans`` / ``state`` empty / None: the front-end's rewrite without offload (HF: sparse attention
    only). ``in_graph_guards``: check every compile-time assumption at run time; ``detect_new_requests``:
    the in-graph new-request invalidation (module doc); ``replacement_policy``: ``fifo`` installs with
    ``custom::dsa_install`` (CANN's), ``second_chance`` with ``offload_ref::dsa_install_sc`` (same inputs
    plus the step's plan, whose hits set reference bits)."""
    check_replacement_policy(replacement_policy)
    g = gm.graph
    hoist_attrs(g)  # module buffers as get_attr (no nn-module inlining) become usable anywhere
    first = next(n for n in g.nodes if n.op not in ("placeholder", "get_attr"))
    pl = {p.group_id: p for p in plans}
    hints = [p.topk for p in plans] or [s.topk for gr in groups.groups for s in gr.sites][:1]
    ctx = RewriteCtx(gm, Builder(g, hints), first, state, update_ledger, install_hook, detect_new_requests,
                     replacement_policy, in_graph_guards)
    offload = bool(pl) and state is not None
    if in_graph_guards and offload:
        fe.add_guards(ctx, groups, pl)
    gstates = {gs.group_id: gs for gs in state.groups} if offload else {}
    filed = _Filed()
    for grp in groups.groups:
        p = pl.get(grp.group_id) if offload else None
        if p is None:
            for s in grp.sites:
                filed.site(grp, None, s, fe.emit_site(ctx, grp, None, s))
            continue
        gn = _group_nodes(ctx, fe, grp, p, gstates[grp.group_id])
        _emit_plan(ctx, fe, grp, gn)
        cursors = {s.layer: filed.site(grp, gn, s, fe.emit_site(ctx, grp, gn, s)) for s in grp.sites}
        for s in grp.sites:
            _emit_installs(ctx, grp, gn, s, cursors[s.layer], filed)
    extra = fe.finish(ctx)
    g.lint()
    gm.recompile()
    rows = [filed.rows[layer] for layer in sorted(filed.rows)]
    return RewriteReport(rows, ctx.buffers, filed.before, filed.after, ctx.guards, offload, extra)


_META = ("pool_ids", "id_to_slot", "lru_counter", "stats", "seen_len", "external_write")


def _group_nodes(ctx: RewriteCtx, fe: FrontEnd, grp: Group, p: GroupGeometry, gs: GroupState) -> GroupNodes:
    """The group's metadata and its layers' pools as graph attributes; the front-end's selection buffers."""
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
    gn.sel = fe.selection(ctx, grp, p)
    return gn


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
        tk = b(aten.view.default, tk, [p.B, p.S, p.ids_width])
        neg = b(aten._to_copy.default, b(aten.lt.Scalar, tk, 0), dtype=torch.uint8)
        order = b.item(b(aten.sort.stable, neg, stable=True, dim=-1), 1)
        tk = b(aten.gather.default, tk, -1, order)
        tk = b(aten.constant_pad_nd.default, tk, [0, p.K - p.ids_width], -1)
    return b(aten.view.default, tk, [p.B, p.S, 1, p.K])


def _emit_plan(ctx: RewriteCtx, fe: FrontEnd, grp: Group, gn: GroupNodes) -> None:
    """Before the owner's attention: this step's lengths (guarded), the new-request invalidation,
    ``dsa_plan`` and its statistics."""
    b, p = ctx.b, gn.p
    B, S, K = p.B, p.S, p.K
    anchor, L = fe.plan_inputs(ctx, grp, p)
    gn.lengths = L
    if ctx.in_graph_guards:
        _lengths_guard(ctx, grp, p, L)
    with ctx.g.inserting_before(anchor):
        if ctx.detect_new_requests:
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


def _lengths_guard(ctx: RewriteCtx, grp: Group, p: GroupGeometry, L: fx.Node) -> None:
    root = strip_views(p.lengths, casts=True)  # the lengths input the front-end computed L from
    if root in ctx.guarded:
        return
    ctx.guarded.add(root)
    lim = min(max(p.geometry[l].F for l in p.layers), p.id_range)
    b = ctx.b
    guard(ctx, L, lambda: b(aten.logical_and.default, b(aten.all.default, b(aten.ge.Scalar, L, 0)),
                            b(aten.all.default, b(aten.le.Scalar, L, lim))),
          f"offload guard: cache lengths {input_name(L)!r} of group {grp.group_id} must be in [0, {lim}] "
          f"(cache capacity / id_range the pools were sized for)")


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
    if ctx.install_hook is not None and placed:
        ctx.install_hook(ctx.g, placed, s.layer)


def _emit_install(ctx: RewriteCtx, gn: GroupNodes, layer: int, md: int, cursor: fx.Node) -> fx.Node:
    p, meta = gn.p, gn.meta
    sel = gn.sel[layer]
    kv, rp = gn.pools[layer]
    args = (gn.rec, sel.kv, sel.rope, sel.table, kv, rp, meta["pool_ids"], meta["id_to_slot"], meta["lru_counter"])
    kw = dict(raw_seq=p.S, topk=p.K, selection_block_size=p.BS, metadata_update=md)
    with ctx.g.inserting_after(cursor):
        if ctx.replacement_policy == "second_chance":
            return ctx.b(torch.ops.offload_ref.dsa_install_sc.default, gn.plan_n, *args, **kw)
        return ctx.b(custom.dsa_install.default, *args, **kw)


def invalidate_new_rows(b: Builder, p: GroupGeometry, meta: dict, L: fx.Node, ledger: Optional[fx.Node],
                        table: Optional[tuple[fx.Node, int]] = None) -> None:
    """Batch rows that started a new request lose their pool rows, in the graph, before the plan.

    A row is new when (docs/new-requests.md):

    * its cache length left the continuation window: ``L < seen`` or ``L > seen + S`` (a decode step
      advances a row by 1..S tokens; ``seen`` is the previous step's ``L``);
    * its gather ledger was reset (``ledger``: the owner layer's, recipe form; count column
      ``status[..., K] == -1`` at any of the row's S positions): the unmodified model's own mark of a row
      that holds nothing (a new model, its ``reset_rows``, the reference's ``reinit_status``, an engine
      resetting the rows it re-filled). Every writer of the ledger leaves another count: the rewrite a
      count >= 0 (``update_ledger``) or :data:`.emit.LEDGER_SERVED`, the model's own gather a count >= 0, so
      the signal holds in every mode, whether or not the rewrite keeps the ledger. One masked read of
      ``[B, S]`` per group and step;
    * paged groups (``table = (block_table, block_size)``): a block of the prefix the row already served
      (``[0, seen)``) is not the one it had at the previous step (``seen_table``): the row holds another
      request (a re-allocation, a row that shifted). This signal sees writes no version counter shows (a
      C++ op, a KV transfer) whenever the engine gives a new request other blocks;
    * the host saw the full caches written outside this graph since the state's last step
      (``external_write[0] != 0``: their version counters moved, ``state.StateRegistry.activate``):
      every row. A counter is per tensor, not per row, so neither the ledger nor ``reset(rows=...)``
      can prove the other rows untouched: correctness wins over warmth. Only the engine's complete
      account (``begin_request`` / ``move_rows``) keeps the host from setting the flag.

    Cost: one masked pass over the group's metadata per step, no host sync. The updates are ``copy_``
    writes so that reinplacing keeps them in place (passes/reinplace.py,
    passes/npu_install_chains.py::inplace_masked_input_updates).
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

"""Pass 4 — rewrite each group's gathers into plan / serve / install (spec/ops.md §5), pre-AOT.

Per group g (owner O, last layer Z), on the Dynamo graph:

* before O's gather: ``plan, rec, act = custom.dsa_plan(topk[B,S,1,K], L, pool_ids[g], id_to_slot[g],
  lru[g], raw_seq=S, group_id=g, owner_layer=O)`` and the in-graph stats update (kind counts);
* at every layer l's gather: ``custom.dsa_serve(plan, full_kv[l] as [B,F,Dkv], full_rope[l] as [B,F,Dr],
  pool_kv[l], pool_rope[l], sel_kv[l], sel_rope[l], ...)``, the ledger write (``sel_status[l]`` =
  what serve placed: ``where(arange(K) < act, topk, -1)`` then ``act``), and every use of the gather's
  result replaced by the plan's ``act``; the gather is removed;
* right after layer l's attention: ``dsa_install(..., metadata_update=0)`` for l != O; on Z after its
  own install, the owner's ``metadata_update=1`` install.

Ordering (spec §5 rules 1-3, §8.11): installs sit in program order after their layer's attention,
Z's own install precedes the owner's, and the next step's plan / serve run in the next graph call.
On CPU program order plus data dependencies *is* the join the recipe lacks. NPU modes that move
installs to a side stream get each layer's install nodes through ``install_hook`` and must add the
events (record after serve, wait before install, closure before the next use of pool / selection).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import fx

from .. import _compat
from ..state import OffloadState
from . import _fx
from ._fx import hoist_attrs, strip_views
from .group import GroupReport
from .preconditions import PlanReport

aten = torch.ops.aten
custom = torch.ops.custom

#: ``install_hook(graph, install_nodes, layer)`` — called once per layer with the installs placed after it.
InstallHook = Callable[[fx.Graph, list, int], None]


@dataclass
class SiteRewrite:
    layer: int
    group_id: int
    gather_node: str
    sfa_node: str
    serve_node: str
    install_nodes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"layer": self.layer, "group_id": self.group_id, "gather_node": self.gather_node,
                "sfa_node": self.sfa_node, "serve_node": self.serve_node, "install_nodes": list(self.install_nodes)}


class OffloadRefused(RuntimeError):
    """Raised under ``strict=True`` when a graph with DSA sites cannot be rewritten."""


@dataclass
class RewriteReport:
    sites: list[SiteRewrite]
    buffers: dict[str, str]  # state tensor name -> attribute name on the GraphModule
    layer_nodes_before: dict[int, list[str]]
    layer_nodes_after: dict[int, list[str]]
    guards: list[str] = field(default_factory=list)  # names of the in-graph run-time checks


class _Builder:
    """Emits ``call_function`` nodes with their fake ``meta["val"]`` (``_fx.set_fake_val``)."""

    def __init__(self, graph: fx.Graph, hints: Sequence[Any] = ()):
        self.g = graph
        self.record: Optional[list] = None  # when a list: every node created is appended to it
        # the example values' fake mode (state get_attr fakes join it): from ``hints`` (nodes with fake
        # values), else from the placeholders (a walk over them)
        self.fake_mode = _fx.fake_mode_of([_fx.example(h) for h in hints]) or _fx.graph_fake_mode(graph)

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        n = self.g.call_function(target, args, kwargs)
        _fx.set_fake_val(n, self.fake_mode)
        if self.record is not None:
            self.record.append(n)
        return n

    def item(self, node: fx.Node, i: int) -> fx.Node:
        n = self.g.call_function(operator.getitem, (node, i))
        _fx.set_fake_val(n, self.fake_mode)
        return n


def _name(node: Any) -> str:
    """The user-facing name of a graph input (the placeholder / attribute a tensor comes from)."""
    root = strip_views(node, casts=True)
    if isinstance(root, fx.Node):
        return str(root.target) if root.op == "get_attr" else root.name
    return str(root)


def _guard(g: fx.Graph, b: "_Builder", first: fx.Node, inp: Any, make: Callable[[], fx.Node], msg: str,
           guards: list) -> None:
    """An in-graph check raising ``RuntimeError(msg)`` when ``make()`` (a bool scalar) is false, placed
    right after its input ``inp`` so that it runs before anything the assumption protects."""
    late = isinstance(inp, fx.Node) and inp.op not in ("placeholder", "get_attr")
    b.record = []
    try:
        with g.inserting_after(inp) if late else g.inserting_before(first):
            ok = make()
            node = b(aten._assert_async.msg, ok, msg)
        if late:  # inserting_after puts each new node right after inp (reverse order): re-chain them
            anchor = inp
            for n in b.record:
                anchor.append(n)
                anchor = n
    finally:
        b.record = None
    guards.append(node.name)


def state_attr(gm: fx.GraphModule, name: str, t: torch.Tensor, buffers: dict[str, str],
               before: fx.Node, fake_mode: Any = None) -> fx.Node:
    """Register offload state ``t`` as buffer ``_offload_<name>`` of ``gm`` (recorded in ``buffers``) and
    return a ``get_attr`` node for it, placed before ``before``."""
    attr_name = f"_offload_{name}"
    gm.register_buffer(attr_name, t)
    buffers[name] = attr_name
    if hasattr(gm, "_param_name_to_source"):
        # AOT maps every lifted parameter/buffer of a Dynamo graph to a Dynamo source
        gm._param_name_to_source[attr_name] = _compat.constant_source(f"offload_state.{attr_name}")
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(attr_name)
    _fx.set_fake_val(node, fake_mode)
    return node


def emit_plan_stats(b: Callable[..., fx.Node], plan_n: fx.Node, stats: fx.Node, dev: Any) -> None:
    """In-graph counters after a plan: ``stats[0]`` = this step's one-hot count of the six plan kinds plus
    the step, ``stats[1]`` = the running total. ``b(target, *args, **kwargs)`` emits one node."""
    kinds = b(aten.select.int, plan_n, 1, 0)
    eq = b(aten.eq.Tensor, b(aten.unsqueeze.default, kinds, 1),
           b(aten.arange.default, 6, dtype=torch.int32, device=dev))
    cnt = b(aten.sum.dim_IntList, eq, [0])
    new = b(aten.cat.default, [cnt, b(aten.ones.default, [1], dtype=torch.int64, device=dev)])
    cum = b(aten.add.Tensor, b(aten.select.int, stats, 0, 1), new)
    b(aten.copy_.default, stats, b(aten.stack.default, [new, cum]))


@dataclass
class _Ctx:
    """One rewrite's graph, options and accumulating results."""

    gm: fx.GraphModule
    b: _Builder
    first: fx.Node  # the first computing node: state attributes and early guards go before it
    state: OffloadState
    update_ledger: bool
    install_hook: Optional[InstallHook]
    detect_new_requests: bool
    replacement_policy: str
    buffers: dict[str, str] = field(default_factory=dict)
    guards: list[str] = field(default_factory=list)
    after: dict[int, list[str]] = field(default_factory=dict)
    sites: list[SiteRewrite] = field(default_factory=list)

    @property
    def g(self) -> fx.Graph:
        return self.gm.graph

    def attr(self, name: str, t: torch.Tensor) -> fx.Node:
        return state_attr(self.gm, name, t, self.buffers, self.first, self.b.fake_mode)


@dataclass
class _GroupNodes:
    """The nodes of one group every layer's serve / install uses."""

    p: Any  # GroupPlan
    meta: dict[str, fx.Node]  # pool_ids, id_to_slot, lru_counter, stats, seen_len
    pools: dict[int, tuple[fx.Node, fx.Node]]  # layer -> (pool_kv, pool_rope)
    dev: Any  # the state's device
    plan: Optional[fx.Node] = None  # the dsa_plan call
    plan_n: Optional[fx.Node] = None  # its outputs: plan, install records, active count
    rec: Optional[fx.Node] = None
    act: Optional[fx.Node] = None
    tk2: Optional[fx.Node] = None  # top-k as [B*S, K]
    by_layer: dict[int, SiteRewrite] = field(default_factory=dict)


def rewrite(gm: fx.GraphModule, groups: GroupReport, plan: PlanReport, state: OffloadState,
            update_ledger: bool = True, install_hook: Optional[InstallHook] = None,
            in_graph_guards: bool = True, detect_new_requests: bool = True,
            replacement_policy: str = "fifo") -> RewriteReport:
    """``in_graph_guards``: check every compile-time assumption at run time (see ``_add_guards``);
    ``detect_new_requests``: invalidate, in the graph, the pool rows of batch rows that started a new
    request (length went down, or the model reset their gather ledger); ``replacement_policy``:
    ``fifo`` installs with ``custom::dsa_install`` (CANN's), ``second_chance`` with the opt-in
    ``offload_ref::dsa_install_sc`` (same inputs plus the step's plan, whose hits set reference bits)."""
    g = gm.graph
    hoist_attrs(g)  # module buffers as get_attr (no nn-module inlining) become usable anywhere
    first = next(n for n in g.nodes if n.op not in ("placeholder", "get_attr"))
    ctx = _Ctx(gm, _Builder(g, [p.topk for p in plan.groups]), first, state, update_ledger, install_hook, detect_new_requests, replacement_policy)
    before = {s.layer: [s.producer.name, s.gather.name, s.sfa.name] if s is grp.owner else [s.gather.name, s.sfa.name]
              for grp in groups.groups for s in grp.sites}
    plans = {p.group_id: p for p in plan.groups}
    if in_graph_guards:
        _add_guards(g, ctx.b, first, groups, plans, ctx.guards)
    gstates = {gs.group_id: gs for gs in state.groups}
    for grp in groups.groups:
        gn = _group_nodes(ctx, grp, plans[grp.group_id], gstates[grp.group_id])
        _emit_plan(ctx, grp, gn)
        for s in grp.sites:
            _emit_serve(ctx, grp, gn, s)
        for s in grp.sites:
            _emit_installs(ctx, grp, gn, s)
    g.lint()
    gm.recompile()
    ctx.sites.sort(key=lambda r: r.layer)
    return RewriteReport(ctx.sites, ctx.buffers, before, ctx.after, ctx.guards)


def _group_nodes(ctx: _Ctx, grp: Any, p: Any, gs: Any) -> _GroupNodes:
    """The group's metadata and its layers' pools as graph attributes."""
    meta = {n: ctx.attr(f"{n}_g{grp.group_id}", t) for n, t in
            (("pool_ids", gs.pool_ids), ("id_to_slot", gs.id_to_slot), ("lru_counter", gs.lru_counter),
             ("stats", gs.stats), ("seen_len", gs.seen_len))}
    pools = {}
    for s in grp.sites:
        kv, rope = ctx.state.pools[s.layer]
        pools[s.layer] = (ctx.attr(f"pool_kv_l{s.layer}", kv), ctx.attr(f"pool_rope_l{s.layer}", rope))
    return _GroupNodes(p, meta, pools, gs.stats.device)


def _emit_plan(ctx: _Ctx, grp: Any, gn: _GroupNodes) -> None:
    """Before the owner's gather: the new-request invalidation, ``dsa_plan`` and its statistics."""
    b, p, meta, owner = ctx.b, gn.p, gn.meta, grp.owner
    B, S, K = p.B, p.S, p.K
    if ctx.detect_new_requests:
        with ctx.g.inserting_before(owner.gather):
            _invalidate_new_rows(b, p, grp, meta, ctx.update_ledger)
    with ctx.g.inserting_before(owner.gather):
        tk = b(aten.view.default, p.topk, [B, S, 1, K])
        gn.plan = b(custom.dsa_plan.default, tk, p.lengths, meta["pool_ids"], meta["id_to_slot"],
                    meta["lru_counter"], raw_seq=S, group_id=grp.group_id, owner_layer=owner.layer)
        gn.plan_n, gn.rec, gn.act = b.item(gn.plan, 0), b.item(gn.plan, 1), b.item(gn.plan, 2)
        emit_plan_stats(b, gn.plan_n, meta["stats"], gn.dev)
        gn.tk2 = b(aten.view.default, tk, [B * S, K])


def _emit_serve(ctx: _Ctx, grp: Any, gn: _GroupNodes, s: Any) -> None:
    """Layer ``s``: ``dsa_serve`` (and the ledger write) replaces its gather."""
    b, p = ctx.b, gn.p
    B, S, K, SBS = p.B, p.S, p.K, p.BS
    geo = p.geometry[s.layer]
    pkv, prope = gn.pools[s.layer]
    with ctx.g.inserting_before(s.gather):
        fkv = b(aten.view.default, geo.full_kv, [B, geo.F, geo.Dkv])
        frp = b(aten.view.default, geo.full_rope, [B, geo.F, geo.Dr])
        serve = b(custom.dsa_serve.default, gn.plan_n, fkv, frp, pkv, prope, geo.sel_kv, geo.sel_rope,
                  raw_seq=S, topk=K, selection_block_size=SBS, compact_layout=1)
        ledger = [_emit_ledger(b, geo, gn, K)] if ctx.update_ledger else []
    gather_name = s.gather.name
    s.gather.replace_all_uses_with(gn.act)
    ctx.g.erase_node(s.gather)
    sr = SiteRewrite(s.layer, grp.group_id, gather_name, s.sfa.name, serve.name)
    gn.by_layer[s.layer] = sr
    ctx.after[s.layer] = (([gn.plan.name] if s is grp.owner else []) + [serve.name] + [n.name for n in ledger]
                          + [s.sfa.name])
    ctx.sites.append(sr)


def _emit_ledger(b: _Builder, geo: Any, gn: _GroupNodes, K: int) -> fx.Node:
    """Keep the model's gather ledger valid for what serve placed (position k <- topk[k], then the count)."""
    ar = b(aten.arange.default, K, dtype=torch.int32, device=gn.dev)
    lt = b(aten.lt.Tensor, b(aten.unsqueeze.default, ar, 0), b(aten.unsqueeze.default, gn.act, 1))
    vals = b(aten.where.ScalarOther, lt, gn.tk2, -1)
    row = b(aten.cat.default, [vals, b(aten.unsqueeze.default, gn.act, 1)], 1)
    shape = list(geo.status.meta["example_value"].shape)
    return b(aten.copy_.default, geo.status, b(aten.view.default, row, shape))


def _emit_installs(ctx: _Ctx, grp: Any, gn: _GroupNodes, s: Any) -> None:
    """After layer ``s``'s attention: its ``metadata_update=0`` install (not the owner), and on the
    group's last layer the owner's ``metadata_update=1`` install; then the install hook."""
    cursor = s.sfa
    placed: list[fx.Node] = []
    todo = ([(s.layer, 0)] if s is not grp.owner else []) + ([(grp.owner.layer, 1)] if s is grp.last else [])
    for layer, md in todo:  # the owner's metadata install goes last: after every metadata_update=0 install
        cursor = _emit_install(ctx, gn, layer, md, cursor)
        placed.append(cursor)
        gn.by_layer[layer].install_nodes.append(cursor.name)
    ctx.after[s.layer] += [n.name for n in placed]
    if ctx.install_hook is not None and placed:
        ctx.install_hook(ctx.g, placed, s.layer)


def _emit_install(ctx: _Ctx, gn: _GroupNodes, layer: int, md: int, cursor: fx.Node) -> fx.Node:
    p, meta = gn.p, gn.meta
    gg = p.geometry[layer]
    kv, rp = gn.pools[layer]
    args = (gn.rec, gg.sel_kv, gg.sel_rope, gg.sel_table, kv, rp,
            meta["pool_ids"], meta["id_to_slot"], meta["lru_counter"])
    kw = dict(raw_seq=p.S, topk=p.K, selection_block_size=p.BS, metadata_update=md)
    with ctx.g.inserting_after(cursor):
        if ctx.replacement_policy == "second_chance":
            return ctx.b(torch.ops.offload_ref.dsa_install_sc.default, gn.plan_n, *args, **kw)
        return ctx.b(custom.dsa_install.default, *args, **kw)


def _invalidate_new_rows(b: "_Builder", p: Any, grp: Any, meta: dict, ledger: bool) -> None:
    """Batch rows that started a new request lose their pool rows, in the graph, before the plan.

    A row is new when its cache length went down since the previous step (``seen_len``), or when the
    model reset its gather ledger (count column ``status[..., K] == -1``; the rewrite writes a count
    >= 0 every step, so only the model's reset leaves -1). Cost: one masked pass over the group's
    metadata per step, no host sync. The updates are ``copy_`` writes so that reinplacing keeps them
    in place (see passes/reinplace.py).
    """
    B, K = p.B, p.K
    L = p.lengths
    new = b(aten.lt.Tensor, L, meta["seen_len"])
    if ledger:
        for s in grp.sites:
            st = p.geometry[s.layer].status
            cnt = b(aten.select.int, b(aten.view.default, st, [B, -1, K + 1]), 2, K)  # [B, S]
            reset = b(aten.any.dim, b(aten.lt.Scalar, cnt, 0), 1)
            new = b(aten.logical_or.default, new, reset)
    col = b(aten.view.default, new, [B, 1])
    for name, fill in (("pool_ids", -1), ("id_to_slot", -1), ("lru_counter", 0)):
        buf = meta[name]
        b(aten.copy_.default, buf, b(aten.where.ScalarSelf, col, fill, buf))
    b(aten.copy_.default, meta["seen_len"], L)


def _add_guards(g: fx.Graph, b: "_Builder", first: fx.Node, groups: GroupReport, plans: dict,
                guards: list) -> None:
    """Run-time checks of what preconditions.py verified on the example inputs only: identity full and
    selection block tables, cache lengths within ``[0, min(F, id_range)]``. Shapes and dtypes are
    static in the graph, so Dynamo's own guards recompile on any change."""
    seen: set = set()
    for grp in groups.groups:
        p = plans[grp.group_id]
        B, S, K, SBS = p.B, p.S, p.K, p.BS
        for s in grp.sites:
            bt = s.args["full_kv_block_table"]
            ex = _fx.example(bt)
            root = strip_views(bt)
            if ex is not None and ex.dim() == 2 and root not in seen:
                seen.add(root)
                rows, cols = int(ex.size(0)), int(ex.size(1))
                _guard(g, b, first, bt, lambda bt=bt, rows=rows, cols=cols, ex=ex: b(
                    aten.all.default, b(aten.eq.Tensor, bt, b(aten.view.default, b(
                        aten.arange.default, rows * cols, dtype=ex.dtype, device=ex.device), [rows, cols]))),
                    f"offload guard: block table {_name(bt)!r} is no longer the identity layout "
                    f"arange({rows}*{cols}).view({rows}, {cols}) this graph was rewritten for; the offload "
                    f"pools would serve wrong rows (recompile after torch._dynamo.reset(), or keep the table)",
                    guards)
            st = s.args["selection_kv_block_table"]
            ex = _fx.example(st)
            root = strip_views(st)
            smax = K // SBS
            if ex is not None and ex.dim() == 2 and root not in seen:
                seen.add(root)
                rows = int(ex.size(0))
                _guard(g, b, first, st, lambda st=st, rows=rows, ex=ex, smax=smax: b(
                    aten.all.default, b(aten.eq.Tensor, b(aten.slice.Tensor, st, 1, 0, smax), b(
                        aten.view.default, b(aten.arange.default, rows * smax, dtype=ex.dtype, device=ex.device),
                        [rows, smax]))),
                    f"offload guard: selection block table {_name(st)!r} is no longer the identity layout "
                    f"arange({rows}*{smax}).view({rows}, {smax}) this graph was rewritten for", guards)
        L = p.lengths
        lim = min(max(p.geometry[l].F for l in p.layers), p.id_range)
        if strip_views(L, casts=True) not in seen:
            seen.add(strip_views(L, casts=True))
            _guard(g, b, first, L, lambda L=L, lim=lim: b(
                aten.logical_and.default, b(aten.all.default, b(aten.ge.Scalar, L, 0)),
                b(aten.all.default, b(aten.le.Scalar, L, lim))),
                f"offload guard: cache lengths {_name(L)!r} (full_kv_actual_seq of group {grp.group_id}) must "
                f"be in [0, {lim}] (cache capacity / id_range the pools were sized for)", guards)

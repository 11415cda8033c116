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
from typing import Any, Callable, Optional

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


@dataclass
class RewriteReport:
    sites: list[SiteRewrite]
    plan_nodes: dict[int, str]  # group_id -> dsa_plan node name
    buffers: dict[str, str]  # state tensor name -> attribute name on the GraphModule
    layer_nodes_before: dict[int, list[str]]
    layer_nodes_after: dict[int, list[str]]
    guards: list[str] = field(default_factory=list)  # names of the in-graph run-time checks


class _Builder:
    def __init__(self, graph: fx.Graph):
        self.g = graph
        self.record: Optional[list] = None  # when a list: every node created is appended to it

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        n = self.g.call_function(target, args, kwargs)
        if self.record is not None:
            self.record.append(n)
        return n

    def item(self, node: fx.Node, i: int) -> fx.Node:
        return self.g.call_function(operator.getitem, (node, i))


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
               before: fx.Node) -> fx.Node:
    """Register offload state ``t`` as buffer ``_offload_<name>`` of ``gm`` (recorded in ``buffers``) and
    return a ``get_attr`` node for it, placed before ``before``."""
    attr_name = f"_offload_{name}"
    gm.register_buffer(attr_name, t)
    buffers[name] = attr_name
    if hasattr(gm, "_param_name_to_source"):
        # AOT maps every lifted parameter/buffer of a Dynamo graph to a Dynamo source
        gm._param_name_to_source[attr_name] = _compat.constant_source(f"offload_state.{attr_name}")
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(attr_name)


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
    b = _Builder(g)
    first = next(n for n in g.nodes if n.op not in ("placeholder", "get_attr"))
    buffers: dict[str, str] = {}
    guards: list[str] = []

    def attr(name: str, t: torch.Tensor) -> fx.Node:
        return state_attr(gm, name, t, buffers, first)

    before = {s.layer: [s.producer.name, s.gather.name, s.sfa.name] if s is grp.owner else [s.gather.name, s.sfa.name]
              for grp in groups.groups for s in grp.sites}
    after: dict[int, list[str]] = {}
    sites_out: list[SiteRewrite] = []
    plan_nodes: dict[int, str] = {}
    plans = {p.group_id: p for p in plan.groups}
    gstates = {gs.group_id: gs for gs in state.groups}

    if in_graph_guards:
        _add_guards(g, b, first, groups, plans, guards)

    for grp in groups.groups:
        p, gs = plans[grp.group_id], gstates[grp.group_id]
        B, S, K, SBS = p.B, p.S, p.K, p.BS
        meta = {n: attr(f"{n}_g{grp.group_id}", t) for n, t in
                (("pool_ids", gs.pool_ids), ("id_to_slot", gs.id_to_slot), ("lru_counter", gs.lru_counter),
                 ("stats", gs.stats), ("seen_len", gs.seen_len))}
        pools = {}
        for s in grp.sites:
            kv, rope = state.pools[s.layer]
            pools[s.layer] = (attr(f"pool_kv_l{s.layer}", kv), attr(f"pool_rope_l{s.layer}", rope))
        dev = gs.stats.device
        owner = grp.owner
        if detect_new_requests:
            with g.inserting_before(owner.gather):
                _invalidate_new_rows(b, p, grp, meta, update_ledger)
        with g.inserting_before(owner.gather):
            tk = b(aten.view.default, p.topk, [B, S, 1, K])
            pl = b(custom.dsa_plan.default, tk, p.lengths, meta["pool_ids"], meta["id_to_slot"],
                   meta["lru_counter"], raw_seq=S, group_id=grp.group_id, owner_layer=owner.layer)
            plan_n, rec, act = b.item(pl, 0), b.item(pl, 1), b.item(pl, 2)
            emit_plan_stats(b, plan_n, meta["stats"], dev)
            tk2 = b(aten.view.default, tk, [B * S, K])
        plan_nodes[grp.group_id] = pl.name

        cursor_installs: dict[int, SiteRewrite] = {}
        for s in grp.sites:
            geo = p.geometry[s.layer]
            pkv, prope = pools[s.layer]
            with g.inserting_before(s.gather):
                fkv = b(aten.view.default, geo.full_kv, [B, geo.F, geo.Dkv])
                frp = b(aten.view.default, geo.full_rope, [B, geo.F, geo.Dr])
                serve = b(custom.dsa_serve.default, plan_n, fkv, frp, pkv, prope, geo.sel_kv, geo.sel_rope,
                          raw_seq=S, topk=K, selection_block_size=SBS, compact_layout=1)
                ledger = []
                if update_ledger:
                    # keep the model's gather ledger valid for what serve placed (position k <- topk[k])
                    ar = b(aten.arange.default, K, dtype=torch.int32, device=dev)
                    lt = b(aten.lt.Tensor, b(aten.unsqueeze.default, ar, 0), b(aten.unsqueeze.default, act, 1))
                    vals = b(aten.where.ScalarOther, lt, tk2, -1)
                    row = b(aten.cat.default, [vals, b(aten.unsqueeze.default, act, 1)], 1)
                    shape = list(geo.status.meta["example_value"].shape)
                    ledger.append(b(aten.copy_.default, geo.status, b(aten.view.default, row, shape)))
            gather_name = s.gather.name
            s.gather.replace_all_uses_with(act)
            g.erase_node(s.gather)
            sr = SiteRewrite(s.layer, grp.group_id, gather_name, s.sfa.name, serve.name)
            cursor_installs[s.layer] = sr
            after[s.layer] = ([pl.name] if s is owner else []) + [serve.name] + [n.name for n in ledger] + [s.sfa.name]
            sites_out.append(sr)

        last = grp.last
        for s in grp.sites:
            geo = p.geometry[s.layer]
            cursor = s.sfa
            placed: list[fx.Node] = []

            def install(site_layer: int, md: int) -> fx.Node:
                gg = p.geometry[site_layer]
                kv, rp = pools[site_layer]
                args = (rec, gg.sel_kv, gg.sel_rope, gg.sel_table, kv, rp,
                        meta["pool_ids"], meta["id_to_slot"], meta["lru_counter"])
                kw = dict(raw_seq=S, topk=K, selection_block_size=SBS, metadata_update=md)
                with g.inserting_after(cursor):
                    if replacement_policy == "second_chance":
                        return b(torch.ops.offload_ref.dsa_install_sc.default, plan_n, *args, **kw)
                    return b(custom.dsa_install.default, *args, **kw)

            if s is not owner:
                cursor = install(s.layer, 0)
                placed.append(cursor)
                cursor_installs[s.layer].install_nodes.append(cursor.name)
            if s is last:
                # the owner's metadata install goes last: after every metadata_update=0 install
                cursor = install(owner.layer, 1)
                placed.append(cursor)
                cursor_installs[owner.layer].install_nodes.append(cursor.name)
            after[s.layer] += [n.name for n in placed]
            if install_hook is not None and placed:
                install_hook(g, placed, s.layer)

    g.lint()
    gm.recompile()
    sites_out.sort(key=lambda r: r.layer)
    return RewriteReport(sites_out, plan_nodes, buffers, before, after, guards)


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

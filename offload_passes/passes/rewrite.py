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

from ..state import OffloadState
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


class _Builder:
    def __init__(self, graph: fx.Graph):
        self.g = graph

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return self.g.call_function(target, args, kwargs)

    def item(self, node: fx.Node, i: int) -> fx.Node:
        return self.g.call_function(operator.getitem, (node, i))


def rewrite(gm: fx.GraphModule, groups: GroupReport, plan: PlanReport, state: OffloadState,
            update_ledger: bool = True, install_hook: Optional[InstallHook] = None) -> RewriteReport:
    g = gm.graph
    b = _Builder(g)
    first = next(n for n in g.nodes if n.op != "placeholder")
    buffers: dict[str, str] = {}

    def attr(name: str, t: torch.Tensor) -> fx.Node:
        attr_name = f"_offload_{name}"
        gm.register_buffer(attr_name, t)
        buffers[name] = attr_name
        if hasattr(gm, "_param_name_to_source"):
            # AOT maps every lifted parameter/buffer of a Dynamo graph to a Dynamo source
            from torch._dynamo.source import ConstantSource

            gm._param_name_to_source[attr_name] = ConstantSource(f"offload_state.{attr_name}")
        with g.inserting_before(first):
            return g.get_attr(attr_name)

    before = {s.layer: [s.producer.name, s.gather.name, s.sfa.name] if s is grp.owner else [s.gather.name, s.sfa.name]
              for grp in groups.groups for s in grp.sites}
    after: dict[int, list[str]] = {}
    sites_out: list[SiteRewrite] = []
    plan_nodes: dict[int, str] = {}
    plans = {p.group_id: p for p in plan.groups}
    gstates = {gs.group_id: gs for gs in state.groups}

    for grp in groups.groups:
        p, gs = plans[grp.group_id], gstates[grp.group_id]
        B, S, K, SBS = p.B, p.S, p.K, p.BS
        meta = {n: attr(f"{n}_g{grp.group_id}", t) for n, t in
                (("pool_ids", gs.pool_ids), ("id_to_slot", gs.id_to_slot), ("lru_counter", gs.lru_counter),
                 ("stats", gs.stats))}
        pools = {}
        for s in grp.sites:
            kv, rope = state.pools[s.layer]
            pools[s.layer] = (attr(f"pool_kv_l{s.layer}", kv), attr(f"pool_rope_l{s.layer}", rope))
        dev = gs.stats.device
        owner = grp.owner
        with g.inserting_before(owner.gather):
            tk = b(aten.view.default, p.topk, [B, S, 1, K])
            pl = b(custom.dsa_plan.default, tk, p.lengths, meta["pool_ids"], meta["id_to_slot"],
                   meta["lru_counter"], raw_seq=S, group_id=grp.group_id, owner_layer=owner.layer)
            plan_n, rec, act = b.item(pl, 0), b.item(pl, 1), b.item(pl, 2)
            # in-graph counters: one-hot count of the six plan kinds, plus the step
            kinds = b(aten.select.int, plan_n, 1, 0)
            eq = b(aten.eq.Tensor, b(aten.unsqueeze.default, kinds, 1),
                   b(aten.arange.default, 6, dtype=torch.int32, device=dev))
            cnt = b(aten.sum.dim_IntList, eq, [0])
            new = b(aten.cat.default, [cnt, b(aten.ones.default, [1], dtype=torch.int64, device=dev)])
            cum = b(aten.add.Tensor, b(aten.select.int, meta["stats"], 0, 1), new)
            b(aten.copy_.default, meta["stats"], b(aten.stack.default, [new, cum]))
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
                with g.inserting_after(cursor):
                    return b(custom.dsa_install.default, rec, gg.sel_kv, gg.sel_rope, gg.sel_table, kv, rp,
                             meta["pool_ids"], meta["id_to_slot"], meta["lru_counter"],
                             raw_seq=S, topk=K, selection_block_size=SBS, metadata_update=md)

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
    return RewriteReport(sites_out, plan_nodes, buffers, before, after)

"""The recipe-form front-end: the graph of cann-recipes' GLM-5.2 modeling (and of models/glm).

Detection: ``passes/detect.py`` (top-k producer → views → ``npu_gather_selection_kv_cache`` → SFA);
planning: ``passes/preconditions.py``. Emission at a site, identity block table: the gather becomes
``dsa_serve`` into the model's own selection buffers (the SFA already reads them), the model's gather
ledger is written for what serve placed (so switching back to the unmodified path is never wrong), and
every use of the gather's result is replaced by the plan's active count. Any other block table (paged
KV): serve places only the pool hits and the gather stays, reading the rest through the table.
Everything else is the shared core (``passes/rewrite.py``).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import fx

from . import _fx
from ._fx import strip_views
from .detect import DetectReport, detect
from .group import GroupReport
from .preconditions import GroupPlan, PlanReport, plan
from .rewrite import GroupNodes, RewriteCtx, SiteRewrite, _Builder, emit_serve, emit_serve_pool, guard, input_name

aten = torch.ops.aten


class RecipeFrontEnd:
    name = "recipe"
    pass_files = {"detect": "passes/detect.py", "plan": "passes/preconditions.py",
                  "emit": "passes/frontend_recipe.py"}

    def detect(self, gm: fx.GraphModule) -> DetectReport:
        return detect(gm)

    def plan(self, gm: fx.GraphModule, grp: GroupReport, example_inputs: Sequence[Any], opts: Any) -> PlanReport:
        return plan(gm, grp, example_inputs, opts)

    def plan_anchor(self, grp: Any) -> fx.Node:
        return grp.owner.gather

    def lengths(self, b: _Builder, p: GroupPlan) -> fx.Node:
        return p.lengths  # full_kv_actual_seq: int32 [B] (checked by the plan step)

    def topk(self, b: _Builder, p: GroupPlan) -> fx.Node:
        return b(aten.view.default, p.topk, [p.B, p.S, 1, p.K])

    def selection(self, ctx: RewriteCtx, grp: Any, p: GroupPlan) -> dict:
        return {l: (geo.sel_kv, geo.sel_rope, geo.sel_table) for l, geo in p.geometry.items()}

    def ledger(self, p: GroupPlan, layer: int) -> Optional[fx.Node]:
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
        (a paged group reads through any table), as the plan step verified them on the example inputs.
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


def _emit_ledger_reset(b: _Builder, geo: Any) -> fx.Node:
    """Without the ledger update (``update_ledger=False``, the NPU modes' default) the ledger still must
    not claim rows serve overwrote: mark it "nothing reusable" (-1, as the model's own reset does), so a
    step through the unmodified module in between gathers every row afresh instead of reusing stale ones.
    One ``[B, S, 1, K+1]`` int32 write per layer."""
    ex = geo.status.meta["example_value"]
    return b(aten.copy_.default, geo.status,
             b(aten.full.default, list(ex.shape), -1, dtype=ex.dtype, device=ex.device))


def _emit_ledger_hits(b: _Builder, geo: Any, gn: GroupNodes, K: int) -> fx.Node:
    """Paged groups: the ledger before the kept gather: position k holds ``topk[k]`` where serve placed a
    pool hit, -1 elsewhere (so the gather keeps exactly the hits and reads the rest through the table)."""
    hit = b(aten.eq.Scalar, b(aten.view.default, gn.kinds, [gn.p.B * gn.p.S, K]), 1)
    vals = b(aten.where.ScalarOther, hit, gn.tk2, -1)
    row = b(aten.cat.default, [vals, b(aten.unsqueeze.default, gn.act, 1)], 1)
    shape = list(geo.status.meta["example_value"].shape)
    return b(aten.copy_.default, geo.status, b(aten.view.default, row, shape))


def _emit_ledger(b: _Builder, geo: Any, gn: GroupNodes, K: int) -> fx.Node:
    """Keep the model's gather ledger valid for what serve placed (position k <- topk[k], then the count)."""
    ar = b(aten.arange.default, K, dtype=torch.int32, device=gn.dev)
    lt = b(aten.lt.Tensor, b(aten.unsqueeze.default, ar, 0), b(aten.unsqueeze.default, gn.act, 1))
    vals = b(aten.where.ScalarOther, lt, gn.tk2, -1)
    row = b(aten.cat.default, [vals, b(aten.unsqueeze.default, gn.act, 1)], 1)
    shape = list(geo.status.meta["example_value"].shape)
    return b(aten.copy_.default, geo.status, b(aten.view.default, row, shape))


RECIPE = RecipeFrontEnd()

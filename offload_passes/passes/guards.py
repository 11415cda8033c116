"""The run-time guards of the rewrite: what the preconditions checked on the example inputs, checked again
on every call (``aten._assert_async``; ``RewriteSettings.in_graph_guards``).

Shapes and dtypes are static in the graph, so Dynamo's own guards recompile on any change; these cover
values: each group's cache lengths in the range its pools were sized for, and the identity layouts of the
block tables the geometry assumed. Each graph input is guarded once. Before / after, per guarded input::

    L = placeholder()                     L = placeholder()
    ...                                   ok = logical_and(all(ge(L, 0)), all(le(L, lim)))
                                          _assert_async.msg(ok, "offload guard: cache lengths ...")
                                          ...
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

from . import _fx
from ._fx import strip_views
from .emit import RewriteCtx, guard, input_name
from .group import Group, GroupReport
from .preconditions import GroupGeometry

__all__ = ["lengths_guard", "table_guards"]

aten = torch.ops.aten


def lengths_guard(ctx: RewriteCtx, grp: Group, p: GroupGeometry, L: fx.Node) -> None:
    """``0 <= L <= min(F, id_range)``: the lengths ``L`` the plan reads fit the caches and the pools' id range."""
    root = strip_views(p.lengths, casts=True)  # the lengths input L is computed from
    if root in ctx.guarded:
        return
    ctx.guarded.add(root)
    # a grown cache (its length the cache's own symbolic size) is bounded by the id range alone
    lim = p.id_range if p.lengths_are_cache_size else min(max(p.geometry[l].F for l in p.layers), p.id_range)
    b = ctx.b
    guard(ctx, L, lambda: b(aten.logical_and.default, b(aten.all.default, b(aten.ge.Scalar, L, 0)),
                            b(aten.all.default, b(aten.le.Scalar, L, lim))),
          f"offload guard: cache lengths {input_name(L)!r} of group {grp.group_id} must be in [0, {lim}] "
          f"(cache capacity / id_range the pools were sized for)")


def table_guards(ctx: RewriteCtx, groups: GroupReport, plans: dict[int, GroupGeometry]) -> None:
    """The identity layouts the offloaded groups' geometry assumed: the full block table of an unpaged group
    (serve reads the full cache as ``[B, F, D]``; a paged group reads through any table) and the selection
    block table (serve writes the selection positionally). A form without tables guards nothing here."""
    for grp in groups.groups:
        p = plans.get(grp.group_id)
        if p is None:
            continue
        for s in grp.sites:
            geo = p.geometry[s.layer]
            if not p.paged and geo.block_table is not None:
                _full_table_guard(ctx, geo.block_table)
            if geo.sel_table is not None:
                _selection_table_guard(ctx, geo.sel_table, p.K // p.BS)


def _first_time_2d(ctx: RewriteCtx, table: fx.Node) -> Any:
    """The example of a 2-D table not guarded yet (marked guarded now); None otherwise."""
    ex = _fx.example(table)
    if ex is None or ex.dim() != 2 or strip_views(table) in ctx.guarded:
        return None
    ctx.guarded.add(strip_views(table))
    return ex


def _full_table_guard(ctx: RewriteCtx, bt: fx.Node) -> None:
    ex = _first_time_2d(ctx, bt)
    if ex is None:
        return
    b = ctx.b
    rows, cols = int(ex.size(0)), int(ex.size(1))
    guard(ctx, bt, lambda: b(aten.all.default, b(aten.eq.Tensor, bt, b(aten.view.default, b(
        aten.arange.default, rows * cols, dtype=ex.dtype, device=ex.device), [rows, cols]))),
        f"offload guard: block table {input_name(bt)!r} is no longer the identity layout "
        f"arange({rows}*{cols}).view({rows}, {cols}) this graph was rewritten for (it reads the "
        f"full cache as [B, F, D]); a graph compiled on any other table reads through the table "
        f"and serves every layout (recompile after torch._dynamo.reset() with the engine's "
        f"table, docs/new-requests.md)")


def _selection_table_guard(ctx: RewriteCtx, st: fx.Node, smax: int) -> None:
    ex = _first_time_2d(ctx, st)
    if ex is None:
        return
    b = ctx.b
    rows = int(ex.size(0))
    guard(ctx, st, lambda: b(aten.all.default, b(aten.eq.Tensor, b(aten.slice.Tensor, st, 1, 0, smax), b(
        aten.view.default, b(aten.arange.default, rows * smax, dtype=ex.dtype, device=ex.device), [rows, smax]))),
        f"offload guard: selection block table {input_name(st)!r} is no longer the identity layout "
        f"arange({rows}*{smax}).view({rows}, {smax}) this graph was rewritten for")

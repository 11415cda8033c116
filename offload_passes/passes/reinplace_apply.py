"""Reinplacing itself, once ``passes/reinplace.py`` has decided: each functional op becomes its in-place op on
the graph state it mutates, its ``copy_`` epilogues go, and a chain's first value is written into its state
early. Before / after, for a mutated input ``P``::

    new = dsa_install_functional(rec, ..., P, ...)      dsa_install(rec, ..., P, ...)
    ...                                            ->    ...
    copy_(P, new[k])
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

from . import _fx
from .reinplace_candidates import Candidate, arg_value, getitems, mutated_args

__all__ = ["apply_seed", "apply_candidate"]

aten = torch.ops.aten


def apply_seed(graph: fx.Graph, x: fx.Node, P: fx.Node, rep: Any) -> None:
    with graph.inserting_after(x):
        cp = graph.call_function(aten.copy_.default, (P, x))
    if "val" in P.meta:
        cp.meta["val"] = P.meta["val"]
    else:
        _fx.set_fake_val(cp)
    x.replace_all_uses_with(P, delete_user_cb=lambda u: u is not cp)
    rep.written_early.append(f"{x.name} -> {P.name}")


def apply_candidate(graph: fx.Graph, c: Candidate, rep: Any) -> None:
    n = c.node
    if c.kind == "twin":
        schema = n.target._schema
        idx = mutated_args(c.inplace._schema)
        current = [arg_value(n, schema, i) for i in idx]  # earlier rewrites may have replaced them
        with graph.inserting_before(n):
            new = graph.call_function(c.inplace, tuple(n.args), dict(n.kwargs))
    else:
        current, new = _apply_auto_functionalized(graph, c)
    # not the HOP's recorded inputs (Inductor constrains a call's layouts by its eager_input_vals)
    skip = {"val"} if c.kind == "twin" else {"val", "eager_input_vals"}
    new.meta.update({k: v for k, v in n.meta.items() if k not in skip})
    val = n.meta.get("val")
    if isinstance(val, (tuple, list)):  # the in-place op returns its unaliased outputs (None: nothing)
        new.meta["val"] = None if not c.leading else val[0] if c.leading == 1 else tuple(val[: c.leading])
    elif val is not None:  # single-output ATen op: the in-place form returns self, same metadata
        new.meta["val"] = val
    else:  # the functional node had no example value: compute one
        _fx.set_fake_val(new)
    for k, hs in enumerate(c.holders):
        for h in hs:
            h.replace_all_uses_with(current[k])
            if h is not n:
                graph.erase_node(h)
    if not c.single:
        gi = getitems(n)
        nret = c.leading if c.kind == "twin" else len(c.inplace._schema.returns)
        for i in range(c.leading):
            for g in gi.get(i, []):
                if nret > 1:
                    g.args = (new, i)
                else:  # the op's one return (or its None when it returns nothing)
                    g.replace_all_uses_with(new)
                    graph.erase_node(g)
    for e in c.epilogues:  # now copy_(P, P): the in-place op already wrote P
        if e.graph is graph:
            e.replace_all_uses_with(e.args[0])
            graph.erase_node(e)
            rep.removed_copies += 1
    if n.users:  # pragma: no cover - every output was re-routed above
        raise RuntimeError(f"reinplace: {n.name} still has users {list(n.users)}")
    graph.erase_node(n)
    name = str(c.inplace)
    rep.reinplaced[name] = rep.reinplaced.get(name, 0) + 1


def _apply_auto_functionalized(graph: fx.Graph, c: Candidate) -> tuple[list[fx.Node], fx.Node]:
    """Call the mutable op itself on the (views of the) mutated inputs."""
    n, op = c.node, c.inplace
    kw = dict(n.kwargs)
    with graph.inserting_before(n):
        if c.kind == "af1":
            current = [kw[nm] for nm in c.names]
        else:
            current = list(kw.pop("_all_bases"))
            kw.pop("_op_schema", None)
            for i in mutated_args(op._schema):
                name = op._schema.arguments[i].name
                kw[name] = _regenerate_view(graph, kw, f"_{name}", current)
        # positional / keyword-only as the schema says (Inductor's lowering normalizes the call)
        args, kwargs = [], {}
        for a in op._schema.arguments:
            if a.name in kw:
                v = kw[a.name]
            elif a.has_default_value():
                v = a.default_value
            else:
                raise RuntimeError(f"reinplace: {n.name} has no value for {op}'s argument {a.name}")
            if a.kwarg_only:
                kwargs[a.name] = v
            else:
                args.append(v)
        return current, graph.call_function(op, tuple(args), kwargs)


def _regenerate_view(graph: fx.Graph, kw: dict, prefix: str, bases: list) -> Any:
    """auto_functionalized_v2's view encoding (``<prefix>_base_index`` + alias / slice / as_strided)
    back to a node on the base."""
    idx = kw.pop(f"{prefix}_base_index")
    if idx is None:
        return None
    base = bases[idx]
    if kw.pop(f"{prefix}_alias", None):
        op, args = aten.alias.default, (base,)
    elif f"{prefix}_storage_offset" in kw:
        size, stride, off = (kw.pop(f"{prefix}_{s}") for s in ("size", "stride", "storage_offset"))
        op, args = aten.as_strided.default, (base, list(size), list(stride), off)
    elif f"{prefix}_slice_dim" in kw:
        dim, start, end = (kw.pop(f"{prefix}_slice_{s}") for s in ("dim", "start", "end"))
        op, args = aten.slice.Tensor, (base, dim, start, end)
    else:
        return base
    view = graph.call_function(op, args)
    bval = base.meta.get("val") if isinstance(base, fx.Node) else None
    if isinstance(bval, torch.Tensor):  # later passes (Inductor's lowering) read example values
        view.meta["val"] = op(bval, *args[1:])
    else:
        _fx.set_fake_val(view)
    return view

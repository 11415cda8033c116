"""The state of one rewritten graph: which tensors are its full caches, and its pools / metadata.

Reads FX nodes (the plans' geometry), so it lives with the passes; ``state.py`` stays free of FX
(model code and the lowerings import it without the passes).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..state import REGISTRY, GroupLayout, OffloadState
from . import _fx

__all__ = ["build_state", "cache_refs"]


def cache_refs(gm: Any, plans: Sequence[Any], example_inputs: Sequence[Any]
               ) -> Optional[tuple[list[list[tuple]], list[list[Any]], Optional[list[list[Optional[int]]]]]]:
    """Per group, per layer the full kv / rope caches as ``("arg", i)`` / ``("const", tensor)`` refs, the
    example tensors, and for caches grown by concatenation (``SiteGeometry.past``) the graph output each
    becomes (the ref is then its past input; None: no grown cache). None when a cache is neither a graph
    input nor an attribute."""
    index = {p: i for i, p in enumerate(_fx.placeholders(gm.graph))}
    outs = _output_index(gm)
    refs: list[list[tuple]] = []
    tensors: list[list[Any]] = []
    grown: list[list[Optional[int]]] = []
    for p in plans:
        r, t, gr = [], [], []
        for l in p.layers:
            geo = p.geometry[l]
            past = getattr(geo, "past", None)
            for node, before in zip((geo.full_kv, geo.full_rope), past or (None, None)):
                if past is not None:  # found by the input it extends; follows the cat output
                    if node not in outs:
                        return None
                    gr.append(outs[node])
                    node = before
                else:
                    gr.append(None)
                ref = _ref(gm, node, index, example_inputs)
                if ref is None:
                    return None
                r.append(ref)
                t.append(example_inputs[ref[1]] if ref[0] == "arg" else ref[1])
        refs.append(r)
        tensors.append(t)
        grown.append(gr)
    if not all(hasattr(x, "data_ptr") for ts in tensors for x in ts):
        return None
    return refs, tensors, (grown if any(j is not None for gr in grown for j in gr) else None)


def _ref(gm: Any, node: Any, index: dict, example_inputs: Sequence[Any]) -> Optional[tuple]:
    root = _fx.strip_views(node)
    if root in index and index[root] < len(example_inputs):
        return ("arg", index[root])
    if _fx.is_graph_input_or_attr(root) and root.op == "get_attr":
        return ("const", _fx.attr_value(gm, root))
    return None


def _output_index(gm: Any) -> dict:
    """Graph node -> its position among the graph's outputs (a node returned as it is)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    vals = out.args[0] if isinstance(out.args[0], (list, tuple)) else (out.args[0],)
    found: dict = {}
    for j, v in enumerate(vals):
        found.setdefault(v, j)
    return found


def _pool_device(plan: Any) -> Optional[str]:
    """The device of the group's selection buffers: the pools go beside them (serve and install read and
    write both), not beside the full caches, which may be pinned host memory. A graph without
    selection buffers of its own (the HF form: they are the rewrite's scratch) computes its top-k where the
    pools go."""
    node = getattr(plan.geometry[plan.owner_layer], "sel_kv", None)
    if node is None:
        node = getattr(plan, "topk", None)
    ex = _fx.example(node) if node is not None else None
    return str(ex.device) if ex is not None else None


def build_state(gm: Any, plans: Sequence[Any], example_inputs: Sequence[Any], graph_id: str,
                state_from_caches: bool) -> OffloadState:
    """The state of one rewritten graph: taken from ``state.REGISTRY`` for the example inputs' full caches
    when ``state_from_caches`` and the caches are graph inputs / attributes (graphs on the same caches share
    it), else private tensors. ``layouts`` / ``cache_refs`` / ``shared`` say how to bind it per call."""
    layouts = [GroupLayout.from_plan(p, _pool_device(p)) for p in plans]
    found = cache_refs(gm, plans, example_inputs)
    if state_from_caches and found is not None:
        state = REGISTRY.bind(graph_id, layouts, found[1])
    else:
        dev = _pool_device(plans[0])
        if dev is None:
            ex = _fx.example(plans[0].geometry[plans[0].owner_layer].full_kv)
            dev = str(ex.device) if ex is not None else None
        state = OffloadState.allocate(graph_id, layouts, device=torch.device(dev) if dev else None)
    state.layouts = layouts
    state.cache_refs = found[0] if found is not None else None
    state.grown = found[2] if found is not None else None
    state.shared = bool(state_from_caches and found is not None)
    return state

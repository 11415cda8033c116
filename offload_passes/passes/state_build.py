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
               ) -> Optional[tuple[list[list[tuple]], list[list[Any]]]]:
    """Per group, per layer the full kv / rope caches as ``("arg", i)`` / ``("const", tensor)`` refs and
    the example tensors; None when a cache is neither a graph input nor an attribute."""
    index = {p: i for i, p in enumerate(_fx.placeholders(gm.graph))}
    refs: list[list[tuple]] = []
    tensors: list[list[Any]] = []
    for p in plans:
        r, t = [], []
        for l in p.layers:
            for node in (p.geometry[l].full_kv, p.geometry[l].full_rope):
                root = _fx.strip_views(node)
                if root in index and index[root] < len(example_inputs):
                    r.append(("arg", index[root]))
                    t.append(example_inputs[index[root]])
                elif _fx.is_graph_input_or_attr(root) and root.op == "get_attr":
                    obj = _fx.attr_value(gm, root)
                    r.append(("const", obj))
                    t.append(obj)
                else:
                    return None
        refs.append(r)
        tensors.append(t)
    if not all(hasattr(x, "data_ptr") for ts in tensors for x in ts):
        return None
    return refs, tensors


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
    state.shared = bool(state_from_caches and found is not None)
    return state

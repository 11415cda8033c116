"""Offload state as graph inputs: the rewritten graph takes its pools / metadata per call (CPU modes).

The state then belongs to the caches, not to the compiled artifact: ``state.StateBinder`` picks, per
call, the tensors bound to the call's full caches and appends them to the inputs.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import fx

from .. import _compat
from ..state import OffloadState

__all__ = ["state_as_inputs", "static_fakes"]


def state_as_inputs(gm: fx.GraphModule, state: OffloadState) -> tuple[fx.GraphModule, list[str]]:
    """A copy of ``gm`` whose state buffers (``_offload_<name>``, ``name`` in ``state.tensors()``) are
    graph inputs appended after the original ones; returns it and the state names in input order.

    A copy: Dynamo keeps using its own graph's placeholders after the backend returns. The buffers are
    removed from ``gm`` so that no compiled artifact holds the pools (they live with the caches).
    """
    names = list(state.tensors())
    attrs = {f"_offload_{n}": n for n in names}
    g = fx.Graph()
    g._codegen = gm.graph._codegen
    env: dict = {}
    out = g.graph_copy(gm.graph, env)
    g.output(out)
    used = _attrs_to_placeholders(g, attrs, state)
    for old, copied in env.items():
        if old.op == "placeholder" and hasattr(old, "_dynamo_source"):
            copied._dynamo_source = old._dynamo_source  # AOT reads Dynamo's metadata (static shapes)
    new = fx.GraphModule(gm, g)
    new.meta.update(gm.meta)
    for a in attrs:
        gm._buffers.pop(a, None)
        if hasattr(gm, "_param_name_to_source"):
            gm._param_name_to_source.pop(a, None)
    if hasattr(gm, "_param_name_to_source"):
        new._param_name_to_source = {k: v for k, v in gm._param_name_to_source.items()
                                     if hasattr(new, k.split(".")[0])}
    return new, used


def _attrs_to_placeholders(g: fx.Graph, attrs: dict[str, str], state: OffloadState) -> list[str]:
    """Replace the ``get_attr`` of each state buffer by a new last placeholder; the state names in order."""
    last = [n for n in g.nodes if n.op == "placeholder"][-1]
    used: list[str] = []
    for n in list(g.nodes):
        if n.op == "get_attr" and n.target in attrs:
            name = attrs[n.target]
            with g.inserting_after(last):
                ph = g.placeholder(f"offload_{name}")
            ph._dynamo_source = None  # not a user value: no Dynamo source, no guard
            t = state.tensors()[name]
            ph.meta["example_value"] = torch.empty_like(t, device="meta")
            n.replace_all_uses_with(ph)
            g.erase_node(n)
            last = ph
            used.append(name)
    return used


def static_fakes(example_inputs: Sequence[Any], tensors: Sequence[torch.Tensor]) -> list:
    """``tensors`` as static-shape fake tensors of the compile's fake mode (AOT would otherwise make
    the extra state inputs dynamic), or as they are outside a fake mode."""
    fm = _compat.detect_fake_mode(example_inputs)
    if fm is None:
        return list(tensors)
    return [fm.from_tensor(t, static_shapes=True) for t in tensors]

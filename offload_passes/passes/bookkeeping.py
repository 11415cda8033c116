"""Bookkeeping removal: the in-graph per-step statistics the reference does not keep (the NPU lowerings
drop them unless ``npu_bookkeeping=True``, ``lowering/npu.py``)."""
from __future__ import annotations

from typing import List, Sequence

from torch import fx

from .. import _compat

__all__ = ["strip_bookkeeping"]


def strip_bookkeeping(gm: fx.GraphModule, stats_attrs: Sequence[str]) -> int:
    """Remove the in-graph per-step statistics (``copy_`` into the ``stats`` buffers and what only feeds
    it). Returns the number of nodes removed. Only pure ATen nodes are removed with it."""
    graph = gm.graph
    attrs = set(stats_attrs)
    roots = [n for n in graph.nodes if "copy_" in str(n.target) and n.args
             and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr" and n.args[0].target in attrs]
    gone: set = set()
    todo: List[fx.Node] = []
    for r in roots:
        todo += r.all_input_nodes
        graph.erase_node(r)
        gone.add(r)
    while todo:
        n = todo.pop()
        if n in gone or n.users or n.op != "call_function":
            continue
        t = n.target
        if not isinstance(t, _compat.OpOverload) or t._schema.is_mutable or t.namespace != "aten":
            continue
        todo += n.all_input_nodes
        graph.erase_node(n)
        gone.add(n)
    for n in [n for n in graph.nodes if n.op == "get_attr" and n.target in attrs and not n.users]:
        graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return len(gone)

"""FX passes (``ge_graph``, ``npugraph_ex``): the model's KV-cache writes made in place on the cache input.

TorchAir has no GE converter for ``index_put`` / ``index_copy``, an out-of-place write copies the whole cache
every step, and GE keeps a write in place only for a ref op straight on a ``Data`` input (docs/platform.md).
After AOT functionalization, per cache write::

    before:     v = view(cache, [-1, D]); w = index_put(v, [slots], kv); copy_(cache, view(w, cache.shape))
    ge_graph:   offload_ge.scatter_nd_update(cache, unravel(slots), kv)  # converter: TensorMove + ScatterNdUpdate,
                                                                         # both dropped by TorchAir: n rows move
    npugraph_ex: index_put_(view(cache, [-1, D]), [slots], kv)

A write whose target is not a graph input becomes the same op on that input, keeping its (needed) copy.
``offload_ge::scatter_nd_update`` is defined here (functional, CPU and fake kernels) since this pass emits it.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
from torch import fx

from .. import _compat

log = logging.getLogger("offload_passes.passes.cache_writes")

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}

from ..custom_ops import ge_scatter  # noqa: F401,E402  (defines offload_ge::scatter_nd_update)


@dataclass
class CacheWriteReport:
    """What a cache-write pass did, by node / graph-input name."""

    in_place: List[str] = field(default_factory=list)     # graph inputs now written in place
    copied: List[str] = field(default_factory=list)       # index writes on intermediates (functional)
    left: List[str] = field(default_factory=list)         # index writes this pass cannot express

    def to_dict(self) -> dict:
        return {"in_place": list(self.in_place), "copied": list(self.copied), "left": list(self.left)}


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def _emit(graph: fx.Graph, target, args: tuple) -> fx.Node:
    """A node with its fake ``meta['val']`` computed from its inputs' (converters need it)."""
    node = graph.call_function(target, args)
    vals = [_val(a) for a in args]
    flat = [v for v in vals if isinstance(v, torch.Tensor)]
    for a in args:
        if isinstance(a, (list, tuple)):
            flat += [_val(x) for x in a if isinstance(_val(x), torch.Tensor)]
    mode = _compat.detect_fake_mode(flat)
    real = [[_val(x) for x in a] if isinstance(a, (list, tuple)) else _val(a) for a in args]
    if mode is not None:
        with mode:
            node.meta["val"] = target(*real)
    else:
        node.meta["val"] = target(*real)
    return node


def _index_write(n: fx.Node) -> Optional[tuple]:
    """``(self, index, values)`` of a single 1-D integer index write on dim 0, else None."""
    if n.target is aten.index_put.default:
        self, indices, values = n.args[:3]
        acc = n.args[3] if len(n.args) > 3 else n.kwargs.get("accumulate", False)
        if acc or len(indices) != 1 or not isinstance(indices[0], fx.Node):
            return None
        idx = indices[0]
    elif n.target is aten.index_copy.default:
        self, dim, idx, values = n.args[:4]
        if _val(self) is None or dim % max(_val(self).dim(), 1) != 0:
            return None
    else:
        return None
    iv = _val(idx)
    if iv is None or iv.dim() != 1 or iv.dtype in (torch.bool, torch.uint8) or iv.is_floating_point():
        return None
    return self, idx, values


def _strip_views(n: fx.Node) -> fx.Node:
    while isinstance(n, fx.Node) and n.target in _VIEWS:
        n = n.args[0]
    return n


def _leading_dims(cache_shape: List[int], flat_shape: List[int]) -> Optional[int]:
    """k such that ``flat_shape == [prod(cache_shape[:k]), *cache_shape[k:]]`` (the write's flattening)."""
    for k in range(1, len(cache_shape) + 1):
        if list(flat_shape[1:]) == list(cache_shape[k:]) and flat_shape[0] == math.prod(cache_shape[:k]):
            return k
    return None


def _unravel(graph: fx.Graph, idx: fx.Node, dims: List[int]) -> fx.Node:
    """``[n]`` flat row index -> ``[n, len(dims)]`` index over ``dims`` (row-major)."""
    if len(dims) == 1:
        return _emit(graph, aten.unsqueeze.default, (idx, -1))
    cols = []
    stride = math.prod(dims)
    for j, d in enumerate(dims):
        stride //= d
        c = _emit(graph, aten.floor_divide.default, (idx, stride)) if stride != 1 else idx
        if j > 0:
            c = _emit(graph, aten.remainder.Scalar, (c, d))
        cols.append(c)
    return _emit(graph, aten.stack.default, (cols, -1))


def _epilogue(write: fx.Node, cache: fx.Node) -> Optional[tuple]:
    """``(copy_ node, the viewed write result it copies)`` when ``write`` is copied back into ``cache``."""
    todo, seen = [write], set()
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if u.target is aten.copy_.default and u.args[0] is cache and u.args[1] is n:
                return u, n
            if u.target in _VIEWS:
                todo.append(u)
    return None


def _erase_dead_views(graph: fx.Graph, nodes: List[fx.Node]) -> None:
    """Erase the views this pass orphaned (only views: never a side-effecting node such as a scope)."""
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if n.target in _VIEWS and not n.users:
            todo += list(n.all_input_nodes)
            graph.erase_node(n)


def _only_feeds(cache: fx.Node, write: fx.Node, copy_node: fx.Node) -> bool:
    """Every reader of ``cache`` (through views) is ``write`` or the epilogue: no one reads the old value."""
    todo = [cache]
    while todo:
        for u in todo.pop().users:
            if u is write or u is copy_node:
                continue
            if u.target not in _VIEWS:
                return False
            todo.append(u)
    return True


def cache_writes_to_scatter_nd(gm: fx.GraphModule) -> CacheWriteReport:
    """Rewrite index writes into ``offload_ge.scatter_nd_update`` (see module doc). Mutates ``gm``."""
    graph = gm.graph
    op = torch.ops.offload_ge.scatter_nd_update.default
    rep = CacheWriteReport()
    for w in [n for n in graph.nodes if n.target in (aten.index_put.default, aten.index_copy.default)]:
        got = _index_write(w)
        if got is None:
            rep.left.append(w.name)
            continue
        self_, idx, values = got
        sv = _val(self_)
        cache = _strip_views(self_)
        ep = _epilogue(w, cache) if cache.op == "placeholder" else None
        k = _leading_dims(list(_val(cache).shape), list(sv.shape)) if ep is not None else None
        # the graph input may be written in place only if nothing else reads its old value
        chain_ok = ep is not None and k is not None and _only_feeds(cache, w, ep[0])
        if chain_ok:
            shape = list(_val(cache).shape)
            with graph.inserting_before(w):
                nd = _unravel(graph, idx, shape[:k])
                rows = _emit(graph, aten.expand.default, (values, [_val(idx).shape[0], *shape[k:]]))
                new = _emit(graph, op, (cache, nd, rows))
                flat = _emit(graph, aten.view.default, (new, list(sv.shape)))
            copy_node, viewed = ep
            for u in list(w.users):
                u.replace_input_with(w, flat)
            copy_node.replace_input_with(viewed, new)
            rep.in_place.append(cache.name)
            extra = [viewed]
        else:
            with graph.inserting_before(w):
                nd = _emit(graph, aten.unsqueeze.default, (idx, -1))
                rows = _emit(graph, aten.expand.default, (values, [_val(idx).shape[0], *sv.shape[1:]]))
                new = _emit(graph, op, (self_, nd, rows))
            w.replace_all_uses_with(new)
            rep.copied.append(w.name)
            extra = []
        dead = list(w.all_input_nodes) + extra
        graph.erase_node(w)
        _erase_dead_views(graph, dead)
    if rep.in_place or rep.copied:
        graph.lint()
        gm.recompile()
        log.debug("cache writes: in place %s, copied %s", rep.in_place, rep.copied)
    if rep.left:
        log.warning("index writes GE cannot convert (no single 1-D integer index on dim 0): %s", rep.left)
    return rep


def cache_writes_in_place(gm: fx.GraphModule) -> CacheWriteReport:
    """npugraph_ex: ``copy_(cache, view(index_put(view(cache), [i], v)))`` -> ``index_put_(view(cache), [i], v)``.

    npugraph_ex's reinplace passes handle only its registry ops, so the functional cache write would copy
    the full cache every step. The in-place ATen op on the graph input's view is the same computation when
    nothing else reads the cache's old value (checked as for GE). Mutates ``gm``; returns what it did.
    """
    graph = gm.graph
    rep = CacheWriteReport()
    inplace = {aten.index_put.default: aten.index_put_.default, aten.index_copy.default: aten.index_copy_.default}
    for w in [n for n in graph.nodes if n.target in inplace]:
        got = _index_write(w)
        cache = _strip_views(w.args[0])
        ep = _epilogue(w, cache) if got is not None and cache.op == "placeholder" else None
        if ep is None or not _only_feeds(cache, w, ep[0]):
            rep.left.append(w.name)
            continue
        copy_node, viewed = ep
        with graph.inserting_before(w):
            node = graph.call_function(inplace[w.target], w.args, w.kwargs)
        node.meta["val"] = w.args[0].meta.get("val")
        w.replace_all_uses_with(w.args[0])  # the view of the cache now holds the written value
        graph.erase_node(w)
        graph.erase_node(copy_node)  # it would copy the cache onto itself
        _erase_dead_views(graph, [viewed])
        rep.in_place.append(cache.name)
    if rep.in_place:
        graph.lint()
        gm.recompile()
        log.debug("cache writes in place (npugraph_ex): %s", rep.in_place)
    return rep

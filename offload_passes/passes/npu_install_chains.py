"""FX passes that prepare the functional graph for npugraph_ex's registry-driven reinplace, which only
reinplaces a functional twin whose mutated arguments are all graph inputs with their own ``copy_``
epilogues (run as its ``post_grad_custom_post_pass``, ``lowering/npu.py::npugraph_ex_config``):

* :func:`split_install_chains`: functionalization chains a group's installs through the shared metadata,
  so none would be reinplaced and every step would copy each pool; a ``metadata_update=0`` install leaves
  the metadata bit-identical (docs/ops.md §4.2), so the next install may read the graph inputs instead;
* :func:`inplace_masked_input_updates`: the new-request invalidation made in place on the input;
* :func:`clone_input_copy_sources`: ``copy_(P, Q)`` with ``Q`` a graph input reads a clone (torch-npu
  2.8.0.post5's reinplace fails on a graph-input source).

Argument and output positions come from the ops' schemas. Each is one walk over the graph.
"""
from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import fx

from ..custom_ops import spec_for
from ._fx import set_fake_val

log = logging.getLogger("offload_passes.passes.npu_install_chains")

@dataclass(frozen=True)
class _InstallSchema:
    """Positions in ``dsa_install_functional`` calls, looked up by name in the op's spec (its schema)."""
    meta: Tuple[Tuple[int, int], ...]  # per metadata tensor: (argument position, output index)
    metadata_update: int               # position of ``metadata_update`` if passed positionally


@functools.lru_cache(maxsize=None)
def _install_schema() -> _InstallSchema:
    spec = spec_for("dsa_install")
    args = spec.arg_names  # the functional twin takes the same arguments
    # the group metadata (its role in the spec) every install names as mutated; a metadata_update=0 install
    # leaves it unchanged. The twin returns the in-place op's own returns, then the mutated arguments in
    # schema order
    return _InstallSchema(tuple((args.index(m), spec.num_leading_outputs + spec.mutated.index(m))
                                for m in spec.args_of("metadata")), args.index("metadata_update"))


def _metadata_update(node: fx.Node, pos: int) -> int:
    if len(node.args) > pos:
        return int(node.args[pos])
    return int(node.kwargs.get("metadata_update", 1))


def _getitems(node: fx.Node) -> Dict[int, fx.Node]:
    return {u.args[1]: u for u in node.users if u.target is operator.getitem}


def _finish(gm: fx.GraphModule, done: int, what: str) -> int:
    """Check and regenerate the module once, after all of a pass's rewrites (none: untouched)."""
    if done:
        gm.graph.lint()
        gm.recompile()
        log.debug(what, done)
    return done


def split_install_chains(gm: fx.GraphModule) -> int:
    """Rewrite metadata chains of ``dsa_install_functional`` nodes (see module doc). Returns rewrites.

    Per ``metadata_update=0`` install whose metadata inputs are graph inputs, before / after::

        i0 = dsa_install_functional(..., pool_ids, ..., metadata_update=0)
        i1 = dsa_install_functional(..., i0[k], ..., metadata_update=1)     # reads i0's metadata output
        copy_(pool_ids, i1[k])
      ->
        i0 = dsa_install_functional(..., pool_ids, ..., metadata_update=0); copy_(pool_ids, i0[k])
        i1 = dsa_install_functional(..., pool_ids, ..., metadata_update=1); copy_(pool_ids, i1[k])
    """
    spec = _install_schema()
    graph = gm.graph
    # one walk: the positions of the nodes present now (new nodes are only ``copy_``s, never looked up)
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    done = 0
    for node in nodes:
        meta = _md0_metadata_inputs(node, spec)
        if meta is None:
            continue
        chained = _chained_installs(node, meta, spec, order)
        if chained:
            _split(graph, node, meta, chained, spec, order)
            done += 1
    return _finish(gm, done, "split %d dsa_install metadata chains")


_INSTALL = torch.ops.custom.dsa_install_functional.default
_COPY = torch.ops.aten.copy_.default


def _md0_metadata_inputs(node: fx.Node, spec: _InstallSchema) -> Optional[List[fx.Node]]:
    """The metadata arguments of a ``metadata_update=0`` install when all are graph inputs; else None."""
    arg_pos = [a for a, _ in spec.meta]
    if node.target is not _INSTALL or _metadata_update(node, spec.metadata_update) != 0 \
            or len(node.args) <= max(arg_pos):
        return None
    meta = [node.args[i] for i in arg_pos]
    if not all(isinstance(m, fx.Node) and m.op in ("placeholder", "get_attr") for m in meta):
        return None
    return meta


def _chained_installs(node: fx.Node, meta: List[fx.Node], spec: _InstallSchema, order: Dict[fx.Node, int]
                      ) -> List[tuple]:
    """``(next install, the metadata output it reads, the graph input)`` for every later install that reads
    ``node``'s metadata outputs; empty when anything else reads them, or reads a metadata input after
    ``node`` (then splitting would change what it sees)."""
    gets = _getitems(node)
    chained: List[tuple] = []
    for (a, k), m in zip(spec.meta, meta):
        g = gets.get(k)
        if g is None:
            continue
        for u in g.users:
            if u.target is _INSTALL and len(u.args) > a and u.args[a] is g \
                    and _metadata_update(u, spec.metadata_update) in (0, 1):
                chained.append((u, g, m))
            elif not (u.target is _COPY and u.args[0] is m):  # other than its own epilogue
                return []
        # nobody but the chain and epilogues may read the graph input after this install
        if any(r.target not in (_INSTALL, _COPY) and order[r] > order[node] for r in m.users):
            return []
    return chained


def _split(graph: fx.Graph, node: fx.Node, meta: List[fx.Node], chained: List[tuple], spec: _InstallSchema,
           order: Dict[fx.Node, int]) -> None:
    """The next installs read the graph inputs; ``node``'s metadata outputs get their own epilogues."""
    for u, g, m in chained:
        u.replace_input_with(g, m)
    gets = _getitems(node)
    anchor = max(gets.values(), key=lambda n: order[n])
    for (_, k), m in zip(spec.meta, meta):
        g = gets.get(k)
        if g is None or any(u.target is _COPY and u.args[0] is m for u in g.users):
            continue
        with graph.inserting_after(anchor):
            c = graph.call_function(_COPY, (m, g))
        c.meta["val"] = m.meta.get("val")
        anchor = c


def inplace_masked_input_updates(gm: fx.GraphModule) -> int:
    """``where(mask, fill, x)`` of a graph input ``x`` whose old value nobody else reads -> ``x.masked_fill_``.

    The rewrite invalidates the pool rows of batch rows that started a new request with
    ``copy_(meta, where(new_row, fill, meta))`` before the plan. After functionalization the plan and the
    installs read that ``where`` (an intermediate), so the registry would refuse to reinplace them (it
    only reinplaces graph inputs) and every step would copy each pool. When the input's only other users
    are its ``copy_`` epilogues, updating it in place first is the same computation. Returns rewrites.
    """
    aten = torch.ops.aten
    copy_ = aten.copy_.default
    graph = gm.graph
    done = 0
    for w in list(graph.nodes):
        if w.target not in (aten.where.ScalarSelf, aten.where.self) or len(w.args) != 3:
            continue
        mask, fill, x = w.args
        if not (isinstance(x, fx.Node) and x.op in ("placeholder", "get_attr") and isinstance(mask, fx.Node)):
            continue
        if isinstance(fill, fx.Node):  # decomposed form: where.self(mask, scalar_tensor(v), x)
            fv = fill.meta.get("val")
            if fv is None or fv.dim() != 0:
                continue
            fill_op = aten.masked_fill_.Tensor
        elif isinstance(fill, (int, float, bool)):
            fill_op = aten.masked_fill_.Scalar
        else:
            continue
        if any(u is not w and not (u.target is copy_ and u.args[0] is x) for u in x.users):
            continue  # someone reads the old value
        xv, wv = x.meta.get("val"), w.meta.get("val")
        if xv is None or wv is None or tuple(xv.shape) != tuple(wv.shape) or xv.dtype != wv.dtype:
            continue
        with graph.inserting_before(w):
            m = graph.call_function(fill_op, (x, mask, fill))
        m.meta["val"] = xv
        w.replace_all_uses_with(x)
        graph.erase_node(w)
        # an epilogue that now copies the input onto itself is a no-op
        for u in list(x.users):
            if u.target is copy_ and u.args[0] is x and u.args[1] is x:
                graph.erase_node(u)
        done += 1
    return _finish(gm, done, "made %d masked input updates in place")


def clone_input_copy_sources(gm: fx.GraphModule) -> int:
    """``copy_(P, Q)`` with ``Q`` a graph input -> ``copy_(P, clone(Q))`` (module doc). Returns rewrites."""
    aten = torch.ops.aten
    graph = gm.graph
    clones: Dict[fx.Node, fx.Node] = {}
    done = 0
    for c in list(graph.nodes):
        if c.target is not aten.copy_.default or len(c.args) != 2:
            continue
        dst, src = c.args
        if not (isinstance(src, fx.Node) and src.op in ("placeholder", "get_attr")) or src is dst:
            continue
        cl = clones.get(src)
        if cl is None:
            with graph.inserting_before(c):
                cl = graph.call_function(aten.clone.default, (src,))
            set_fake_val(cl)  # its own storage: the reinplace's aliasing analysis must not see the input's
            clones[src] = cl
        c.args = (dst, cl)
        done += 1
    return _finish(gm, done, "cloned %d graph-input copy_ sources")

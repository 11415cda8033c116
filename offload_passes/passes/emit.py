"""The emission helpers the rewrite core and a front-end's ``emit_site`` build nodes with.

One :class:`RewriteCtx` per rewrite (the graph, the :class:`RewriteSettings`, the state attributes and
guards emitted so far), one :class:`GroupNodes` per offloaded group; a front-end returns what it emitted
at a site as a :class:`SiteEmission`, which the core files. Imports nothing from ``passes/frontends/``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import fx

from .. import _compat
from ..state import OffloadState
from . import _fx
from ._fx import strip_views
from .preconditions import GroupGeometry

__all__ = ["InstallHook", "RewriteSettings", "SiteRewrite", "SiteEmission", "SelectionBuffers", "Builder", "RewriteCtx", "GroupNodes", "LEDGER_SERVED",
           "input_name", "guard", "state_attr", "emit_serve", "emit_serve_pool"]

aten = torch.ops.aten
custom = torch.ops.custom

#: ``install_hook(graph, install_nodes, layer)`` — called once per layer with the installs placed after it.
InstallHook = Callable[[fx.Graph, list, int], None]


@dataclass(frozen=True)
class RewriteSettings:
    """What one rewrite is asked to do besides its graph (``passes/rewrite.py::rewrite``)."""

    #: keep the model's gather ledger valid after serve (else it is marked served, ``LEDGER_SERVED``)
    update_ledger: bool = True
    #: check every compile-time assumption at run time (``aten._assert_async``; GE has no converter for it)
    in_graph_guards: bool = True
    #: the in-graph new-request invalidation before each plan (``rewrite.invalidate_new_rows``)
    detect_new_requests: bool = True
    #: ``fifo`` installs with ``custom::dsa_install``, ``second_chance`` with ``offload_ref::dsa_install_sc``
    replacement_policy: str = "fifo"
    #: a lowering's hook, handed each layer's installs as they are placed (None: program order)
    install_hook: Optional[InstallHook] = None


@dataclass
class SiteRewrite:
    """What the rewrite did at one layer (a row of ``GraphReport.sites``)."""

    layer: int
    group_id: int
    gather_node: str  # the node the front-end replaced (recipe: the gather; HF: the dense attention)
    sfa_node: str  # the attention that reads the selection (recipe: the SFA; HF: the sparse attention)
    serve_node: Optional[str]
    install_nodes: list[str] = field(default_factory=list)
    kind: Optional[str] = None  # HF: "eager" | "sdpa"

    def to_dict(self) -> dict:
        d = {"layer": self.layer, "group_id": self.group_id, "gather_node": self.gather_node,
             "sfa_node": self.sfa_node, "serve_node": self.serve_node, "install_nodes": list(self.install_nodes)}
        if self.kind is not None:
            d["kind"] = self.kind
        return d


@dataclass
class SiteEmission:
    """What a front-end's ``emit_site`` emitted at one site; the core files it (never the front-end)."""

    replaced: str  # the name of the node the front-end replaced (recipe: the gather; HF: the dense attention)
    attention: fx.Node  # the attention that reads the selection
    serve: Optional[fx.Node]  # the layer's dsa_serve (None: the sparse rewrite without offload)
    nodes: list[fx.Node]  # the layer's nodes after the rewrite, in order, the group's plan excepted
    before: list[str]  # the names of the nodes the rewrite replaces (``GraphReport.layer_nodes["before"]``)
    install_after: fx.Node  # the node the layer's installs go after
    kind: Optional[str] = None  # the front-end's name for the site's attention (HF: "eager" | "sdpa")


class SelectionBuffers(NamedTuple):
    """A layer's selection buffers: serve fills them, the attention and install read them."""

    kv: fx.Node
    rope: fx.Node
    table: fx.Node  # the selection block table (identity layout)


class Builder:
    """Emits ``call_function`` nodes with their fake ``meta["val"]`` (``_fx.set_fake_val``)."""

    def __init__(self, graph: fx.Graph, hints: Sequence[Any] = ()):
        self.g = graph
        self.record: Optional[list] = None  # when a list: every node created is appended to it
        # the example values' fake mode (state get_attr fakes join it): from ``hints`` (nodes with fake
        # values), else from the placeholders (a walk over them)
        self.fake_mode = _fx.fake_mode_of([_fx.example(h) for h in hints]) or _fx.graph_fake_mode(graph)

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        n = self.g.call_function(target, args, kwargs)
        _fx.set_fake_val(n, self.fake_mode)
        if self.record is not None:
            self.record.append(n)
        return n

    def item(self, node: fx.Node, i: int) -> fx.Node:
        n = self.g.call_function(operator.getitem, (node, i))
        _fx.set_fake_val(n, self.fake_mode)
        return n


def input_name(node: Any) -> str:
    """The user-facing name of a graph input (the placeholder / attribute a tensor comes from)."""
    root = strip_views(node, casts=True)
    if isinstance(root, fx.Node):
        return str(root.target) if root.op == "get_attr" else root.name
    return str(root)


def state_attr(gm: fx.GraphModule, name: str, t: torch.Tensor, buffers: dict[str, str],
               before: fx.Node, fake_mode: Any = None) -> fx.Node:
    """Register offload state ``t`` as buffer ``_offload_<name>`` of ``gm`` (recorded in ``buffers``) and
    return a ``get_attr`` node for it, placed before ``before``."""
    attr_name = f"_offload_{name}"
    gm.register_buffer(attr_name, t)
    buffers[name] = attr_name
    if hasattr(gm, "_param_name_to_source"):
        # AOT maps every lifted parameter/buffer of a Dynamo graph to a Dynamo source
        gm._param_name_to_source[attr_name] = _compat.constant_source(f"offload_state.{attr_name}")
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(attr_name)
    _fx.set_fake_val(node, fake_mode)
    return node


@dataclass
class RewriteCtx:
    """One rewrite's graph and settings (what a front-end's ``emit_site`` receives), and the state
    attributes and guards emitted so far."""

    gm: fx.GraphModule
    b: Builder
    first: fx.Node  # the first computing node: state attributes and early guards go before it
    state: Optional[OffloadState]
    settings: RewriteSettings
    buffers: dict[str, str] = field(default_factory=dict)
    guards: list[str] = field(default_factory=list)
    guarded: set[fx.Node] = field(default_factory=set)  # graph inputs already guarded
    scratch: dict[str, Any] = field(default_factory=dict)  # a front-end's per-rewrite notes (nodes to clean up)

    @property
    def g(self) -> fx.Graph:
        return self.gm.graph

    def attr(self, name: str, t: torch.Tensor) -> fx.Node:
        return state_attr(self.gm, name, t, self.buffers, self.first, self.b.fake_mode)


def guard(ctx: RewriteCtx, inp: Any, make: Callable[[], fx.Node], msg: str) -> None:
    """An in-graph check raising ``RuntimeError(msg)`` when ``make()`` (a bool scalar) is false, placed
    right after its input ``inp`` (before the first computing node for a graph input) so that it runs
    before anything the assumption protects."""
    g, b = ctx.g, ctx.b
    late = isinstance(inp, fx.Node) and inp.op not in ("placeholder", "get_attr")
    b.record = []
    try:
        with g.inserting_after(inp) if late else g.inserting_before(ctx.first):
            ok = make()
            node = b(aten._assert_async.msg, ok, msg)
        if late:  # inserting_after puts each new node right after inp (reverse order): re-chain them
            anchor = inp
            for n in b.record:
                anchor.append(n)
                anchor = n
    finally:
        b.record = None
    ctx.guards.append(node.name)


@dataclass
class GroupNodes:
    """The nodes of one offloaded group every layer's serve / install uses."""

    p: GroupGeometry
    meta: dict[str, fx.Node]  # pool_ids, id_to_slot, lru_counter, stats, seen_len, external_write
    pools: dict[int, tuple[fx.Node, fx.Node]]  # layer -> (pool_kv, pool_rope)
    dev: torch.device  # the state's device
    sel: dict[int, SelectionBuffers] = field(default_factory=dict)
    plan: Optional[fx.Node] = None  # the dsa_plan call
    plan_n: Optional[fx.Node] = None  # its outputs: plan, install records, active count
    rec: Optional[fx.Node] = None
    act: Optional[fx.Node] = None
    lengths: Optional[fx.Node] = None  # L [B] int32 of this step
    tk2: Optional[fx.Node] = None  # top-k as [B*S, K] int32
    kinds: Optional[fx.Node] = None  # the plan's kind column [B*S*K] (paged groups)
    plan_pool: Optional[fx.Node] = None  # paged groups: the plan with miss / window rows made "skip"


def emit_serve(ctx: RewriteCtx, gn: GroupNodes, layer: int, full_kv: fx.Node, full_rope: fx.Node) -> fx.Node:
    """``dsa_serve`` of ``layer`` from its pools and full caches (viewed ``[B, F, D]``) into its selection
    buffers (``gn.sel``); inserted at the graph's current insertion point."""
    b, p = ctx.b, gn.p
    geo = p.geometry[layer]
    pkv, prope = gn.pools[layer]
    sel = gn.sel[layer]
    F = geo.F if isinstance(geo.F, int) else -1  # a grown cache: its symbolic length, as the view infers it
    fkv = b(aten.view.default, full_kv, [p.B, F, geo.Dkv])
    frp = b(aten.view.default, full_rope, [p.B, F, geo.Dr])
    return b(custom.dsa_serve.default, gn.plan_n, fkv, frp, pkv, prope, sel.kv, sel.rope,
             raw_seq=p.S, topk=p.K, selection_block_size=p.BS, compact_layout=1)


def emit_serve_pool(ctx: RewriteCtx, gn: GroupNodes, layer: int) -> fx.Node:
    """Paged groups: ``dsa_serve`` of the pool hits only (``gn.plan_pool`` has no full-cache rows, so the
    pools stand in for the full-cache arguments, which are never read)."""
    p = gn.p
    pkv, prope = gn.pools[layer]
    sel = gn.sel[layer]
    return ctx.b(custom.dsa_serve.default, gn.plan_pool, pkv, prope, pkv, prope, sel.kv, sel.rope,
                 raw_seq=p.S, topk=p.K, selection_block_size=p.BS, compact_layout=1)


#: The count column (``status[..., K]``) the rewrite writes into the model's gather ledger when it does not
#: keep the ledger (``update_ledger=False``; ``frontends/recipe.py::_emit_ledger_reset``): with every id
#: column -1 the unmodified model's gather reuses nothing (docs/ops.md §1.4 reads only the id columns;
#: §1.5 reuses nothing for a count <= 0), and it is not the -1 of a model's or an engine's ledger reset,
#: which :func:`invalidate_new_rows` reads as a new request in every mode.
LEDGER_SERVED = -2

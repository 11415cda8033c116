"""The side-stream schedule both stream-aware lowerings share (``lowering/npu.py``, ``lowering/cuda.py``).

Each layer's installs may start once that layer's ``dsa_serve`` has filled the selection buffer they
read (:func:`last_serve`), and the main stream must wait for them before the first later node that
touches what they write or writes what they read, or before a collective (:func:`join_points`).
:class:`SideStreamHook` is the one shape of the lowerings' install hooks: it places each layer's
installs in a side-stream scope right after the serve and the joins when the rewrite is done; a
lowering only says which ops open, close and join a scope. Every argument is read by its role in the
op's OpSpec (``custom_ops/opspec.py`` ``arg_roles``: ``dsa_install`` and ``offload_ref::dsa_install_sc``,
which takes the plan first, alike), never by its position.
"""
from __future__ import annotations

from typing import Any, Hashable, List, NamedTuple, Optional

from torch import fx

from .. import _compat
from ..custom_ops import spec_for
from ..custom_ops.opspec import OpSpec
from ..passes import _fx
from ..passes.manager import CompileContext

__all__ = ["SIDE_STREAM_LABEL", "MC2_OPS", "NPUGRAPH_EX_COLLECTIVES", "SideStreamHook", "side_stream_joins", "is_graph_input", "spec_of",
           "args_in_role", "serve_of", "last_serve", "written_bases", "read_bases", "namespace_and_op",
           "is_collective", "join_points", "move_after_serve", "side_inputs"]

#: The stream label installs run under (npugraph_ex / GE scopes; the CUDA lowering's side stream).
SIDE_STREAM_LABEL = "dsa_offload_install"
#: The op a paged group keeps after its serve (it writes the rest of the selection buffer) and the serve.
_GATHER, _SERVE = spec_for("npu_gather_selection_kv_cache").name, spec_for("dsa_serve").name
#: What an install writes (pools, group metadata) and only reads (plan, records, selection buffers, table).
_WRITES, _READS = ("pool", "metadata"), ("plan", "records", "selection", "selection_table")


def is_graph_input(n: Any) -> bool:
    return isinstance(n, fx.Node) and n.op in ("placeholder", "get_attr")


def _base(n: Any) -> Any:
    return _fx.strip_views(n)


def spec_of(n: fx.Node) -> Optional[OpSpec]:
    """The OpSpec of a call to one of our ops (in-place or functional twin), else None."""
    name = _fx.op_name(n)
    if name is None:
        return None
    try:
        return spec_for(name)
    except KeyError:
        return None


def args_in_role(n: fx.Node, *roles: str) -> list:
    """The arguments of the call ``n`` that have one of ``roles`` in its op's spec (none for other nodes)."""
    spec = spec_of(n)
    if spec is None:
        return []
    bound = _fx.bind(n)
    return [bound[a] for r in roles for a in spec.args_of(r)]


def _selection(n: fx.Node) -> set:
    return {_base(a) for a in args_in_role(n, "selection")}


def serve_of(install: fx.Node) -> Optional[fx.Node]:
    """The serve that filled the selection buffers this install reads (its layer's serve)."""
    sel = _selection(install)
    users = list(dict.fromkeys(u for b in sel if isinstance(b, fx.Node) for u in b.users))
    # a paged group (passes/frontends/recipe.py) keeps the model's gather after the serve: it writes the
    # rest of the selection buffer, so the installs start after it
    for op in (_GATHER, _SERVE):
        for u in users:
            spec = spec_of(u)
            if spec is not None and spec.name == op and _selection(u) & sel:
                return u
    return None


def last_serve(installs: list) -> fx.Node:
    """The serve the installs may start after: that of ``installs[0]``'s layer (the layer the hook is
    called for; the owner's md=1 install that may follow belongs to an earlier serve)."""
    serve = serve_of(installs[0])
    if serve is None:
        raise RuntimeError(f"no dsa_serve found for the installs {[i.name for i in installs]}")
    return serve


def written_bases(n: fx.Node) -> set:
    """Graph tensors ``n`` writes in place (through views): mutable schema args, ``x.op_()`` methods."""
    out = set()
    if n.op == "call_method" and str(n.target).endswith("_") and n.args:
        out.add(_base(n.args[0]))
    elif n.op == "call_function":
        t = n.target
        if "record_tagged_stream" in str(t):
            return out  # declared (a!) but only registers the tensor with a stream
        if isinstance(t, _compat.OpOverloadPacket):
            t = getattr(t, t.overloads()[0])
        if isinstance(t, _compat.OpOverload):
            for i, a in enumerate(t._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
                    if isinstance(v, fx.Node):
                        out.add(_base(v))
        elif getattr(t, "__name__", "").endswith("_") and n.args:  # e.g. torch.Tensor.index_put_
            out.add(_base(n.args[0]))
    return out


def read_bases(n: fx.Node) -> set:
    return {_base(a) for a in n.all_input_nodes}


#: MC2's MoE dispatch / combine (any namespace): collectives too.
MC2_OPS = ("npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2")
#: What npugraph_ex decomposes ``_c10d_functional.all_to_all_single`` into (its HCOM all-to-all op).
NPUGRAPH_EX_COLLECTIVES = {("npu_define", "all_to_all_single_npu"): "all_to_all_single"}


def namespace_and_op(n: fx.Node) -> tuple:
    """``(namespace, op)`` of a call to a torch op (overload or packet), else ``("", "")``."""
    t = n.target
    if isinstance(t, _compat.OpOverload):
        qual = t.name()
    elif isinstance(t, _compat.OpOverloadPacket):
        qual = t._qualified_op_name
    else:
        return "", ""
    ns, _, op = qual.partition("::")
    return ns, op.split(".")[0]


def is_collective(n: fx.Node) -> bool:
    """A ``_c10d_functional`` collective (``wait_tensor`` excluded) or an MC2 dispatch / combine.

    Every rank must issue its collectives in the same order, so no side-stream scope may contain one
    and every join is placed before the first collective after its scope (multi-rank decode graphs).
    """
    if n.op != "call_function":
        return False
    ns, op = namespace_and_op(n)
    return (ns == "_c10d_functional" and op != "wait_tensor") or op in MC2_OPS or (ns, op) in NPUGRAPH_EX_COLLECTIVES


class _Scope(NamedTuple):
    exit: fx.Node  # the node that ends the scope
    writes: set  # what its installs write (pools, metadata), views stripped
    reads: set  # what they only read (plan, records, selection buffers, table)
    tag: Hashable


class _OpenScopes:
    """The scopes not joined yet, with the union of what they write and read (a node is checked against
    the unions before the scopes one by one)."""

    def __init__(self) -> None:
        self.open: List[_Scope] = []
        self.writes: set = set()
        self.reads: set = set()

    def __bool__(self) -> bool:
        return bool(self.open)

    def add(self, s: _Scope) -> None:
        self.open.append(s)
        self.writes |= s.writes
        self.reads |= s.reads

    def join_all(self, n: fx.Node) -> dict:
        """Every open scope joins before ``n``."""
        out = {s.tag: n for s in self.open}
        self._keep([])
        return out

    def join_hazards(self, n: fx.Node) -> dict:
        """The open scopes ``n`` conflicts with (it reads or writes what they write, or writes what they
        read) join before ``n``."""
        w, r = written_bases(n), read_bases(n)
        if not ((w & (self.writes | self.reads)) or (r & self.writes)):
            return {}
        hit = [s for s in self.open if (w & (s.writes | s.reads)) or (r & s.writes)]
        self._keep([s for s in self.open if s not in hit])
        return {s.tag: n for s in hit}

    def _keep(self, scopes: List[_Scope]) -> None:
        self.open = scopes
        self.writes = set().union(*(s.writes for s in scopes))
        self.reads = set().union(*(s.reads for s in scopes))


def _scope_step(n: fx.Node) -> int:
    """+1 for a node that opens a side-stream scope, -1 for one that closes it, 0 otherwise."""
    name = str(n.target)
    return 1 if name.endswith("scope_enter.default") else -1 if name.endswith("scope_exit.default") else 0


def join_points(graph: fx.Graph, pending: List[tuple]) -> dict:
    """For each ``(installs, scope_exit, tag)``: the node before which the main stream must wait for the
    installs — the first later main-stream node that reads or writes what they write (pools, metadata)
    or writes what they read (records, selection buffers), or is a collective (:func:`is_collective`:
    the side stream never runs across one), else the graph output (the next step's plan and serves are
    the next call). One walk over the graph."""
    exits = {}
    for installs, ex, tag in pending:
        exits[ex] = _Scope(ex, {_base(a) for i in installs for a in args_in_role(i, *_WRITES)},
                           {_base(a) for i in installs for a in args_in_role(i, *_READS)}, tag)
    out: dict = {}
    scopes = _OpenScopes()
    depth = 0
    for n in graph.nodes:
        if n in exits:
            scopes.add(exits[n])
        if n.op == "output":
            out.update(scopes.join_all(n))
            break
        step = _scope_step(n)
        depth += step
        if step or depth or not scopes:  # inside a scope the side stream's own nodes need no join
            continue
        if is_collective(n):
            out.update(scopes.join_all(n))
        elif n.op in ("call_function", "call_method"):
            out.update(scopes.join_hazards(n))
    return out


def move_after_serve(installs: list) -> fx.Node:
    """Move ``installs`` (in program order: the layer's md=0 installs, then the owner's md=1) right after
    their layer's serve, so the side stream can start as soon as that serve is done; returns the serve."""
    serve = last_serve(installs)
    anchor = serve
    for inst in installs:
        anchor.append(inst)
        anchor = inst
    return serve


def side_inputs(installs: list) -> List[fx.Node]:
    """The main-stream intermediates the installs read (the plan's install records), each once: the
    allocator must not reuse them before the side stream is done with them."""
    seen: List[fx.Node] = []
    for inst in installs:
        for a in inst.args:
            if isinstance(a, fx.Node) and not is_graph_input(a) and a not in seen:
                seen.append(a)
    return seen


class SideStreamHook:
    """The one shape of a stream-aware lowering's install hook (the rewrite's ``install_hook``, then
    :meth:`finish` once the rewrite is done).

    Per layer: its installs move right after its serve (:func:`move_after_serve`), between the nodes
    :meth:`open` and :meth:`close` emit (the scope on the side stream); :meth:`finish` places each scope's
    join (:meth:`join`: the main stream waits) before the first later node that needs it
    (:func:`join_points`). A lowering says only which ops open, close and join a scope:
    ``lowering.npu.AclInstallHook`` (npugraph_ex's tagged events), ``lowering.npu.GeInstallHook``
    (TorchAir's ``air`` records; GE joins at the end of a run, so it overrides :meth:`finish`),
    ``lowering.cuda.CudaInstallHook`` (the ``offload_cuda`` stream ops).
    """

    def __init__(self) -> None:
        self.pending: List[tuple] = []  # (installs, the scope's exit node, tag)

    def tag(self, layer: int) -> Hashable:
        """The key of ``layer``'s scope (its events, its join)."""
        raise NotImplementedError

    def open(self, graph: fx.Graph, tag: Hashable, reads: List[fx.Node]) -> None:
        """Emit, in order, what runs before the first install: the side stream waits for the main stream;
        ``reads`` are the main-stream intermediates the installs read (the allocator must keep them)."""
        raise NotImplementedError

    def close(self, graph: fx.Graph, tag: Hashable) -> fx.Node:
        """Emit, in order, what runs after the last install; return the node that ends the scope."""
        raise NotImplementedError

    def join(self, graph: fx.Graph, tag: Hashable) -> None:
        """Emit the main stream's wait for the scope ``tag``."""
        raise NotImplementedError

    def __call__(self, graph: fx.Graph, installs: list, layer: int) -> None:
        tag = self.tag(layer)
        reads = side_inputs(installs)
        # the whole block goes right after the serve: the side stream starts when serve is done and
        # runs beside the layer's attention (and MoE) on the main stream
        move_after_serve(installs)
        with graph.inserting_before(installs[0]):
            self.open(graph, tag, reads)
        with graph.inserting_before(installs[-1].next):
            exit_node = self.close(graph, tag)
        self.pending.append((installs, exit_node, tag))

    def finish(self, graph: fx.Graph) -> List[str]:
        """Place each scope's join; returns the names of the nodes joined before."""
        points = join_points(graph, self.pending)
        where = []
        for _, _, tag in self.pending:
            point = points[tag]
            with graph.inserting_before(point):
                self.join(graph, tag)
            where.append(point.name)
        self.pending.clear()
        return where


def side_stream_joins(ctx: CompileContext) -> Optional[List[str]]:
    """The lowering pass after the rewrite: the joins of the side-stream scopes the install hook opened
    (:meth:`SideStreamHook.finish`); ``report.side_stream`` says whether the installs run on a side stream,
    ``report.joins_before`` before which nodes the main stream waits for them."""
    hook = ctx.install_hook
    ctx.report.side_stream = isinstance(hook, SideStreamHook) and ctx.state is not None
    if not ctx.report.side_stream:
        return None
    ctx.report.joins_before = hook.finish(ctx.gm.graph)
    ctx.gm.recompile()
    return ctx.report.joins_before

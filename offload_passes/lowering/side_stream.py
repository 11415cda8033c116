"""The side-stream schedule both stream-aware lowerings share (``lowering/npu.py``, ``lowering/cuda.py``).

Each layer's installs may start once that layer's ``dsa_serve`` has filled the selection buffer they
read (:func:`last_serve`), and the main stream must wait for them before the first later node that
touches what they write or writes what they read, or before a collective (:func:`join_points`). The
install's argument roles come from its OpSpec (``custom_ops/dsa_install.py``), so a schema change moves
them here too.
"""
from __future__ import annotations

from typing import Any, List, Optional

from torch import fx

from .. import _compat
from ..custom_ops import spec_for

__all__ = ["SIDE_STREAM_LABEL", "MC2_OPS", "NPUGRAPH_EX_COLLECTIVES", "is_graph_input", "serve_of", "last_serve",
           "written_bases", "read_bases", "namespace_and_op", "is_collective", "join_points", "move_after_serve",
           "side_inputs"]

#: The stream label installs run under (npugraph_ex / GE scopes; the CUDA lowering's side stream).
SIDE_STREAM_LABEL = "dsa_offload_install"


def is_graph_input(n: Any) -> bool:
    return isinstance(n, fx.Node) and n.op in ("placeholder", "get_attr")


_INSTALL, _SERVE = spec_for("dsa_install"), spec_for("dsa_serve")
#: Install arguments (positional, schema order) the install writes (pools and group metadata) / only
#: reads (records, selection buffers and table): from the op's schema.
_INSTALL_WRITES = _INSTALL.mutated_positions
_INSTALL_READS = tuple(_INSTALL.arg_names.index(a) for a in (
    "install_records", "selection_kv_cache", "selection_k_rope", "selection_kv_block_table"))
_INSTALL_SELECTION = _INSTALL.arg_names.index("selection_kv_cache")
_SERVE_SELECTION = _SERVE.arg_names.index("selection_kv_cache")


def _base(n: Any) -> Any:
    from ..passes import _fx

    return _fx.strip_views(n)


def serve_of(install: fx.Node) -> Optional[fx.Node]:
    """The serve that filled the selection buffer this install reads (its layer's serve)."""
    sel = _base(install.args[_INSTALL_SELECTION])
    # a paged group (passes/frontends/recipe.py) keeps the model's gather after the serve: it writes the
    # rest of the selection buffer, so the installs start after it
    for u in sel.users:
        if "npu_gather_selection_kv_cache" in str(u.target) and any(_base(a) is sel for a in u.args[:2]):
            return u
    for u in sel.users:
        if "dsa_serve" in str(u.target) and len(u.args) > _SERVE_SELECTION and _base(u.args[_SERVE_SELECTION]) is sel:
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


def join_points(graph: fx.Graph, pending: List[tuple]) -> dict:
    """For each ``(installs, scope_exit, tag)``: the node before which the main stream must wait for the
    installs — the first later main-stream node that reads or writes what they write (pools, metadata)
    or writes what they read (records, selection buffers), or is a collective (:func:`is_collective`:
    the side stream never runs across one), else the graph output (the next step's plan and serves are
    the next call). One walk over the graph."""
    hazards = []  # (exit node, writes, reads, tag)
    for installs, ex, tag in pending:
        writes = {_base(i.args[k]) for i in installs for k in _INSTALL_WRITES if k < len(i.args)}
        reads = {_base(i.args[k]) for i in installs for k in _INSTALL_READS if k < len(i.args)}
        hazards.append((ex, writes, reads, tag))
    exits = {h[0]: h for h in hazards}
    out: dict = {}
    open_: List[tuple] = []
    all_w: set = set()
    all_r: set = set()
    depth = 0
    for n in graph.nodes:
        name = str(n.target)
        if n in exits:
            open_.append(exits[n])
            all_w |= exits[n][1]
            all_r |= exits[n][2]
        if n.op == "output":
            for h in open_:
                out[h[3]] = n
            break
        if name.endswith("scope_enter.default"):
            depth += 1
        elif name.endswith("scope_exit.default"):
            depth -= 1
        elif depth == 0 and open_ and is_collective(n):
            for h in open_:
                out[h[3]] = n
            open_, all_w, all_r = [], set(), set()
        elif depth == 0 and open_ and n.op in ("call_function", "call_method"):
            w, r = written_bases(n), read_bases(n)
            if (w & (all_w | all_r)) or (r & all_w):
                hit = [h for h in open_ if (w & (h[1] | h[2])) or (r & h[1])]
                for h in hit:
                    out[h[3]] = n
                open_ = [h for h in open_ if h not in hit]
                all_w = set().union(*(h[1] for h in open_))
                all_r = set().union(*(h[2] for h in open_))
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

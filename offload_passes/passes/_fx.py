"""Small FX helpers shared by the passes (op names, schema binding, view chains, example values)."""
from __future__ import annotations

import contextlib
import gc
import operator
from collections import Counter
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch
from torch import fx

from .. import _compat
from .._compat import OpOverload, OpOverloadPacket
from ..custom_ops import OP_SPECS
from ..custom_ops.opspec import counted_names, schema_binder
from ._targets import getitem_of, op_name  # noqa: F401  (part of the helpers the passes import from here)
from .producers import PRODUCER_NAMES

#: Short names count_ops reports (derived from the op specs).
COUNTED_OPS: frozenset[str] = counted_names(OP_SPECS)

# Ops that only reinterpret a tensor (no data movement): followed when tracing data flow.
VIEW_METHODS = {"view", "reshape", "unsqueeze", "squeeze", "contiguous", "flatten", "view_as", "reshape_as"}
VIEW_FUNCTIONS = {torch.reshape, torch.unsqueeze, torch.squeeze, torch.flatten}
VIEW_ATEN = {"aten::view", "aten::reshape", "aten::_unsafe_view", "aten::unsqueeze", "aten::squeeze",
             "aten::alias", "aten::flatten"}
# Casts that keep integer values (full_kv_actual_seq may be cast per layer by the model).
CAST_METHODS = {"to", "int", "long", "type"}


def is_op(node: fx.Node, short: str, namespaces: Iterable[str] | None = None) -> bool:
    name = op_name(node)
    if name is None:
        return False
    ns, _, nm = name.partition("::")
    return nm == short and (namespaces is None or ns in namespaces)


def calls(n: Any, name: str) -> bool:
    """``n`` calls ``name`` as a Tensor method, a Python function of that name (``torch.topk``) or an op of
    that short name in any namespace (a graph before or after AOT)."""
    if not isinstance(n, fx.Node):
        return False
    if n.op == "call_method":
        return n.target == name
    if n.op == "call_function":
        if getattr(n.target, "__name__", None) == name:
            return True
        on = op_name(n)
        return on is not None and on.split("::")[-1] == name
    return False


def schema_of(node: fx.Node) -> torch.FunctionSchema:
    t = node.target
    if isinstance(t, OpOverloadPacket):
        t = getattr(t, t.overloads()[0])
    return t._schema


def bind(node: fx.Node) -> dict[str, Any]:
    """Argument name -> value (fx.Node, constant or default) following the op's schema (the ops' one binder,
    ``custom_ops/opspec.py`` ``Binder``: a node that does not bind raises ``OpArgumentError``)."""
    b = schema_binder(schema_of(node))
    return dict(zip(b.names, b(node.args, node.kwargs)))


def is_view(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in VIEW_METHODS
    if node.op == "call_function":
        if node.target in VIEW_FUNCTIONS:
            return True
        return op_name(node) in VIEW_ATEN
    return False


def is_cast(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target in CAST_METHODS or op_name(node) in (
        "aten::_to_copy", "aten::to")


def strip_views(node: Any, casts: bool = False) -> Any:
    """Follow reinterpreting ops (and integer casts with ``casts``) back to the producing node."""
    while isinstance(node, fx.Node) and (is_view(node) or (casts and is_cast(node))):
        node = node.args[0]
    return node


def view_users(node: fx.Node) -> list[fx.Node]:
    """Non-view users of ``node`` reached through chains of views."""
    out, todo, seen = [], list(node.users), set()
    i = 0
    while i < len(todo):  # breadth first, without list.pop(0)
        u = todo[i]
        i += 1
        if u in seen:
            continue
        seen.add(u)
        if is_view(u) and u.args and u.args[0] is not None:
            todo.extend(u.users)
        else:
            out.append(u)
    return out


def ancestors(node: fx.Node, limit: int = 64) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [node]
    while todo and len(seen) < limit:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def example(node: Any) -> Optional[torch.Tensor]:
    """The (fake) example value of a node (Dynamo: ``example_value``, AOT/Inductor: ``val``)."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("example_value", node.meta.get("val"))
    return v if isinstance(v, torch.Tensor) else None


def placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def is_graph_input_or_attr(node: Any) -> bool:
    """A tensor the graph does not compute: a placeholder, or a ``get_attr`` — how module buffers
    (caches, block tables, ledgers) arrive when Dynamo does not inline built-in nn modules (torch
    2.8 with ``inline_inbuilt_nn_modules = False``, as the reference compiles), and how our state
    buffers appear after the rewrite."""
    return isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr")


def attr_value(gm: fx.GraphModule, node: fx.Node) -> Any:
    """The object a ``get_attr`` node reads (its dotted target resolved on ``gm``); None if missing."""
    obj: Any = gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def hoist_attrs(graph: fx.Graph) -> int:
    """Move every ``get_attr`` node up to just after the placeholders (always valid: it has no inputs),
    so that a pass may use any graph input or module buffer at any point, whichever form Dynamo gave
    the buffers (without inlining, Dynamo emits each ``get_attr`` where it is first used). Returns the
    number of nodes moved."""
    phs = placeholders(graph)
    anchor: Optional[fx.Node] = phs[-1] if phs else None
    moved = 0
    for n in list(graph.nodes):
        if n.op != "get_attr":
            continue
        if anchor is None:
            first = next(iter(graph.nodes))
            if first is not n:
                first.prepend(n)
                moved += 1
        elif anchor.next is not n:
            anchor.append(n)
            moved += 1
        anchor = n
    return moved


def input_values(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[fx.Node, torch.Tensor]:
    """Tensor value of every placeholder (from ``example_inputs``, by position) and every tensor
    ``get_attr`` (the module attribute) of ``gm``'s graph: the real values when the backend sees them."""
    out = {p: t for p, t in zip(placeholders(gm.graph), example_inputs) if isinstance(t, torch.Tensor)}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            v = attr_value(gm, n)
            if isinstance(v, torch.Tensor):
                out[n] = v
    return out


def count_ops(graph: fx.Graph, targets: Sequence[Any] = ()) -> dict[Any, int]:
    """Counts of our offload and decode-path ops (``custom_ops`` specs with those roles, and every top-k
    producer of ``producers.TOPK_PRODUCERS``), keyed by the short op name in any namespace. With
    ``targets`` (op overloads, any callables): the calls of exactly those, keyed by target (a pass test
    counts what it rewrites before and after)."""
    if targets:
        calls_of = Counter(n.target for n in graph.nodes if n.op == "call_function")
        return {t: calls_of.get(t, 0) for t in targets}
    interesting = COUNTED_OPS | PRODUCER_NAMES
    c: Counter = Counter()
    for n in graph.nodes:
        name = op_name(n)
        if name:
            short = name.split("::")[-1]
            if short in interesting:
                c[short] += 1
    return {k: c.get(k, 0) for k in sorted(interesting)}


def graph_code(gm_or_graph: Any) -> str:
    if isinstance(gm_or_graph, fx.GraphModule):
        try:
            return gm_or_graph.print_readable(print_output=False)
        except Exception:  # pragma: no cover - print_readable on odd modules
            return gm_or_graph.code
    return gm_or_graph.python_code("self").src


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Run a pass with Python's cyclic garbage collector paused (restored on exit, even on error).

    A pass allocates a few thousand objects on top of the ~10^6 that Dynamo / AOT keep alive for a
    large graph; whichever code crosses the allocation threshold pays a full generation-2 sweep of
    that whole heap (~1.5 s for 78 GLM layers). Pausing moves the sweep to the compiler code after the
    pass (same total compile time) instead of charging it, at random, to the pass; the pass itself
    creates no garbage cycles that need collecting meanwhile.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def fake_mode_of(values: Iterable[Any]) -> Any:
    """The fake mode of the first fake tensor among ``values`` (nested lists / tuples included)."""
    for v in values:
        if isinstance(v, (list, tuple)):
            m = fake_mode_of(v)
        else:
            m = getattr(v, "fake_mode", None) if isinstance(v, torch.Tensor) else None
        if m is not None:
            return m
    return None


def graph_fake_mode(graph: fx.Graph) -> Any:
    """The fake mode of the graph's example values (its placeholders'; Dynamo's tracing mode), or None.
    Not ``detect_fake_mode``: inside a backend that returns the compile's fresh mode, not the graph's."""
    vals = []
    for n in graph.nodes:
        if n.op != "placeholder":
            break
        vals.append(n.meta.get("val", n.meta.get("example_value")))
    return fake_mode_of(vals)


def set_fake_val(node: fx.Node, fake_mode: Any = None) -> Any:
    """Give a node a pass created ``meta["val"]``, as Inductor's FX helpers do: a ``call_function`` runs
    its target on its inputs' fake values (``val`` / ``example_value``) under their fake mode, a
    ``get_attr`` gets its module attribute as a fake of ``fake_mode`` (default: the graph's). Returns the
    value; leaves ``val`` unset (None) when an input has no fake value or no fake mode is found (e.g. a
    symbolically traced graph)."""
    gm = node.graph.owning_module
    if node.op == "get_attr":
        t = attr_value(gm, node) if gm is not None else None
        mode = fake_mode or graph_fake_mode(node.graph)
        if not isinstance(t, torch.Tensor) or mode is None:
            return None
        # static: a buffer of known shape, no new symbols in the graph's shape env (it guards them)
        val = t if getattr(t, "fake_mode", None) is mode else mode.from_tensor(t, static_shapes=True)
    elif node.op == "call_function":
        missing: list = []

        def fake(a: fx.Node) -> Any:
            v = a.meta.get("val", a.meta.get("example_value"))
            if v is None and a.op == "get_attr":
                v = set_fake_val(a, fake_mode)
            if v is None and a.op != "call_function":  # (a call may return None: an in-place op)
                missing.append(a)
            return v

        args, kwargs = fx.node.map_arg((node.args, node.kwargs), fake)
        mode = fake_mode_of(list(args) + list(kwargs.values())) or fake_mode
        if missing or mode is None:
            return None
        with mode:
            try:
                val = node.target(*args, **kwargs)
            except RuntimeError as e:
                if "symbolic sizes/strides" not in str(e):
                    raise
                val = _rerun_on_2_8(node.target, args, kwargs)
    else:
        return None
    node.meta["val"] = val
    return val


def _rerun_on_2_8(target: Any, args: Any, kwargs: Any) -> Any:
    """torch 2.8 only: its C++ meta kernels of ``view`` and kin read ``numel()`` of a fake with symbolic
    sizes. Rerun on plain-shaped stand-ins where every size is specialised by now (``_compat.static_fake``),
    else through the Python meta kernels (``_compat.python_dispatcher``: sizes that stay symbolic, a cache
    grown by concatenation)."""
    plain = fx.node.map_aggregate((args, kwargs), _static_or_same)
    try:
        return target(*plain[0], **plain[1])
    except RuntimeError as e:
        if "symbolic sizes/strides" not in str(e):
            raise
    with _compat.python_dispatcher():
        return target(*args, **kwargs)


def _static_or_same(v: Any) -> Any:
    s = _compat.static_fake(v)
    return v if s is None else s


_INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv}


def written_inputs(node: fx.Node) -> list[Any]:
    """The argument nodes ``node`` writes in place: ``Tensor(a!)`` schema arguments, ``x.op_()`` methods,
    ``torch.Tensor.op_`` functions and in-place ``operator`` calls."""
    if node.op == "call_method":
        return [node.args[0]] if str(node.target).endswith("_") and node.args else []
    if node.op != "call_function":
        return []
    t = node.target
    if t in _INPLACE_OPERATORS:
        return [node.args[0]] if node.args else []
    if isinstance(t, OpOverloadPacket):
        t = getattr(t, t.overloads()[0])
    if isinstance(t, OpOverload):
        out = []
        for i, a in enumerate(t._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
                if v is not None:
                    out.append(v)
        return out
    name = getattr(t, "__name__", "")
    return [node.args[0]] if name.endswith("_") and not name.startswith("_") and node.args else []


def mutated_placeholders(gm: fx.GraphModule) -> list[int]:
    """Indices of the graph inputs ``gm`` writes in place (through views), in input order."""
    index = {p: i for i, p in enumerate(placeholders(gm.graph))}
    out: set[int] = set()
    for n in gm.graph.nodes:
        for a in written_inputs(n):
            root = strip_views(a)
            if root in index:
                out.add(index[root])
    return sorted(out)

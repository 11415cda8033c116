"""Which nodes of an AOT graph are functional forms of a mutation, what they mutate, and which nodes share
storage: the facts ``passes/reinplace.py`` decides on.

A candidate's mutated-argument positions come from the in-place op's schema (``Tensor(a!)``); its outputs
are the in-place op's unaliased returns, then the new values of the mutated arguments (our twins' contract,
ATen's and ``auto_functionalized``'s). Two nodes alias when their example values share a storage or the
op's schema declares its output a view of its first argument.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import fx

from .. import _compat
from ..custom_ops import OP_SPECS
from ..custom_ops.opspec import reinplace_pairs

__all__ = ["Candidate", "candidate", "inplace_of", "mutated_args", "arg_value", "getitems", "value_of",
           "storage_key", "schema_view_source", "StorageClasses", "same_layout", "ATEN_OUT_OF_PLACE"]

aten = torch.ops.aten
_HOP = torch.ops.higher_order
#: Out-of-place ATen ops that AOT emits for the model's own in-place writes, reinplaced to ``<name>_``.
ATEN_OUT_OF_PLACE = ("index_put", "index_copy", "copy")
#: Our functional twins -> their in-place ops (qualified names, from the op specs).
_OUR_TWINS = {f: inplace for f, (inplace, _) in reinplace_pairs(OP_SPECS).items()}


@dataclass
class Candidate:
    node: fx.Node
    kind: str  # "twin" (functional twin / ATen out-of-place), "af1", "af2"
    inplace: Any  # the in-place OpOverload (twin) or the mutable op (auto_functionalized)
    names: list[str]  # mutated argument names (af2: "_all_bases[i]")
    args: list[Any]  # mutated argument nodes, at analysis time
    leading: int  # outputs before the new values
    single: bool  # the functional form returns the new value itself (not a tuple)
    holders: list[list[fx.Node]] = field(default_factory=list)  # per mutated argument
    owners: list[fx.Node] = field(default_factory=list)  # per mutated argument: the input P
    epilogues: list[fx.Node] = field(default_factory=list)  # copy_ epilogues made redundant
    chain: list[tuple["Candidate", int]] = field(default_factory=list)  # later writers continuing a value
    ok: bool = False
    why: str = ""

    @property
    def chain_only(self) -> bool:
        """The new value continues only into later writers (no epilogue of its own)."""
        return not self.epilogues and bool(self.chain)


def mutated_args(schema: torch.FunctionSchema) -> list[int]:
    return [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def arg_value(node: fx.Node, schema: torch.FunctionSchema, i: int) -> Any:
    return node.args[i] if i < len(node.args) else node.kwargs.get(schema.arguments[i].name)


def inplace_of(target: Any) -> Optional[_compat.OpOverload]:
    """The in-place op whose functional form ``target`` is (twin ``x_functional`` -> ``x``;
    ATen ``index_put`` -> ``index_put_``), when both schemas take the same arguments."""
    if not isinstance(target, _compat.OpOverload):
        return None
    ns, _, name = target._schema.name.partition("::")
    if target._schema.name in _OUR_TWINS:
        ns, _, base = _OUR_TWINS[target._schema.name].partition("::")
    elif name.endswith("_functional"):  # another library's twin following the same convention
        base = name[: -len("_functional")]
    elif ns == "aten" and name in ATEN_OUT_OF_PLACE:
        base = name + "_"
    else:
        return None
    packet = getattr(getattr(torch.ops, ns), base, None)
    op = getattr(packet, target._overloadname, None) if packet is not None else None
    if op is None or not mutated_args(op._schema):
        return None
    if [a.name for a in op._schema.arguments] != [a.name for a in target._schema.arguments]:
        return None
    return op


def getitems(n: fx.Node) -> dict[int, list[fx.Node]]:
    out: dict[int, list[fx.Node]] = {}
    for u in n.users:
        if u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int):
            out.setdefault(u.args[1], []).append(u)
    return out


def candidate(n: fx.Node) -> Optional[Candidate]:
    """What ``n`` mutates if it is a functional form of a mutation (our twin, ATen's out-of-place op,
    ``auto_functionalized`` / ``_v2``); None for any other node."""
    if n.op != "call_function":
        return None
    if n.target is _HOP.auto_functionalized or n.target is _HOP.auto_functionalized_v2:
        return _auto_functionalized(n)
    return _twin(n)


def _auto_functionalized(n: fx.Node) -> Candidate:
    """``auto_functionalized(op, **kw)`` returns ``(out or None, *new values of the mutated arguments)``; v2
    names its mutated bases ``_all_bases``. A reason in ``why`` where it cannot be reinplaced."""
    op = n.args[0] if n.args else None
    v2 = n.target is _HOP.auto_functionalized_v2
    c = Candidate(n, "af2" if v2 else "af1", op, [], [], 0, False)
    if not isinstance(op, _compat.OpOverload):
        c.why = "the mutable operator is not an OpOverload (higher-order op)"
        return c
    schema = op._schema
    c.leading = max(1, len(schema.returns))
    if v2:
        bases = n.kwargs.get("_all_bases", [])
        c.names, c.args = [f"_all_bases[{i}]" for i in range(len(bases))], list(bases)
        c.why = "" if bases else "no mutated base (out= operator)"
    else:
        c.names = [schema.arguments[i].name for i in mutated_args(schema)]
        c.args = [n.kwargs.get(nm) for nm in c.names]
    if any(isinstance(a, (list, tuple)) for a in c.args) or any(
            isinstance(schema.arguments[i].type, torch.ListType) for i in mutated_args(schema)):
        c.why = c.why or "a mutated argument is a tensor list"
    gi = getitems(n)
    c.holders = [gi.get(c.leading + k, []) for k in range(len(c.args))]
    if not schema.returns and any(g.users for g in gi.get(0, [])):
        c.why = c.why or "the None output of an operator returning nothing is used"
    return c


def _twin(n: fx.Node) -> Optional[Candidate]:
    """A functional twin / ATen out-of-place op: its in-place op's unaliased returns, then the new values."""
    op = inplace_of(n.target)
    if op is None:
        return None
    idx = mutated_args(op._schema)
    leading = sum(1 for r in op._schema.returns if r.alias_info is None)
    single = len(n.target._schema.returns) == 1
    c = Candidate(n, "twin", op, [op._schema.arguments[i].name for i in idx],
                  [arg_value(n, n.target._schema, i) for i in idx], leading, single)
    if single:
        c.holders = [[n]]
    else:
        gi = getitems(n)
        c.holders = [gi.get(leading + k, []) for k in range(len(idx))]
    return c


def value_of(n: fx.Node, gm: Optional[fx.GraphModule]) -> Any:
    v = n.meta.get("val", n.meta.get("example_value"))
    if v is None and n.op == "get_attr" and gm is not None:
        obj: Any = gm
        for part in str(n.target).split("."):
            obj = getattr(obj, part, None)
        v = obj
    return v


def storage_key(v: Any) -> Optional[int]:
    if isinstance(v, torch.Tensor) and _compat.has_storage(v):
        try:
            return v.untyped_storage()._cdata
        except Exception:  # pragma: no cover - tensors without a storage object
            return None
    return None


def schema_view_source(n: fx.Node) -> Optional[fx.Node]:
    """The node ``n`` views according to its schema (first argument ``Tensor(a)``, not written),
    or for ``getitem`` of a multi-output view (``split``), that view."""
    if n.op != "call_function":
        return None
    t = n.target
    if t is operator.getitem and isinstance(n.args[0], fx.Node):
        src = n.args[0]
        return src if schema_view_source(src) is not None else None
    if isinstance(t, _compat.OpOverload) and t._schema.arguments:
        a0 = t._schema.arguments[0].alias_info
        if a0 is not None and not a0.is_write and n.args and isinstance(n.args[0], fx.Node):
            return n.args[0]
    return None


class StorageClasses:
    """Union-find over nodes: same storage (example values) or schema-declared view."""

    def __init__(self) -> None:
        self.parent: dict[fx.Node, fx.Node] = {}

    def find(self, x: fx.Node) -> fx.Node:
        p = self.parent.setdefault(x, x)
        while p is not self.parent[p]:
            self.parent[p] = self.parent[self.parent[p]]
            p = self.parent[p]
        self.parent[x] = p
        return p

    def union(self, a: fx.Node, b: fx.Node) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[ra] = rb


def _layout_of(n: Any) -> Optional[tuple]:
    v = n.meta.get("val", n.meta.get("example_value")) if isinstance(n, fx.Node) else None
    if not isinstance(v, torch.Tensor):
        return None
    try:
        return (tuple(v.size()), tuple(v.stride()), v.storage_offset(), v.dtype)
    except Exception:  # pragma: no cover - sparse / nested tensors
        return None


def same_layout(a: Any, b: Any) -> bool:
    ma, mb = _layout_of(a), _layout_of(b)
    return ma is not None and ma == mb

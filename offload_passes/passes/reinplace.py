"""Pass 5 — turn functional ops (+ their ``copy_`` epilogues) back into in-place ops, after AOT.

AOT functionalization rewrites every mutation into a functional op whose result is copied back into
the mutated graph input at the end of the graph (``copy_(P, new)``): our ``custom.*_functional``
twins (through our Functionalize kernels), ATen's out-of-place forms (``index_put``, ``index_copy``,
``copy``) and, for any other mutable custom op, ``auto_functionalized`` / ``auto_functionalized_v2``.
In eager mode each of them would clone its input (a pool, a selection buffer, a full cache) per layer
and step. This pass puts the mutation back in place where that is provably unobservable, following
the rules of Inductor's ``torch/_inductor/fx_passes/reinplace.py``:

* **Aliasing is decided by storage**: nodes alias when their example values (``meta["val"]``, fake
  tensors) share a storage, or when the op's schema declares its output a view of its first argument
  (alias annotation ``Tensor(a)``, covers nodes without example values, e.g. ``get_attr``). No list of
  view ops.
* **Only graph state is reinplaced**: every mutated argument must be (a view of) a graph input or an
  attribute ``P`` — or the new value of ``P`` left by an earlier reinplaced writer (a chain such as
  the install metadata md0 -> md0' -> md1). Intermediates are never reinplaced (TorchAir's multi-output
  reinplace mishandles them, docs/platform.md §4).
* **The graph must write P back**: a ``copy_(P, x)`` epilogue exists (otherwise the program does not
  mutate ``P``: Inductor's "no copy_ back ... cannot re-inplace"), and the op's new value flows into it,
  directly or through a later reinplaced writer of the same chain; a view of ``P`` as mutated argument
  is accepted only when the copy back is layout-preserving (same size/stride/offset on both ends).
* **Nobody sees the old value**: no node after the op reads any alias of ``P``'s old value (directly
  or through any view), except reads after the epilogue of ``P`` itself (they see the final value in
  both programs) and meta-only reads (sizes/strides); no other argument of the op aliases a mutated
  one; mutated arguments have distinct storages; the new value is not a graph output (the caller
  would receive the state buffer itself).
* **Chains that start from a functional update** (``buf.copy_(where(m, -1, buf))`` then in-place
  writers: functionalization drops the ``copy_`` and the first writer mutates the intermediate): the
  intermediate is written into ``P`` right where it is computed (the program's own copy), under the
  same old-value rule, so the writers run in place on ``P`` (:func:`_seeds`, ``written_early``).

Mutated-argument positions come from the in-place op's schema (``Tensor(a!)``), never from tables;
the functional form's outputs are the in-place op's unaliased returns followed by the new values of
the mutated arguments (our twins' contract, ATen's and ``auto_functionalized``'s). Everything else
stays functional and is listed with its reason in :class:`ReinplaceReport`.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import fx

from .. import _compat
from ..custom_ops import OP_SPECS
from ..custom_ops.opspec import reinplace_pairs
from . import _fx

log = logging.getLogger("offload_passes.passes.reinplace")

aten = torch.ops.aten
_HOP = torch.ops.higher_order
#: Out-of-place ATen ops that AOT emits for the model's own in-place writes, reinplaced to ``<name>_``.
ATEN_OUT_OF_PLACE = ("index_put", "index_copy", "copy")
#: Our functional twins -> their in-place ops (qualified names, from the op specs).
_OUR_TWINS = {f: inplace for f, (inplace, _) in reinplace_pairs(OP_SPECS).items()}
# Operators that read only metadata (Inductor's META_ONLY_OPS).
_META_ONLY = {aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default}


@dataclass
class ReinplaceReport:
    reinplaced: dict[str, int] = field(default_factory=dict)  # in-place op -> count
    kept_functional: list[dict] = field(default_factory=list)  # {node, op, reason}
    removed_copies: int = 0  # copy_ epilogues made redundant
    written_early: list[str] = field(default_factory=list)  # "x -> P": chain starts copied into P

    def to_dict(self) -> dict:
        return {"reinplaced": dict(self.reinplaced), "kept_functional": list(self.kept_functional),
                "removed_copies": self.removed_copies, "written_early": list(self.written_early)}


# ----------------------------------------------------------------------------------------------
# candidates: which node mutates what, where its new values are
# ----------------------------------------------------------------------------------------------

@dataclass
class _Cand:
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
    chain: list[tuple["_Cand", int]] = field(default_factory=list)  # later writers continuing a value
    ok: bool = False
    why: str = ""

    @property
    def chain_only(self) -> bool:
        """The new value continues only into later writers (no epilogue of its own)."""
        return not self.epilogues and bool(self.chain)


def _mutated(schema: torch.FunctionSchema) -> list[int]:
    return [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def _arg(node: fx.Node, schema: torch.FunctionSchema, i: int) -> Any:
    return node.args[i] if i < len(node.args) else node.kwargs.get(schema.arguments[i].name)


def _inplace_of(target: Any) -> Optional[_compat.OpOverload]:
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
    if op is None or not _mutated(op._schema):
        return None
    if [a.name for a in op._schema.arguments] != [a.name for a in target._schema.arguments]:
        return None
    return op


def _getitems(n: fx.Node) -> dict[int, list[fx.Node]]:
    out: dict[int, list[fx.Node]] = {}
    for u in n.users:
        if u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int):
            out.setdefault(u.args[1], []).append(u)
    return out


def _candidate(n: fx.Node) -> Optional[_Cand]:
    if n.op != "call_function":
        return None
    if n.target is _HOP.auto_functionalized or n.target is _HOP.auto_functionalized_v2:
        op = n.args[0] if n.args else None
        v2 = n.target is _HOP.auto_functionalized_v2
        c = _Cand(n, "af2" if v2 else "af1", op, [], [], 0, False)
        if not isinstance(op, _compat.OpOverload):
            c.why = "the mutable operator is not an OpOverload (higher-order op)"
            return c
        schema = op._schema
        c.leading = max(1, len(schema.returns))  # auto_functionalized returns (out or None, *new values)
        if v2:
            bases = n.kwargs.get("_all_bases", [])
            c.names = [f"_all_bases[{i}]" for i in range(len(bases))]
            c.args = list(bases)
            if not bases:
                c.why = "no mutated base (out= operator)"
        else:
            idx = _mutated(schema)
            c.names = [schema.arguments[i].name for i in idx]
            c.args = [n.kwargs.get(nm) for nm in c.names]
        if any(isinstance(a, (list, tuple)) for a in c.args) or any(
                isinstance(schema.arguments[i].type, torch.ListType) for i in _mutated(schema)):
            c.why = c.why or "a mutated argument is a tensor list"
        gi = _getitems(n)
        c.holders = [gi.get(c.leading + k, []) for k in range(len(c.args))]
        if not schema.returns and any(g.users for g in gi.get(0, [])):
            c.why = c.why or "the None output of an operator returning nothing is used"
        return c
    op = _inplace_of(n.target)
    if op is None:
        return None
    idx = _mutated(op._schema)
    leading = sum(1 for r in op._schema.returns if r.alias_info is None)
    single = len(n.target._schema.returns) == 1
    c = _Cand(n, "twin", op, [op._schema.arguments[i].name for i in idx],
              [_arg(n, n.target._schema, i) for i in idx], leading, single)
    if single:
        c.holders = [[n]]
    else:
        gi = _getitems(n)
        c.holders = [gi.get(leading + k, []) for k in range(len(idx))]
    return c


# ----------------------------------------------------------------------------------------------
# storage classes
# ----------------------------------------------------------------------------------------------

def _value(n: fx.Node, gm: Optional[fx.GraphModule]) -> Any:
    v = n.meta.get("val", n.meta.get("example_value"))
    if v is None and n.op == "get_attr" and gm is not None:
        obj: Any = gm
        for part in str(n.target).split("."):
            obj = getattr(obj, part, None)
        v = obj
    return v


def _storage_key(v: Any) -> Optional[int]:
    if isinstance(v, torch.Tensor) and _compat.has_storage(v):
        try:
            return v.untyped_storage()._cdata
        except Exception:  # pragma: no cover - tensors without a storage object
            return None
    return None


def _schema_view_source(n: fx.Node) -> Optional[fx.Node]:
    """The node ``n`` views according to its schema (first argument ``Tensor(a)``, not written),
    or for ``getitem`` of a multi-output view (``split``), that view."""
    if n.op != "call_function":
        return None
    t = n.target
    if t is operator.getitem and isinstance(n.args[0], fx.Node):
        src = n.args[0]
        return src if _schema_view_source(src) is not None else None
    if isinstance(t, _compat.OpOverload) and t._schema.arguments:
        a0 = t._schema.arguments[0].alias_info
        if a0 is not None and not a0.is_write and n.args and isinstance(n.args[0], fx.Node):
            return n.args[0]
    return None


class _Classes:
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


def _meta_of(n: Any) -> Optional[tuple]:
    v = n.meta.get("val", n.meta.get("example_value")) if isinstance(n, fx.Node) else None
    if not isinstance(v, torch.Tensor):
        return None
    try:
        return (tuple(v.size()), tuple(v.stride()), v.storage_offset(), v.dtype)
    except Exception:  # pragma: no cover - sparse / nested tensors
        return None


def _same_layout(a: Any, b: Any) -> bool:
    ma, mb = _meta_of(a), _meta_of(b)
    return ma is not None and ma == mb


# ----------------------------------------------------------------------------------------------
# the pass
# ----------------------------------------------------------------------------------------------

@dataclass
class _Graph:
    """What the one walk over the graph finds, and the value classes derived from it."""

    order: dict[fx.Node, int] = field(default_factory=dict)
    uf: _Classes = field(default_factory=_Classes)
    cands: list[_Cand] = field(default_factory=list)
    copies: list[fx.Node] = field(default_factory=list)
    output: Optional[fx.Node] = None
    members: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)  # class root -> nodes
    input_of: dict[fx.Node, fx.Node] = field(default_factory=dict)  # class root -> input owning it
    shared_inputs: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    epilogue: dict[fx.Node, fx.Node] = field(default_factory=dict)  # input P -> first copy_(P, ·)
    # value id (class root) -> (input P it belongs to, writer that produced it or None for P's own value)
    owner: dict[fx.Node, tuple] = field(default_factory=dict)
    values_of: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)  # P -> its value ids
    returned: set = field(default_factory=set)
    by_node: dict[fx.Node, _Cand] = field(default_factory=dict)


def reinplace(graph: fx.Graph) -> ReinplaceReport:
    """Reinplace every functional op of ``graph`` whose mutation is unobservable (module docstring);
    report the others with their reasons."""
    rep = ReinplaceReport()
    a = _scan(graph)
    _value_classes(a)
    seeds = _seeds(a.cands, a.epilogue, a.owner, a.uf)
    _decide(a, seeds)
    for x, P in seeds.items():
        if any(c.ok for c in a.cands if any(arg is x for arg in c.args)):  # else nobody relies on it
            _apply_seed(graph, x, P, rep)
    for c in a.cands:
        if c.ok:
            _apply(graph, c, rep)
        else:
            rep.kept_functional.append({"node": c.node.name, "op": str(c.node.target if c.kind == "twin" else
                                                                      c.inplace), "reason": c.why})
            log.debug("kept %s functional: %s", c.node.name, c.why)
    graph.lint()
    return rep


def _scan(graph: fx.Graph) -> _Graph:
    """The one walk over the graph: order, storage / view classes, candidates, ``copy_`` nodes, output."""
    gm = graph.owning_module
    a = _Graph()
    by_storage: dict[int, fx.Node] = {}
    for i, n in enumerate(graph.nodes):
        a.order[n] = i
        key = _storage_key(_value(n, gm))
        if key is not None:
            if key in by_storage:
                a.uf.union(n, by_storage[key])
            else:
                by_storage[key] = n
        src = _schema_view_source(n)
        if src is not None:
            a.uf.union(n, src)
        if n.op == "output":
            a.output = n
        elif n.op == "call_function" and n.target is aten.copy_.default:
            a.copies.append(n)
        else:
            c = _candidate(n)
            if c is not None:
                a.cands.append(c)
    return a


def _value_classes(a: _Graph) -> None:
    """Value classes before any reinplacing: members, the input owning each, epilogues, graph outputs."""
    for n in a.order:
        a.members.setdefault(a.uf.find(n), []).append(n)
    for n in a.order:
        if _fx.is_graph_input_or_attr(n):
            r = a.uf.find(n)
            if r in a.input_of:
                a.shared_inputs.setdefault(r, [a.input_of[r]]).append(n)
            else:
                a.input_of[r] = n
    for cp in a.copies:
        dst = cp.args[0]
        if _fx.is_graph_input_or_attr(dst) and dst not in a.epilogue:
            a.epilogue[dst] = cp
    a.by_node = {c.node: c for c in a.cands}
    a.owner = {r: (p, None) for r, p in a.input_of.items()}
    a.values_of = {p: [r] for r, p in a.input_of.items()}
    a.returned = set(a.output.all_input_nodes) if a.output is not None else set()


def _decide(a: _Graph, seeds: dict) -> None:
    """Decide every candidate in graph order (seeds taken in order with them); drop what is not needed."""
    pending = sorted(seeds, key=a.order.__getitem__)
    for c in a.cands:
        while pending and a.order[pending[0]] < a.order[c.node]:  # seeds in graph order with the writers
            _take_seed(a, seeds, pending.pop(0))
        if not c.why:
            c.why = _check(c, a.uf, a.members, a.owner, a.values_of, a.shared_inputs, a.epilogue, a.order,
                           a.returned, a.by_node)
        c.ok = not c.why
        if c.ok:  # its new values now live in P's storage
            for k, hs in enumerate(c.holders):
                P = c.owners[k]
                for h in hs:
                    r = a.uf.find(h)
                    if r not in a.owner:
                        a.owner[r] = (P, c)
                        a.values_of[P].append(r)
    for x in pending:  # after every writer: starts no chain
        del seeds[x]
    # a writer whose value only continues into writers that stay functional is not written back
    for c in reversed(a.cands):
        if c.ok and c.chain_only and not any(d.ok for d, _ in c.chain):
            c.ok = False
            c.why = (f"its new value of {[str(p) for p in c.owners]} flows only into "
                     f"{sorted({d.node.name for d, _ in c.chain})}, which stay functional")


def _take_seed(a: _Graph, seeds: dict, x: fx.Node) -> None:
    """Write ``x`` into its ``P`` early unless an old value of ``P`` is read later or ``x`` is returned."""
    P = seeds[x]
    why = _old_value_read(x, P, a.epilogue[P], {a.uf.find(x)}, a.values_of, a.members, a.owner, a.uf, a.order,
                          a.by_node)
    if not why and any(m in a.returned for m in a.members[a.uf.find(x)]):
        why = f"{x.name} is a graph output"
    if why:
        del seeds[x]
        log.debug("not writing %s into %s early: %s", x.name, P, why)
    else:
        a.owner[a.uf.find(x)] = (P, _SEED)
        a.values_of[P].append(a.uf.find(x))


def _check(c: _Cand, uf: _Classes, members: dict, owner: dict, values_of: dict, shared_inputs: dict,
           epilogue: dict, order: dict, returned: set, by_node: dict) -> str:
    """Why ``c`` cannot be reinplaced ("" if it can); fills ``c.owners``, ``c.epilogues``, ``c.chain``."""
    n = c.node
    for name, a in zip(c.names, c.args):
        if not isinstance(a, fx.Node):
            return f"mutated argument {name} is not a tensor node"
        r = uf.find(a)
        if r in shared_inputs:
            return f"mutated argument {name} shares its storage with inputs {[str(p) for p in shared_inputs[r]]}"
        if r not in owner:
            return f"mutated argument {name} ({a}) is an intermediate, not a graph input / state buffer"
        c.owners.append(owner[r][0])
    if len(set(c.owners)) != len(c.owners):
        return "mutated arguments alias each other"
    mutated = set(c.args)
    for a in list(n.args) + list(n.kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(x, fx.Node) and x not in mutated and uf.find(x) in owner \
                    and owner[uf.find(x)][0] in c.owners:
                return f"read-only argument {x} aliases a mutated argument"
    for k, (a, P) in enumerate(zip(c.args, c.owners)):
        epi = epilogue.get(P)
        if epi is None:
            return f"no copy_ back into {P}: the graph does not mutate it, cannot re-inplace"
        if order[epi] < order[n]:
            return f"{P} is written back by {epi.name} before {n.name}"
        new_roots = {uf.find(h) for h in c.holders[k]}
        if not c.holders[k]:
            return f"the new value of {c.names[k]} is unused"
        # 1. nobody reads an old value of P after n
        why = _old_value_read(n, P, epi, new_roots, values_of, members, owner, uf, order, by_node)
        if why:
            return why
        # 2. the new value flows back to P: epilogue (layout-preserving) or a later writer of the chain
        flow = _flow(c, k, a, P, epi, new_roots, members, uf, by_node)
        if isinstance(flow, str):
            return flow
        # 3. the new value is not handed to the caller
        for r in new_roots:
            if any(m in returned for m in members[r]):
                return f"the new value of {P} is a graph output"
    return ""


_SEED = "seed"  # owner marker: a value written into P early (``_seeds``)


def _seeds(cands: list, epilogue: dict, owner: dict, uf: _Classes) -> dict:
    """Intermediates that start a chain of writers ending in ``P``'s epilogue: ``x -> P``.

    ``buf.copy_(f(buf))`` followed by in-place writers of ``buf`` reaches the functional graph as
    ``x = f(buf); w1(x); w2(w1'); ...; copy_(buf, wn')``: functionalization dropped the ``copy_``,
    so the writers' first mutated argument is an intermediate. Writing ``x`` into ``P`` right after it
    is computed (the program's own ``copy_``, the size of ``P``) lets the whole chain run in place
    on ``P`` instead of cloning every mutated argument of every writer.
    """
    holder_of: dict[fx.Node, tuple[_Cand, int]] = {}
    for c in cands:
        for k, hs in enumerate(c.holders):
            for h in hs:
                holder_of[h] = (c, k)
    out: dict[fx.Node, fx.Node] = {}
    for P, epi in epilogue.items():
        x, steps = epi.args[1], 0
        while isinstance(x, fx.Node) and x in holder_of and steps <= len(cands):
            c, k = holder_of[x]
            x, steps = c.args[k], steps + 1
        if (steps and isinstance(x, fx.Node) and x.op == "call_function" and uf.find(x) not in owner
                and x not in out and _same_layout(x, P)):
            out[x] = P
    return out


def _apply_seed(graph: fx.Graph, x: fx.Node, P: fx.Node, rep: ReinplaceReport) -> None:
    with graph.inserting_after(x):
        cp = graph.call_function(aten.copy_.default, (P, x))
    if "val" in P.meta:
        cp.meta["val"] = P.meta["val"]
    else:
        _fx.set_fake_val(cp)
    x.replace_all_uses_with(P, delete_user_cb=lambda u: u is not cp)
    rep.written_early.append(f"{x.name} -> {P.name}")


def _old_value_read(n: fx.Node, P: fx.Node, epi: fx.Node, new_roots: set, values_of: dict, members: dict,
                    owner: dict, uf: _Classes, order: dict, by_node: dict) -> str:
    """A reader of an old value of ``P`` (any alias, any view) that runs after ``n`` writes ``P``."""
    for r in values_of[P]:
        if r in new_roots:
            continue
        for m in members[r]:
            for u in m.users:
                if u is n or order[u] < order[n] or u.target in _META_ONLY:
                    continue
                if uf.find(u) is r and u.target is not aten.copy_.default and u not in by_node:
                    continue  # a view: its own readers are members too
                if u.target is aten.copy_.default and u.args[0] is m and _fx.is_graph_input_or_attr(m):
                    continue  # a write of P, not a read
                if owner[r][1] is None and order[u] > order[epi]:
                    continue  # reads P after its epilogue: the final value in both programs
                return f"{m.name} (old value of {P}) is read after {n.name} by {u.name}"
    return ""


def _flow(c: _Cand, k: int, a: fx.Node, P: fx.Node, epi: fx.Node, new_roots: set, members: dict,
          uf: _Classes, by_node: dict) -> Any:
    """Record where the new value of mutated argument ``k`` goes; a reason string if nowhere valid."""
    holder = c.holders[k][0]
    found = False
    for r in new_roots:
        for m in members[r]:
            for u in m.users:
                if u.target is aten.copy_.default and u.args[1] is m:
                    if u.args[0] is not P:
                        return f"the new value of {P} is copied into another tensor {u.args[0]}"
                    if u is not epi:
                        continue
                    if not (_same_layout(m, P) and _same_layout(holder, a)):
                        return f"the copy back into {P} ({u.name}) does not preserve the layout of {a}"
                    c.epilogues.append(u)
                    found = True
                d = by_node.get(u)
                if d is not None and d is not c and any(x is m for x in d.args):
                    c.chain.append((d, k))
                    found = True
    if not found:
        return f"the new value of {c.names[k]} does not flow back into {P}"
    return None


def _apply(graph: fx.Graph, c: _Cand, rep: ReinplaceReport) -> None:
    n = c.node
    if c.kind == "twin":
        schema = n.target._schema
        idx = _mutated(c.inplace._schema)
        current = [_arg(n, schema, i) for i in idx]  # earlier rewrites may have replaced them
        with graph.inserting_before(n):
            new = graph.call_function(c.inplace, tuple(n.args), dict(n.kwargs))
    else:
        current, new = _apply_af(graph, c)
    # not the HOP's recorded inputs (Inductor constrains a call's layouts by its eager_input_vals)
    skip = {"val"} if c.kind == "twin" else {"val", "eager_input_vals"}
    new.meta.update({k: v for k, v in n.meta.items() if k not in skip})
    val = n.meta.get("val")
    if isinstance(val, (tuple, list)):  # the in-place op returns its unaliased outputs (None: nothing)
        new.meta["val"] = None if not c.leading else val[0] if c.leading == 1 else tuple(val[: c.leading])
    elif val is not None:  # single-output ATen op: the in-place form returns self, same metadata
        new.meta["val"] = val
    else:  # the functional node had no example value: compute one
        _fx.set_fake_val(new)
    for k, hs in enumerate(c.holders):
        for h in hs:
            h.replace_all_uses_with(current[k])
            if h is not n:
                graph.erase_node(h)
    if not c.single:
        gi = _getitems(n)
        nret = c.leading if c.kind == "twin" else len(c.inplace._schema.returns)
        for i in range(c.leading):
            for g in gi.get(i, []):
                if nret > 1:
                    g.args = (new, i)
                else:  # the op's one return (or its None when it returns nothing)
                    g.replace_all_uses_with(new)
                    graph.erase_node(g)
    for e in c.epilogues:  # now copy_(P, P): the in-place op already wrote P
        if e.graph is graph:
            e.replace_all_uses_with(e.args[0])
            graph.erase_node(e)
            rep.removed_copies += 1
    if n.users:  # pragma: no cover - every output was re-routed above
        raise RuntimeError(f"reinplace: {n.name} still has users {list(n.users)}")
    graph.erase_node(n)
    name = str(c.inplace)
    rep.reinplaced[name] = rep.reinplaced.get(name, 0) + 1


def _apply_af(graph: fx.Graph, c: _Cand) -> tuple[list[fx.Node], fx.Node]:
    """Call the mutable op itself on the (views of the) mutated inputs."""
    n, op = c.node, c.inplace
    kw = dict(n.kwargs)
    with graph.inserting_before(n):
        if c.kind == "af1":
            current = [kw[nm] for nm in c.names]
        else:
            current = list(kw.pop("_all_bases"))
            kw.pop("_op_schema", None)
            for i in _mutated(op._schema):
                name = op._schema.arguments[i].name
                kw[name] = _regenerate_view(graph, kw, f"_{name}", current)
        # positional / keyword-only as the schema says (Inductor's lowering normalizes the call)
        args, kwargs = [], {}
        for a in op._schema.arguments:
            if a.name in kw:
                v = kw[a.name]
            elif a.has_default_value():
                v = a.default_value
            else:
                raise RuntimeError(f"reinplace: {n.name} has no value for {op}'s argument {a.name}")
            if a.kwarg_only:
                kwargs[a.name] = v
            else:
                args.append(v)
        return current, graph.call_function(op, tuple(args), kwargs)


def _regenerate_view(graph: fx.Graph, kw: dict, prefix: str, bases: list) -> Any:
    """auto_functionalized_v2's view encoding (``<prefix>_base_index`` + alias / slice / as_strided)
    back to a node on the base."""
    idx = kw.pop(f"{prefix}_base_index")
    if idx is None:
        return None
    base = bases[idx]
    if kw.pop(f"{prefix}_alias", None):
        op, args = aten.alias.default, (base,)
    elif f"{prefix}_storage_offset" in kw:
        size, stride, off = (kw.pop(f"{prefix}_{s}") for s in ("size", "stride", "storage_offset"))
        op, args = aten.as_strided.default, (base, list(size), list(stride), off)
    elif f"{prefix}_slice_dim" in kw:
        dim, start, end = (kw.pop(f"{prefix}_slice_{s}") for s in ("dim", "start", "end"))
        op, args = aten.slice.Tensor, (base, dim, start, end)
    else:
        return base
    view = graph.call_function(op, args)
    bval = base.meta.get("val") if isinstance(base, fx.Node) else None
    if isinstance(bval, torch.Tensor):  # later passes (Inductor's lowering) read example values
        view.meta["val"] = op(bval, *args[1:])
    else:
        _fx.set_fake_val(view)
    return view

"""Functional ops (+ their ``copy_`` epilogues) back into in-place ops after AOT, where that is provably
unobservable (Inductor's reinplace rules): in eager mode each would clone a pool, a selection buffer or a
full cache per layer and step. Before / after, for a graph input ``P``::

    new = dsa_serve_functional(plan, ..., P)            dsa_serve(plan, ..., P)
    y = attention(new[k])                          ->   y = attention(P)
    copy_(P, new[k])

The rules (aliasing by storage, only graph state, the graph must write ``P`` back, nobody sees its old
value, chains started by a functional update written into ``P`` early) are docs/design.md §1; what each
node mutates is ``reinplace_candidates.py``, the rewriting ``reinplace_apply.py``. Everything that stays
functional is listed with its reason in :class:`ReinplaceReport`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import fx

from . import _fx
from .reinplace_apply import apply_candidate, apply_seed
from .reinplace_candidates import Candidate, StorageClasses, candidate, same_layout, schema_view_source, storage_key, value_of

log = logging.getLogger("offload_passes.passes.reinplace")

aten = torch.ops.aten
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
# storage classes
# ----------------------------------------------------------------------------------------------


@dataclass
class _Graph:
    """What the one walk over the graph finds, and the value classes derived from it."""

    order: dict[fx.Node, int] = field(default_factory=dict)
    uf: StorageClasses = field(default_factory=StorageClasses)
    cands: list[Candidate] = field(default_factory=list)
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
    by_node: dict[fx.Node, Candidate] = field(default_factory=dict)


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
            apply_seed(graph, x, P, rep)
    for c in a.cands:
        if c.ok:
            apply_candidate(graph, c, rep)
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
        key = storage_key(value_of(n, gm))
        if key is not None:
            if key in by_storage:
                a.uf.union(n, by_storage[key])
            else:
                by_storage[key] = n
        src = schema_view_source(n)
        if src is not None:
            a.uf.union(n, src)
        if n.op == "output":
            a.output = n
        elif n.op == "call_function" and n.target is aten.copy_.default:
            a.copies.append(n)
        else:
            c = candidate(n)
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


def _check(c: Candidate, uf: StorageClasses, members: dict, owner: dict, values_of: dict, shared_inputs: dict,
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


def _seeds(cands: list, epilogue: dict, owner: dict, uf: StorageClasses) -> dict:
    """Intermediates that start a chain of writers ending in ``P``'s epilogue: ``x -> P``.

    ``buf.copy_(f(buf))`` followed by in-place writers of ``buf`` reaches the functional graph as
    ``x = f(buf); w1(x); w2(w1'); ...; copy_(buf, wn')``: functionalization dropped the ``copy_``,
    so the writers' first mutated argument is an intermediate. Writing ``x`` into ``P`` right after it
    is computed (the program's own ``copy_``, the size of ``P``) lets the whole chain run in place
    on ``P`` instead of cloning every mutated argument of every writer.
    """
    holder_of: dict[fx.Node, tuple[Candidate, int]] = {}
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
                and x not in out and same_layout(x, P)):
            out[x] = P
    return out


def _old_value_read(n: fx.Node, P: fx.Node, epi: fx.Node, new_roots: set, values_of: dict, members: dict,
                    owner: dict, uf: StorageClasses, order: dict, by_node: dict) -> str:
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


def _flow(c: Candidate, k: int, a: fx.Node, P: fx.Node, epi: fx.Node, new_roots: set, members: dict,
          uf: StorageClasses, by_node: dict) -> Any:
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
                    if not (same_layout(m, P) and same_layout(holder, a)):
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



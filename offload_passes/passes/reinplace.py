"""Pass 5 — turn functional twins (+ ``copy_`` epilogues) back into in-place ops, after AOT.

AOT functionalization (with our Functionalize kernels) rewrites ``custom.dsa_serve`` /
``dsa_install`` / ``npu_gather_selection_kv_cache`` into their ``*_functional`` twins whose outputs
are copied back into the mutated inputs at the end of the graph; in eager mode that would clone a
pool / selection buffer per layer and step. This pass processes functional nodes in graph order and
reinplaces node ``n`` only when, for every mutated argument ``v``:

* ``v`` is a *version* of a graph input ``P`` (a placeholder — graph inputs and lifted state buffers
  — or an output of an earlier twin that was reinplaced onto ``P``), never an intermediate (TorchAir's
  multi-output reinplace mishandles intermediates, spec/torchair.md §4);
* no node after ``n`` reads ``v`` (the old value), except the ``copy_(P, ·)`` epilogue writing ``P``;
* the mutated arguments have distinct bases and no other argument of ``n`` aliases them;
* the new value flows back to ``P``: ``copy_(P, out)`` epilogue, or a later twin consuming it as the
  same kind of mutated argument (the install metadata chain md0 → md0 → md1).

Then the node becomes the in-place op on ``P``, its outputs are replaced by ``P`` and the
``copy_(P, P)`` self-copies are dropped. Anything else stays functional and is reported. The same
rule covers the ATen single-output pairs AOT emits for the model's own cache writes
(``index_put`` → ``index_put_``, ``copy`` → ``copy_``).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import fx

aten = torch.ops.aten


@dataclass(frozen=True)
class Pair:
    inplace: Any
    mutated: tuple[int, ...]  # positional indices of the mutated arguments
    leading: int  # outputs of the functional op before the mutated ones (0 for single-output ATen ops)
    single: bool = False  # the functional op returns the new value itself (not a tuple)


def _pairs() -> dict[Any, Pair]:
    c = torch.ops.custom
    pairs = {
        c.dsa_serve_functional.default: Pair(c.dsa_serve.default, (5, 6), 0),
        c.dsa_install_functional.default: Pair(c.dsa_install.default, (4, 5, 6, 7, 8), 0),
        c.npu_gather_selection_kv_cache_functional.default: Pair(c.npu_gather_selection_kv_cache.default,
                                                                   (0, 1, 2, 3), 1),
        aten.index_put.default: Pair(aten.index_put_.default, (0,), 0, True),
        aten.index_copy.default: Pair(aten.index_copy_.default, (0,), 0, True),
        aten.copy.default: Pair(aten.copy_.default, (0,), 0, True),
    }
    return pairs


@dataclass
class ReinplaceReport:
    reinplaced: dict[str, int] = field(default_factory=dict)  # op -> count
    kept_functional: list[dict] = field(default_factory=list)  # {node, op, reason}
    removed_copies: int = 0

    def to_dict(self) -> dict:
        return {"reinplaced": dict(self.reinplaced), "kept_functional": list(self.kept_functional),
                "removed_copies": self.removed_copies}


_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.default, aten.alias.default}


def _is_copy_(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is aten.copy_.default


def _is_view(n: Any) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in _VIEWS


def _view_root(v: Any) -> Any:
    while _is_view(v):
        v = v.args[0]
    return v


def _aliases(x: fx.Node) -> set[fx.Node]:
    """``x`` and every node that views it (transitively)."""
    out, todo = {x}, [x]
    while todo:
        for u in todo.pop().users:
            if _is_view(u) and u.args[0] in out and u not in out:
                out.add(u)
                todo.append(u)
    return out


def _numel(n: fx.Node) -> Optional[int]:
    v = n.meta.get("val", n.meta.get("example_value"))
    return v.numel() if isinstance(v, torch.Tensor) else None


def _is_self_copy(n: fx.Node) -> bool:
    """``copy_(P, X)`` where X is P or a full-size view chain of P (left after reinplacing)."""
    if not _is_copy_(n) or n.users:
        return False
    dst, src = n.args[0], n.args[1]
    if src is dst:
        return True
    return _view_root(src) is dst and _numel(src) is not None and _numel(src) == _numel(dst)


def _outputs(n: fx.Node, pair: Pair) -> dict[int, list[fx.Node]]:
    """Output index -> nodes holding it (getitems, or the node itself for single-output ops)."""
    if pair.single:
        return {0: [n]}
    out: dict[int, list[fx.Node]] = {}
    for u in n.users:
        if u.op == "call_function" and u.target is operator.getitem:
            out.setdefault(u.args[1], []).append(u)
    return out


def reinplace(graph: fx.Graph) -> ReinplaceReport:
    pairs = _pairs()
    rep = ReinplaceReport()
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    version_base: dict[fx.Node, fx.Node] = {}  # value node -> placeholder it is a version of
    decisions: list[tuple[fx.Node, Pair, list[fx.Node]]] = []

    def base_of(v: Any) -> Optional[fx.Node]:
        if not isinstance(v, fx.Node):
            return None
        if v.op == "placeholder":
            return v
        return version_base.get(v)

    for n in nodes:
        if n.op != "call_function" or n.target not in pairs:
            continue
        pair = pairs[n.target]
        why = ""
        vals = [n.args[i] if i < len(n.args) else None for i in pair.mutated]
        # a single-output ATen op may mutate through a view of the input (cache.view(-1, D).index_copy_)
        roots = [_view_root(v) if pair.single else v for v in vals]
        bases = [base_of(r) for r in roots]
        if any(bs is None for bs in bases):
            bad = [str(v) for v, bs in zip(vals, bases) if bs is None]
            why = f"mutated argument(s) {bad} are intermediates, not graph inputs / state buffers"
        elif len(set(bases)) != len(bases):
            why = "mutated arguments alias each other"
        else:
            others = [a for i, a in enumerate(n.args) if i not in pair.mutated and isinstance(a, fx.Node)]
            if any(base_of(a) in bases for a in others):
                why = "a read-only argument aliases a mutated one"
        if not why:
            for r, P in zip(roots, bases):
                alias = _aliases(r)
                late = [u for a in alias for u in a.users if u is not n and u not in alias
                        and order[u] > order[n] and not (_is_copy_(u) and u.args[0] is P)]
                if late:
                    why = f"{r.name} (old value) is read after {n.name} by {late[0].name}"
                    break
        outs = _outputs(n, pair) if not why else {}
        if not why:
            for k, P in enumerate(bases):
                holders = outs.get(pair.leading + k, [])
                for h in holders:
                    for u in h.users:
                        if _is_copy_(u) and u.args[0] is not P and u.args[1] is h:
                            why = f"output {k} of {n.name} is copied into another tensor {u.args[0]}"
                        if _is_copy_(u) and u.args[0] is P and u.args[1] is not h:
                            pass
            # the epilogue must write P from this value (or a later twin must take it over)
        if why:
            rep.kept_functional.append({"node": n.name, "op": str(n.target), "reason": why})
            continue
        for k, P in enumerate(bases):
            for h in outs.get(pair.leading + k, []):
                version_base[h] = P
        decisions.append((n, pair, bases))

    for n, pair, bases in decisions:
        with graph.inserting_before(n):
            new = graph.call_function(pair.inplace, tuple(n.args), dict(n.kwargs))
        new.meta.update(n.meta)
        outs = _outputs(n, pair)
        for k, P in enumerate(bases):
            for h in outs.get(pair.leading + k, []):
                h.replace_all_uses_with(P)
        if pair.leading:
            for i in range(pair.leading):
                for h in outs.get(i, []):
                    h.replace_all_uses_with(new)
        for hs in outs.values():
            for h in hs:
                if h is not n and not h.users:
                    graph.erase_node(h)
        if pair.single:
            # the in-place op mutated (a view of) P: readers of the new value read that view
            n.replace_all_uses_with(n.args[0])
        graph.erase_node(n)
        name = str(pair.inplace)
        rep.reinplaced[name] = rep.reinplaced.get(name, 0) + 1

    for n in list(graph.nodes):
        if _is_self_copy(n):
            graph.erase_node(n)
            rep.removed_copies += 1
    graph.lint()
    return rep

"""Teach TorchAir's GE ref-output analysis about ``DsaServe`` / ``DsaInstall``.

TorchAir removes the ``TensorMove`` (+ ``Assign``) that functionalization puts around an in-place GE
op only for op types listed in ``_ge_concrete_graph/graph_pass.py::_get_output_to_input_ref_idx``.
The DSA ops are not listed, so without this patch every decode step copies each layer's selection
buffers (serve) and pools + metadata (install) — verified on CPU (docs/platform.md §3).

The patch wraps the private function (it is not API): it answers from TorchAir first and adds our
pairs only for our op types and only where the node's output name equals the referenced input's name
(a mismatching node is left alone: a kept copy is slow, a wrong ref pair would be wrong).
It is idempotent and raises if the function, or its use by the ref analysis, has gone.

The ref table alone is not enough on real decode graphs (found here, on CPU): TorchAir's
``optimize_reference_op_redundant_copy`` drops a ``TensorMove`` only when the graph input feeds nothing
but that ``TensorMove`` and its write-back ``Assign``. A layer's pool is also read by its serve, and the
group metadata by its plan, so the pool and metadata copies of every install stay. :func:`drop_dsa_copies`
(run right after TorchAir's pass, by wrapping it) removes the ``TensorMove`` in front of a DSA ref input
when every other reader of the copied tensor is an ancestor of the DSA node (it has already read the
value when the node writes in place) and the tensor is not itself a graph output. The write-back
``Assign`` is kept, as TorchAir does when it removes only the ``TensorMove``.
"""
from __future__ import annotations

import inspect
import logging
from collections import deque
from typing import Callable, Dict

from .. import _compat
from ..custom_ops import OP_SPECS
from ..custom_ops.opspec import ge_ref_table

#: GE ref analysis (TorchAir ``_get_output_to_input_ref_idx``): output index -> input index, for the
#: mutating GE types TorchAir does not list (derived from the op specs: DsaServe, DsaInstall). Without
#: it every step copies the selection caches / pools.
REF_IDX: Dict[str, Dict[int, int]] = ge_ref_table(OP_SPECS)

log = logging.getLogger("offload_passes.converters")

_MARK = "_offload_passes_ref_patch"
_FN = "_get_output_to_input_ref_idx"
_CONSUMER = "_find_ref_ops_and_io_ops"


def _graph_pass_module():
    return _compat.torchair_ge_graph_pass()  # private TorchAir module (no registration API)


def ref_pairs(op) -> Dict[int, int]:
    """Our ref pairs for a GE ``OpDef`` whose output/input desc names confirm them."""
    pairs = REF_IDX.get(op.type)
    if not pairs:
        return {}
    ok = {}
    for out_i, in_i in pairs.items():
        if out_i < len(op.output_desc) and in_i < len(op.input_desc) and \
                op.output_desc[out_i].name == op.input_desc[in_i].name:
            ok[out_i] = in_i
        else:
            log.warning("GE node %s (%s): output %d does not reference input %d by name; "
                        "its TensorMove stays", op.name, op.type, out_i, in_i)
    return ok


def patch_ref_idx() -> Callable:
    """Install the wrapper (once). Returns the function now in place."""
    gp = _graph_pass_module()
    current = getattr(gp, _FN, None)
    if current is None or not callable(current):
        raise RuntimeError(
            f"torchair._ge_concrete_graph.graph_pass.{_FN} not found in this TorchAir; DsaServe/DsaInstall "
            "ref outputs cannot be declared and GE would copy selection buffers and pools every step. "
            "Update offload_passes.converters.ge_ref_patch for this TorchAir version."
        )
    if getattr(current, _MARK, False):
        return current
    consumer = getattr(gp, _CONSUMER, None)
    if consumer is None or _FN not in getattr(consumer, "__code__", None).co_names:
        raise RuntimeError(
            f"torchair._ge_concrete_graph.graph_pass.{_CONSUMER} no longer calls {_FN}; the DSA ref "
            "patch would have no effect. Update offload_passes.converters.ge_ref_patch."
        )
    if len(inspect.signature(current).parameters) != 1:
        raise RuntimeError(f"torchair {_FN} has an unexpected signature {inspect.signature(current)}")
    original = current

    def patched(op) -> Dict[int, int]:
        mapping = original(op)
        if not mapping and op.type in REF_IDX:
            mapping = ref_pairs(op)
        return mapping

    setattr(patched, _MARK, True)
    patched.__wrapped__ = original
    patched.__doc__ = original.__doc__
    setattr(gp, _FN, patched)
    log.debug("patched %s for %s", _FN, sorted(REF_IDX))
    return patched


def _producer(tensor: str) -> str:
    return tensor.rsplit(":", 1)[0]


def _topological_rank(ops: list, by_name: dict) -> Dict[str, int]:
    """Kahn's order of the ops (one pass over the edges); ops on a cycle get no rank."""
    indegree = {o.name: 0 for o in ops}
    successors: Dict[str, list] = {o.name: [] for o in ops}
    for o in ops:
        for t in o.input:
            if t and _producer(t) in by_name:
                successors[_producer(t)].append(o.name)
                indegree[o.name] += 1
    ready = deque(name for name, d in indegree.items() if d == 0)
    rank: Dict[str, int] = {}
    while ready:
        name = ready.popleft()
        rank[name] = len(rank)
        for s in successors[name]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.append(s)
    return rank


def _all_ancestors(op, names: set, by_name: dict, rank: Dict[str, int]) -> bool:
    """Whether every op in ``names`` is an ancestor of ``op``.

    A path from an ancestor to ``op`` only passes ops ranked between the two, so the backward search
    stops below the lowest-ranked candidate: it walks the ops between a layer's reader (its serve, its
    group's plan) and the DSA node, not the model above them.
    """
    if any(rank.get(n, -1) >= rank.get(op.name, -1) >= 0 for n in names):
        return False  # ranked after the DSA node (or beside it): not an ancestor
    floor = min((rank.get(n, -1) for n in names), default=0)
    seen, todo = set(), [op]
    while todo and not names <= seen:
        for t in todo.pop().input:
            if not t:
                continue
            name = _producer(t)
            if name not in seen and name in by_name and rank.get(name, floor) >= floor:
                seen.add(name)
                todo.append(by_name[name])
    return names <= seen


def drop_dsa_copies(graph) -> int:
    """Remove ``TensorMove`` copies in front of DSA ref inputs that are provably safe. Returns the count.

    Linear in the graph: one walk builds the op index, the readers of every tensor and a topological
    rank; each DSA input then looks only at its own copy, that copy's readers and the ops between them.
    The removed copies leave ``graph.op`` in one sweep at the end.
    """
    ops = list(graph.op)
    position = {id(o): i for i, o in enumerate(ops)}
    by_name = {o.name: o for o in ops}
    readers: Dict[str, Dict[int, object]] = {}  # tensor -> the ops reading it (by id), graph order
    for o in ops:
        for t in o.input:
            if t:
                readers.setdefault(t, {})[id(o)] = o
    rank = _topological_rank(ops, by_name)
    gone = []
    for op in [o for o in ops if o.type in REF_IDX]:
        for in_i in ref_pairs(op).values():
            src = op.input[in_i]
            tm = by_name.get(_producer(src))
            if tm is None or tm.type != "TensorMove" or not src.endswith(":0"):
                continue
            copied = tm.input[0]
            users_of_copy = readers.get(src, {})
            if len(users_of_copy) != 1 or id(op) not in users_of_copy:
                continue  # the copy is read elsewhere: it is a real copy
            others = [o for o in readers.get(copied, {}).values() if o is not tm
                      and not (o.type == "Assign" and o.input[0] == copied)]
            if any(o.type == "NetOutput" for o in others):
                continue  # the old value is returned: it must survive the in-place write
            if not _all_ancestors(op, {o.name for o in others if o is not op}, by_name, rank):
                continue  # someone may read the old value after the DSA node writes
            op.input[in_i] = copied
            readers[src].pop(id(op), None)
            readers.setdefault(copied, {})[id(op)] = op
            # keep the ordering the copy carried (e.g. a record/wait control edge attached to the first
            # op a converter emitted, which is this TensorMove)
            for ctrl in [t for t in tm.input if t.endswith(":-1")]:
                if ctrl not in op.input:
                    op.input.append(ctrl)
                    readers.setdefault(ctrl, {})[id(op)] = op
            for t in tm.input:
                if t:
                    readers.get(t, {}).pop(id(tm), None)
            del by_name[tm.name]
            gone.append(position[id(tm)])
    for i in sorted(gone, reverse=True):  # highest first: the lower positions stay valid
        del graph.op[i]
    return len(gone)


_COPY_PASS = "optimize_reference_op_redundant_copy"


def patch_copy_pass() -> Callable:
    """Run :func:`drop_dsa_copies` after TorchAir's ref-copy pass (idempotent)."""
    fx2ge_converter = _compat.torchair_fx2ge_converter()

    gp = _graph_pass_module()
    current = getattr(fx2ge_converter, _COPY_PASS, None)
    if current is None or not callable(current):
        raise RuntimeError(
            f"torchair._ge_concrete_graph.fx2ge_converter.{_COPY_PASS} not found in this TorchAir; the DSA "
            "copy elimination cannot be attached. Update offload_passes.converters.ge_ref_patch."
        )
    if getattr(current, _MARK, False):
        return current
    original = current

    def patched(graph):
        result = original(graph)
        n = drop_dsa_copies(graph)
        if n:
            log.debug("removed %d TensorMove copies in front of DSA ref inputs", n)
        return result

    setattr(patched, _MARK, True)
    patched.__wrapped__ = original
    setattr(fx2ge_converter, _COPY_PASS, patched)
    setattr(gp, _COPY_PASS, patched)
    return patched


def is_patched() -> bool:
    return bool(getattr(getattr(_graph_pass_module(), _FN, None), _MARK, False))

"""Reinplace registrations for npugraph_ex and TorchAir's ACL graph (``reduce-overhead``).

Both packages turn ``<op>_functional`` + ``copy_`` epilogues back into ``<op>`` through a private
table, ``_acl_concrete_graph/graph_pass.py::inplaceable_npu_ops`` (one copy in ``torchair``, one in
``npugraph_ex``; docs/platform.md §4). Its ``register_inplaceable_npu_op`` helper only knows
``torch.ops.npu``, so we write :class:`InplaceableNpuOp` entries directly, into every loaded copy of
both modules.

The ``extra_check`` we install is deliberately narrow:

* it refuses unless every mutated argument is a graph input (``placeholder`` / ``get_attr``) and no
  argument is passed twice. TorchAir's intermediate-tensor reinplace
  (``reinplace_with_multi_stream_check``) rewires later users of a multi-output op to its first
  mutated argument — wrong numbers, verified on CPU — so intermediates must stay functional;
* it then applies a stream-safety check: single-stream graphs pass, and a side-stream install passes
  when its cross-stream users are fenced by tagged events, which is the topology
  :mod:`offload_passes.lowering.npu` emits. That is the package's own
  ``check_multi_stream_for_multi_reinplace`` where it is event-aware (npugraph_ex 2.13), else
  :func:`converters.stream_fence.event_fenced` over the package's own user collection (npugraph_ex
  2.8 and TorchAir only accept users on one stream);
* for the gather op, whose in-place form returns one tensor while the functional form returns a
  tuple, it re-points ``getitem(node, 0)`` at the node, but only when called by the graph-input pass
  (which swaps the target right after a positive answer); anywhere else it refuses.
"""
from __future__ import annotations

import logging
import operator
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import fx

from .. import _compat
from ..custom_ops import OP_SPECS
from ..custom_ops.opspec import OpSpec
from .stream_fence import fenced_stream_check

log = logging.getLogger("offload_passes.converters")

#: Module names of the two registries (the ``torch_npu.dynamo.*`` aliases are covered when loaded).
REGISTRY_MODULES = _compat.REINPLACE_REGISTRY_MODULES
_ALIASES = {
    "torchair._acl_concrete_graph.graph_pass": "torch_npu.dynamo.torchair._acl_concrete_graph.graph_pass",
    "npugraph_ex._acl_concrete_graph.graph_pass": "torch_npu.dynamo.npugraph_ex._acl_concrete_graph.graph_pass",
}
_INPUT_PASS = "_mutated_input_reinplace"
_MARK = "_offload_passes_extra_check"


def _is_graph_input(a) -> bool:
    return isinstance(a, fx.Node) and a.op in ("placeholder", "get_attr")


def make_extra_check(spec: OpSpec, indices: List[int], stream_check: Callable[[fx.Node], bool]
                     ) -> Callable[[fx.Node], bool]:
    single_return = len(spec.non_ref_outputs) == 1

    def extra_check(node: fx.Node) -> bool:
        if any(i >= len(node.args) for i in indices):
            return False
        mutated = [node.args[i] for i in indices]
        if not all(_is_graph_input(a) for a in mutated):
            log.debug("reinplace refused for %s: a mutated argument is not a graph input", node.name)
            return False
        if len(set(mutated)) != len(mutated):
            log.debug("reinplace refused for %s: a mutated argument is passed twice", node.name)
            return False
        if not stream_check(node):
            log.debug("reinplace refused for %s: cross-stream users are not fenced by events", node.name)
            return False
        if single_return:
            return _repoint_single_output(node)
        return True

    setattr(extra_check, _MARK, spec.name)
    return extra_check


def _repoint_single_output(node: fx.Node) -> bool:
    """``getitem(node, 0)`` -> ``node`` (the in-place op returns that tensor itself)."""
    heads = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
    if not heads:
        return True
    caller = sys._getframe(2).f_code.co_name  # extra_check <- this; its caller decides
    if caller != _INPUT_PASS:
        return False  # only the graph-input pass swaps the target right after saying yes
    for h in heads:
        h.replace_all_uses_with(node)
        node.graph.erase_node(h)
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        node.meta["val"] = val[0]
    return True


def registry_modules() -> List[object]:
    """Every importable copy of the two registries (plus torch_npu's aliases of them, if loaded)."""
    import importlib

    mods, errors = [], []
    for name in REGISTRY_MODULES:
        try:
            mods.append(importlib.import_module(name))
        except ImportError as e:
            errors.append(f"{name}: {e}")
    if not mods:
        raise RuntimeError("offload_passes.converters: neither torchair nor npugraph_ex is importable "
                           f"({'; '.join(errors)})")
    for name in REGISTRY_MODULES:
        alias = sys.modules.get(_ALIASES[name])
        if alias is not None and alias not in mods:
            mods.append(alias)
    return mods


def _validate(mod) -> Tuple[dict, type, Callable]:
    table = getattr(mod, "inplaceable_npu_ops", None)
    cls = getattr(mod, "InplaceableNpuOp", None)
    check = getattr(mod, "check_multi_stream_for_multi_reinplace", None)
    if not isinstance(table, dict) or cls is None or check is None or not hasattr(mod, _INPUT_PASS):
        raise RuntimeError(
            f"{mod.__name__}: expected inplaceable_npu_ops (dict), InplaceableNpuOp, "
            f"check_multi_stream_for_multi_reinplace and {_INPUT_PASS}; this TorchAir/npugraph_ex version "
            "is not supported by offload_passes.converters.npu_reinplace_registry"
        )
    fields = getattr(cls, "__dataclass_fields__", {})
    if not {"inplace_op", "mutated_arg", "extra_check"} <= set(fields):
        raise RuntimeError(f"{mod.__name__}.InplaceableNpuOp has fields {sorted(fields)}, "
                           "expected inplace_op, mutated_arg, extra_check")
    return table, cls, check


def register_reinplace(modules: Optional[List[object]] = None) -> Dict[str, List[str]]:
    """Register the in-place pairs of every mutating ``custom::`` op into both registries (idempotent).

    Returns ``{module name: [functional op names]}``.
    """
    mods = modules if modules is not None else registry_modules()
    done: Dict[str, List[str]] = {}
    for mod in mods:
        table, cls, stream_check = _validate(mod)
        # the package's own check where it is event-aware, else ours over its user lists (once per module)
        users_of = None if _compat.reinplace_event_protection(mod) else _compat.reinplace_mutated_input_users(mod)
        for spec in [s for s in OP_SPECS if s.functional]:
            ns = getattr(torch.ops, spec.namespace)
            functional = getattr(ns, spec.functional).default
            inplace = getattr(ns, spec.name).default
            idx = list(spec.mutated_positions)  # the twin takes the in-place op's arguments
            check = stream_check if users_of is None else fenced_stream_check(users_of, idx)
            table[functional] = cls(inplace_op=inplace, mutated_arg=idx,
                                    extra_check=make_extra_check(spec, idx, check))
            done.setdefault(mod.__name__, []).append(spec.functional)
    return done


def registered(mod) -> Dict[str, List[int]]:
    """Our entries in a registry module: functional op name -> mutated arg indices."""
    out = {}
    for k, v in getattr(mod, "inplaceable_npu_ops", {}).items():
        if getattr(v.extra_check, _MARK, None):
            out[k.name()] = list(v.mutated_arg)
    return out

"""GE converters (TorchAir ``ge_graph`` mode) for the ``custom::`` DSA ops and the ``offload_ref::``
attention references. Imports TorchAir at module import: load it through
:func:`offload_passes.converters.register_all`, never from CPU-only code.

Contract (docs/platform.md §3; the per-op facts are the ``custom_ops`` op specs, :class:`OpSpec`):

* in-place op: one GE node on the original inputs; a mutated input is a ref pair (GE output with the
  input's name); the converter returns only what the torch schema returns (``None`` for ``-> ()``),
  which is also what TorchAir's ``auto_functionalized_v2`` converter expects (it finds the updated
  value through the same-named output);
* functional twin: ``TensorMove`` of exactly the mutated inputs, the node on the copies, returning the
  functional schema's outputs. GE drops the TensorMove again for ops in its ref table
  (:mod:`.ge_ref_patch` teaches it ``DsaServe`` / ``DsaInstall``);
* attrs are typed from the schema (``int`` -> ``attr.Int`` ...) and named as in the CANN definitions.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torchair import register_fx_node_ge_converter  # public API (torch-npu 2.8.0.post5 / 2.13.0)
from torchair.ge import Clone, attr, custom_op
from torchair.ge import Tensor as GeTensor  # public base of TorchAir's GE graph tensors

from ..custom_ops import OP_SPECS
from ..custom_ops.opspec import OpSpec, is_tensor_arg, schema_binder

log = logging.getLogger("offload_passes.converters")


def _attr_for(arg: "torch.Argument", value: Any, op: str):
    kind = arg.type.kind()
    if isinstance(value, GeTensor):
        raise RuntimeError(f"{op}: argument {arg.name} must be a compile-time constant for GE, got a tensor "
                           "(symbolic value); compile with static shapes")
    if kind == "IntType":
        return attr.Int(int(value))
    if kind == "FloatType":
        return attr.Float(float(value))
    if kind == "BoolType":
        return attr.Bool(bool(value))
    if kind == "StringType":
        return attr.Str(str(value))
    raise RuntimeError(f"{op}: argument {arg.name} has type {arg.type} which has no GE attr mapping")


def _bind(schema: "torch.FunctionSchema", args: Tuple, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """A converter call (FX node args/kwargs) by schema argument name, defaults filled (the ops' one binder,
    ``custom_ops/opspec.py`` ``Binder``: a bad call raises ``OpArgumentError`` naming the op and argument)."""
    b = schema_binder(schema)
    return dict(zip(b.names, b(args, kwargs)))


def _emit(spec: OpSpec, schema, bound: Dict[str, Any], op: str, move: Tuple[str, ...] = ()):
    """Build the GE node; inputs named in ``move`` are first copied with ``TensorMove``."""
    inputs: Dict[str, Optional[GeTensor]] = {}
    attrs = {}
    for a in schema.arguments:
        v = bound[a.name]
        if is_tensor_arg(a):
            if v is not None and not isinstance(v, GeTensor):
                raise RuntimeError(f"{op}: tensor argument {a.name} is {type(v).__name__}, expected a GE tensor")
            if v is None and a.name in spec.omit_if_none:
                continue
            if a.name in move:
                copy = Clone(v)  # torchair.ge's public TensorMove
                if v.meta is not None:
                    copy.set_meta(v.meta)
                v = copy
            inputs[a.name] = v
        elif v is not None:
            attrs[spec.ge_attr(a.name)] = _attr_for(a, v, op)
    out = custom_op(spec.ge_type, inputs=inputs, attrs=attrs, outputs=list(spec.ge_outputs))
    return out if isinstance(out, tuple) else (out,)


def _make_inplace_converter(spec: OpSpec, overload) -> Callable:
    schema = overload._schema
    op = spec.qualname
    keep = [spec.ge_outputs.index(n) for n in spec.non_ref_outputs]

    def convert(*args, meta_outputs: Any = None, **kwargs):
        outs = _emit(spec, schema, _bind(schema, args, kwargs), op)
        picked = [outs[i] for i in keep]
        if not picked:
            return None  # `-> ()`: the updated values live in the same-named ref outputs
        return picked[0] if len(picked) == 1 and len(schema.returns) == 1 else tuple(picked)

    convert.__name__ = f"convert_{spec.name}"
    return convert


def _make_functional_converter(spec: OpSpec, overload) -> Callable:
    schema = overload._schema
    op = spec.functional_qualname
    order = [spec.ge_outputs.index(n) for n in spec.functional_outputs]

    def convert(*args, meta_outputs: Any = None, **kwargs):
        outs = _emit(spec, schema, _bind(schema, args, kwargs), op, move=spec.mutated)
        return tuple(outs[i] for i in order)

    convert.__name__ = f"convert_{spec.functional}"
    return convert


def _overload(namespace: str, name: str):
    ns = getattr(torch.ops, namespace)
    try:
        return getattr(ns, name).default
    except (AttributeError, RuntimeError):
        return None


def register_ge_converters() -> List[str]:
    """Register (or re-register: idempotent) our converters on the op overloads. Returns their names.

    A converter already present on an op (e.g. CANN's recipe files) is replaced: ours follow the same
    CANN definitions and also handle the in-place op reaching GE through ``auto_functionalized_v2``.
    """
    done = []
    for spec in [s for s in OP_SPECS if s.ge_type]:
        pairs = [(spec.name, _make_inplace_converter)]
        if spec.functional:
            pairs.append((spec.functional, _make_functional_converter))
        for name, factory in pairs:
            overload = _overload(spec.namespace, name)
            if overload is None:
                if spec.namespace == "custom":
                    raise RuntimeError(f"custom::{name} is not registered; import offload_passes first")
                continue  # reference ops absent: nothing to convert
            previous = getattr(overload, "_ge_converter", None)
            fn = factory(spec, overload)
            if previous is not None and getattr(previous, "__module__", "") != __name__:
                log.info("replacing the GE converter of %s::%s", spec.namespace, name)
            register_fx_node_ge_converter(overload)(fn)
            done.append(f"{spec.namespace}::{name}")
    return done

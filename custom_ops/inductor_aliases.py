"""The ``offload_inductor`` ops: Inductor aliases of our mutable custom ops, and ``assert_async_``.

Inductor runs a mutable custom op as a ``FallbackKernel`` only if torch could auto-functionalize it,
which excludes ops with a ``Functionalize`` kernel (torch 2.8 refuses them). Each alias has the same
schema as the op it stands for, in the ``offload_inductor`` namespace, a kernel that calls the original
and no Functionalize kernel; it is derived from the op's schema (no op facts are repeated). The pass that
retargets calls to them is ``passes/inductor_targets.py``. Ops are defined here, in custom_ops/, only.
"""
from __future__ import annotations

from typing import Iterable

import torch

from .. import _compat

NAMESPACE = "offload_inductor"
_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
_aliases: dict[_compat.OpOverload, _compat.OpOverload] = {}
_alias_owner: dict[str, _compat.OpOverload] = {}  # alias name -> the op it stands for


def needs_alias(op: object) -> bool:
    """A mutable, non-ATen op with a Functionalize kernel: what Inductor 2.8 cannot run as it is."""
    if not isinstance(op, _compat.OpOverload) or op.namespace in ("aten", "prims", NAMESPACE):
        return False
    return op._schema.is_mutable and _compat.dispatcher_has_kernel(op.name(), "Functionalize")


def inductor_alias(op: _compat.OpOverload) -> _compat.OpOverload:
    """``offload_inductor::<name>`` for the mutable op ``op`` (defined on first use, then cached)."""
    if op in _aliases:
        return _aliases[op]
    schema = str(op._schema)
    ns, _, rest = schema.partition("::")
    if not rest or ns != op.namespace:
        raise RuntimeError(f"unexpected schema for {op}: {schema!r}")
    name = rest.split("(", 1)[0]  # "dsa_serve" or "dsa_serve.overload"
    base, _, overload = name.partition(".")
    owner = _alias_owner.setdefault(name, op)
    if owner is not op:  # same name in two namespaces: one alias namespace cannot hold both
        raise RuntimeError(f"{NAMESPACE}::{name} already stands for {owner}; cannot alias {op} too")
    if not _compat.dispatcher_has_schema(f"{NAMESPACE}::{name}"):
        _lib.define(rest)

        def kernel(*args, _op=op, **kwargs):
            return _op(*args, **kwargs)

        # One composite kernel serves CPU and fake tensors: under FakeTensorMode the original op
        # dispatches to its own fake kernel.
        _lib.impl(name, kernel, "CompositeExplicitAutograd")
    alias = getattr(getattr(getattr(torch.ops, NAMESPACE), base), overload or "default")
    _aliases[op] = alias
    return alias


def define_aliases(ops: Iterable[object]) -> list[_compat.OpOverload]:
    """Define the aliases of ``ops`` that need one (before an Inductor compile: a warm FX-graph cache
    loads code that calls the aliases without running :func:`retarget_for_inductor`)."""
    return [inductor_alias(op) for op in ops if needs_alias(op)]


# The in-graph guards for an Inductor without a lowering of ``aten._assert_async.msg`` (torch 2.8): there
# an output-less call is dead code to Inductor; the ``(a!)`` annotation makes it a kept side effect (the
# kernel never writes ``cond``; the check is aten's). Unused where Inductor lowers the guard (2.13).
_lib.define("assert_async_(Tensor(a!) cond, str msg) -> ()")
_lib.impl("assert_async_", lambda cond, msg: torch.ops.aten._assert_async.msg(cond, msg),
          "CompositeExplicitAutograd")
ASSERT_ASYNC = torch.ops.offload_inductor.assert_async_.default

"""Mutable custom ops retargeted to a form every Inductor version runs (the last step of ``inductor`` mode).

Inductor runs a mutable custom op as a ``FallbackKernel`` only if torch could auto-functionalize it, which
torch 2.8 refuses for ops with a ``Functionalize`` kernel; ours need that kernel (AOT must emit the
``*_functional`` twins GE knows). So after :func:`~offload_passes.passes.reinplace.reinplace` each call is
retargeted to its *Inductor alias*, the same schema in ``offload_inductor`` without a Functionalize kernel,
derived from the op's schema and used on every torch version::

    before:  custom.dsa_serve(plan, ..., pool, sel)
    after:   offload_inductor.dsa_serve(plan, ..., pool, sel)      # calls custom.dsa_serve
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import fx

from .. import _compat

log = logging.getLogger("offload_passes.passes.inductor_targets")

from ..custom_ops.inductor_aliases import (  # noqa: F401  (re-exported: the ops live in custom_ops/)
    ASSERT_ASYNC, NAMESPACE, define_aliases, inductor_alias, needs_alias)


@dataclass
class RetargetReport:
    retargeted: dict[str, int] = field(default_factory=dict)  # original op -> calls now using its alias

    def to_dict(self) -> dict:
        return {"retargeted": dict(self.retargeted)}


def retarget_for_inductor(graph: fx.Graph) -> RetargetReport:
    """Point every call of a :func:`needs_alias` op at its alias (arguments and meta unchanged), and the
    guards at :data:`ASSERT_ASYNC` where Inductor would drop them."""
    rep = RetargetReport()
    keep_guards = not _compat.inductor_lowers_assert_async()
    for n in graph.nodes:
        if n.op == "call_function" and needs_alias(n.target):
            key = str(n.target)
            n.target = inductor_alias(n.target)
            rep.retargeted[key] = rep.retargeted.get(key, 0) + 1
        elif keep_guards and n.op == "call_function" and n.target is torch.ops.aten._assert_async.msg:
            n.target = ASSERT_ASYNC
            rep.retargeted["aten._assert_async.msg"] = rep.retargeted.get("aten._assert_async.msg", 0) + 1
    if rep.retargeted:
        log.debug("retargeted for Inductor: %s", rep.retargeted)
    return rep

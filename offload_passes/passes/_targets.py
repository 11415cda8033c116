"""What an FX node calls: the two questions both the FX helpers (``_fx.py``) and the top-k producer table
(``producers.py``) ask, kept below both so that neither imports the other's importer."""
from __future__ import annotations

import operator
from typing import Any, Optional

from torch import fx

from .._compat import OpOverload, OpOverloadPacket


def op_name(node: fx.Node) -> Optional[str]:
    """``"ns::name"`` of an OpOverload / OpOverloadPacket call, else None."""
    if node.op != "call_function":
        return None
    t = node.target
    if isinstance(t, OpOverload):
        return t._schema.name
    if isinstance(t, OpOverloadPacket):
        return t._qualified_op_name
    return None


def getitem_of(node: Any) -> Optional[tuple[fx.Node, int]]:
    """``(tuple node, index)`` if ``node`` is ``operator.getitem(tuple node, int)``, else None."""
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem:
        src, idx = node.args
        if isinstance(src, fx.Node) and isinstance(idx, int):
            return src, idx
    return None

"""GE converter of ``offload_ge::scatter_nd_update``, the op the KV-cache write pass emits (``ge_graph``).

The FX pass that produces it is :func:`offload_passes.passes.cache_writes.cache_writes_to_scatter_nd`
(which also defines the op). The converter emits ``TensorMove(self)`` + ``ScatterNdUpdate``; TorchAir's
``optimize_reference_op_redundant_copy`` then drops the copy (and the write-back ``Assign``) when
``self`` is a graph input nobody else reads, so only the written rows move.
"""
from __future__ import annotations

from typing import Any

import torch

from .. import _compat
from ..passes import cache_writes as _pass  # noqa: F401  (defines offload_ge::scatter_nd_update)


def register_ge_converter() -> None:
    """GE converter: ``TensorMove(self)`` + ``ScatterNdUpdate`` (TorchAir drops the copy for graph inputs)."""
    from torchair import register_fx_node_ge_converter  # public API

    ge = _compat.torchair_ge_apis()  # ScatterNdUpdate has no public builder

    def convert(self, indices, updates, meta_outputs: Any = None):
        copy = ge.TensorMove(self)
        return ge.ScatterNdUpdate(copy, indices, updates)

    convert.__name__ = "convert_offload_ge_scatter_nd_update"
    register_fx_node_ge_converter(torch.ops.offload_ge.scatter_nd_update.default)(convert)

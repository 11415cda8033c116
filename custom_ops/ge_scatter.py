"""``offload_ge::scatter_nd_update``: the functional ScatterNd the GE cache-write pass emits.

TorchAir has no GE converter for ``aten.index_put`` / ``index_copy`` (the model's cache writes);
``passes/cache_writes.py`` turns each write into this op, which converters/ge_cache_write.py lowers to
GE's ``ScatterNdUpdate`` on the cache input (run in place by TorchAir's ref-copy pass). CPU kernel and
fake here; ops are defined in custom_ops/ only.
"""
from __future__ import annotations

import torch

_LIB = torch.library.Library("offload_ge", "FRAGMENT")
_DEFINED = False


def _define() -> None:
    """``offload_ge::scatter_nd_update(self, indices[n,k], updates) -> Tensor`` (functional; CPU + fake)."""
    global _DEFINED
    if _DEFINED or hasattr(torch.ops.offload_ge, "scatter_nd_update"):
        _DEFINED = True
        return
    _LIB.define("scatter_nd_update(Tensor self, Tensor indices, Tensor updates) -> Tensor")

    def cpu(self: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
        k = indices.shape[-1]
        if indices.dim() != 2 or k > self.dim():
            raise ValueError(f"offload_ge::scatter_nd_update: indices must be [n, k] with k <= {self.dim()}, "
                             f"got {list(indices.shape)}")
        out = self.clone()
        out[tuple(indices[:, j] for j in range(k))] = updates.to(self.dtype)
        return out

    def fake(self: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(self)

    _LIB.impl("scatter_nd_update", cpu, "CompositeExplicitAutograd")
    torch.library.register_fake("offload_ge::scatter_nd_update", fake, lib=_LIB)
    _DEFINED = True


_define()

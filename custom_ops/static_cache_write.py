"""``offload_ref::static_cache_write_``: a Hugging Face ``StaticCache`` layer's write, as one op.

``transformers``' ``StaticLayer.update`` writes this step's rows with ``keys.index_copy_(2, cache_position,
key_states)`` (and the same for ``values``). With the caches in pinned host memory and the rows on a CUDA
device, torch refuses that ``index_copy_`` and so does Dynamo while tracing it (its fake propagation checks
devices), so no backend pass can repair it afterwards. The package's host-KV cache
(``offload_passes/hf_cache.py``, ``HostStaticCache``) writes through this op instead:

* ``static_cache_write_(Tensor(a!) keys, Tensor(b!) values, Tensor cache_position, Tensor key_states,
  Tensor value_states) -> ()``: ``keys [B, H, T, Dk]``, ``values [B, H, T, Dv]`` (same ``B, H, T``),
  ``cache_position [S]`` int64 / int32, distinct positions in ``[0, T)``, ``key_states [B, H, S, Dk]``,
  ``value_states [B, H, S, Dv]``, one dtype for a cache and its rows: ``keys[:, :, cache_position[s]] :=
  key_states[:, :, s]``, the same for ``values``. Exactly ``index_copy_(2, ...)``'s result.

Kernels: the CPU kernel is ``index_copy_`` after the checks (so on the CPU the cache holds what a
``StaticCache`` holds, bit for bit); the fake kernel checks shapes and dtypes; the CUDA kernel
(``custom_ops/cuda/static_cache_write.py``) stores every row through the cache's pinned address (no staging
copy, no host synchronisation, capturable) and flags an out-of-range position on the device instead of
asserting. A mutable op without a Functionalize kernel: AOT wraps it in ``auto_functionalized`` and the
reinplace pass (``passes/reinplace.py``) turns it back into this in-place call, as for
``npu_mla_prolog_cache_write_`` (``cache_write.py``).

Bad input (dtype, shape, position out of range or repeated) raises before anything is written.
"""
from __future__ import annotations

import torch

from ._attention_common import REF_NAMESPACE, ref_check, ref_define, ref_impl, ref_register_fake
from .opspec import OpSpec

SPEC = OpSpec(
    namespace=REF_NAMESPACE,
    name="static_cache_write_",
    schema=("static_cache_write_(Tensor(a!) keys, Tensor(b!) values, Tensor cache_position, Tensor key_states, "
            "Tensor value_states) -> ()"),
    role="cache_write",
    summary="a transformers StaticCache layer's write (keys/values[:, :, cache_position] := the step's rows)",
    cuda_kernel="static_cache_write",  # stores through the pinned host cache (custom_ops/cuda/static_cache_write.py)
)
OP = SPEC.name
_INDEX = (torch.int32, torch.int64)


def check_shapes(keys: torch.Tensor, values: torch.Tensor, cache_position: torch.Tensor, key_states: torch.Tensor,
                 value_states: torch.Tensor) -> None:
    """Every check that reads no tensor values (the fake kernel's and the CUDA kernel's host checks)."""
    for name, cache, rows, rname in (("keys", keys, key_states, "key_states"),
                                     ("values", values, value_states, "value_states")):
        ref_check(cache.dim() == 4, OP, f"{name} must be [B, H, T, D], got {tuple(cache.shape)}")
        ref_check(rows.dtype == cache.dtype, OP, f"{rname} dtype {rows.dtype} != {name} dtype {cache.dtype}")
    ref_check(tuple(keys.shape[:3]) == tuple(values.shape[:3]), OP,
              f"keys and values must have the same [B, H, T], got {tuple(keys.shape[:3])} and "
              f"{tuple(values.shape[:3])}")
    ref_check(cache_position.dtype in _INDEX and cache_position.dim() == 1, OP,
              f"cache_position must be a 1-D int32/int64 tensor, got {cache_position.dtype} "
              f"{tuple(cache_position.shape)}")
    B, H, _, _ = keys.shape
    S = cache_position.size(0)
    for name, cache, rows in (("key_states", keys, key_states), ("value_states", values, value_states)):
        want = (B, H, S, cache.size(3))
        ref_check(tuple(rows.shape) == want, OP,
                  f"{name} must be [B, H, S, D] = {want} (S = len(cache_position)), got {tuple(rows.shape)}")


def check_positions(cache_position: torch.Tensor, T: int) -> None:
    """The value checks (CPU kernel): positions in ``[0, T)`` and distinct."""
    if cache_position.numel():
        lo, hi = int(cache_position.min()), int(cache_position.max())
        ref_check(lo >= 0 and hi < T, OP, f"cache_position must be in [0, {T}), got values in [{lo}, {hi}]")
        ref_check(int(torch.unique(cache_position).numel()) == cache_position.numel(), OP,
                  f"cache_position must hold distinct positions, got {cache_position.tolist()[:16]}")


def _fake(keys, values, cache_position, key_states, value_states) -> None:
    check_shapes(keys, values, cache_position, key_states, value_states)


def _cpu(keys, values, cache_position, key_states, value_states) -> None:
    check_shapes(keys, values, cache_position, key_states, value_states)
    check_positions(cache_position, keys.size(2))
    idx = cache_position.long()
    keys.index_copy_(2, idx, key_states)
    values.index_copy_(2, idx, value_states)


def reference_static_cache_write_(keys: torch.Tensor, values: torch.Tensor, cache_position: torch.Tensor,
                                  key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """The oracle: what ``transformers``' ``StaticLayer.update`` does (row by row, no ``index_copy_``)."""
    for s, p in enumerate(cache_position.tolist()):
        keys[:, :, p] = key_states[:, :, s]
        values[:, :, p] = value_states[:, :, s]


ref_define(SPEC.schema)
ref_register_fake(OP, _fake)
ref_impl(OP, "CPU", _cpu)

"""In-place cache writes of the reference graph — **test doubles of NPU ops**, ``offload_ref::``.

On the NPU the reference writes its caches with in-place ops, not with ``index_put_``:

* the KV latent and rope caches inside the fused MLA prolog (``npu_mla_prolog_v3``: ``Tensor(a!)
  kv_cache, Tensor(b!) kr_cache`` written at ``cache_index``, PA_BSND cache layout);
* the indexer's key cache (and the int8 cache's dequant-scale cache) with
  ``torch_npu.npu_scatter_nd_update_``.

Neither loads here (CANN / torch_npu kernels), so these CPU doubles let the model build exactly that
graph shape: mutable custom ops without a Functionalize kernel, which AOT wraps in
``auto_functionalized_v2`` and the reinplace pass must turn back into the in-place call.

* ``offload_ref::npu_mla_prolog_cache_write_(Tensor(a!) kv_cache, Tensor(b!) kr_cache,
  Tensor cache_index, Tensor kv, Tensor kr) -> ()``: only the cache-writing half of the MLA prolog
  (the projections stay in the model): ``kv_cache`` / ``kr_cache`` ``[blocks, BS, 1, D]``, rows
  ``cache_index[t]`` (flat ``block * BS + offset``) := ``kv[t]`` / ``kr[t]``.
* ``offload_ref::npu_scatter_nd_update_(Tensor(a!) self, Tensor indices, Tensor updates) -> ()``:
  ``self[tuple(indices[i])] = updates[i]`` with ``indices [N, k]`` over the first ``k`` dims of
  ``self`` and ``updates [N, *self.shape[k:]]``. torch_npu's op returns ``self`` (``Tensor(a!)``); a
  custom op returning an alias of its input cannot be auto-functionalized, so the double returns
  nothing.

Bad input (dtype, shape, index out of range) raises before anything is written.
"""
from __future__ import annotations

import torch

from ._attention_common import REF_NAMESPACE, ref_check, ref_define, ref_impl, ref_register_fake
from .opspec import OpSpec

PROLOG_SPEC = OpSpec(
    namespace=REF_NAMESPACE,
    name="npu_mla_prolog_cache_write_",
    schema=("npu_mla_prolog_cache_write_(Tensor(a!) kv_cache, Tensor(b!) kr_cache, Tensor cache_index, "
            "Tensor kv, Tensor kr) -> ()"),
    role="cache_write",
    summary="test double of the cache-writing half of npu_mla_prolog_v3 (rows cache_index := kv / kr)",
    cuda_kernel="cache_write",  # the host-KV write of models/glm on CUDA (custom_ops/cuda/cache_write.py)
)
SCATTER_SPEC = OpSpec(
    namespace=REF_NAMESPACE,
    name="npu_scatter_nd_update_",
    schema="npu_scatter_nd_update_(Tensor(a!) self, Tensor indices, Tensor updates) -> ()",
    role="cache_write",
    summary="test double of torch_npu.npu_scatter_nd_update_ (self[indices[i]] := updates[i])",
    cuda_kernel="scatter_nd_update",  # the indexer-cache write of models/glm on CUDA (custom_ops/cuda/scatter_nd_update.py)
)
SPECS = (PROLOG_SPEC, SCATTER_SPEC)
PROLOG, SCATTER = PROLOG_SPEC.name, SCATTER_SPEC.name
_INDEX = (torch.int32, torch.int64)


def _check_rows(op: str, name: str, rows: torch.Tensor, limit: int) -> None:
    if rows.numel():
        lo, hi = int(rows.min()), int(rows.max())
        ref_check(lo >= 0 and hi < limit, op, f"{name} must be in [0, {limit}), got values in [{lo}, {hi}]")


def _check_prolog(kv_cache, kr_cache, cache_index, kv, kr) -> None:
    for name, cache, val in (("kv_cache", kv_cache, kv), ("kr_cache", kr_cache, kr)):
        ref_check(cache.dim() == 4 and cache.size(2) == 1, PROLOG,
                  f"{name} must be [blocks, block_size, 1, D], got {tuple(cache.shape)}")
        ref_check(val.dim() == 2 and val.size(1) == cache.size(3), PROLOG,
                  f"{name[:2]} must be [T, {cache.size(3)}] (D of {name}), got {tuple(val.shape)}")
        ref_check(val.dtype == cache.dtype, PROLOG, f"{name[:2]} dtype {val.dtype} != {name} dtype {cache.dtype}")
    ref_check(kv_cache.shape[:2] == kr_cache.shape[:2], PROLOG,
              f"kv_cache and kr_cache must have the same [blocks, block_size], got {tuple(kv_cache.shape[:2])} "
              f"and {tuple(kr_cache.shape[:2])}")
    ref_check(cache_index.dtype in _INDEX and cache_index.dim() == 1, PROLOG,
              f"cache_index must be a 1-D int32/int64 tensor, got {cache_index.dtype} {tuple(cache_index.shape)}")
    ref_check(cache_index.size(0) == kv.size(0) == kr.size(0), PROLOG,
              f"cache_index, kv and kr must have the same T, got {cache_index.size(0)}, {kv.size(0)}, {kr.size(0)}")


def _prolog_fake(kv_cache, kr_cache, cache_index, kv, kr) -> None:
    _check_prolog(kv_cache, kr_cache, cache_index, kv, kr)


def _prolog_cpu(kv_cache, kr_cache, cache_index, kv, kr) -> None:
    _check_prolog(kv_cache, kr_cache, cache_index, kv, kr)
    rows = kv_cache.size(0) * kv_cache.size(1)
    _check_rows(PROLOG, "cache_index", cache_index, rows)
    idx = cache_index.long()
    # view(-1, D) of a [blocks, BS, 1, D] buffer: the rows are the cache's own storage
    kv_cache.view(rows, kv_cache.size(3)).index_copy_(0, idx, kv)
    kr_cache.view(rows, kr_cache.size(3)).index_copy_(0, idx, kr)


def _check_scatter(self, indices, updates) -> None:
    ref_check(indices.dtype in _INDEX and indices.dim() == 2, SCATTER,
              f"indices must be a 2-D int32/int64 tensor [N, k], got {indices.dtype} {tuple(indices.shape)}")
    k = indices.size(1)
    ref_check(1 <= k <= self.dim(), SCATTER, f"indices' last dim k must be in [1, self.dim()={self.dim()}], got {k}")
    want = (indices.size(0), *self.shape[k:])
    ref_check(tuple(updates.shape) == want, SCATTER,
              f"updates must be [N, *self.shape[k:]] = {want}, got {tuple(updates.shape)}")
    ref_check(updates.dtype == self.dtype, SCATTER, f"updates dtype {updates.dtype} != self dtype {self.dtype}")


def _scatter_fake(self, indices, updates) -> None:
    _check_scatter(self, indices, updates)


def _scatter_cpu(self, indices, updates) -> None:
    _check_scatter(self, indices, updates)
    idx = indices.long()
    for d in range(idx.size(1)):
        _check_rows(SCATTER, f"indices[:, {d}]", idx[:, d], self.size(d))
    self[tuple(idx.unbind(1))] = updates


ref_define(PROLOG_SPEC.schema)
ref_register_fake(PROLOG, _prolog_fake)
ref_impl(PROLOG, "CPU", _prolog_cpu)
ref_define(SCATTER_SPEC.schema)
ref_register_fake(SCATTER, _scatter_fake)
ref_impl(SCATTER, "CPU", _scatter_cpu)

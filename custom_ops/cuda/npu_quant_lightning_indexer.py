"""Device implementation of ``offload_ref::npu_quant_lightning_indexer`` (twin of
``reference_npu_quant_lightning_indexer``, docs/ops.md §6.3): the score kernel, top-k and finish of
``npu_lightning_indexer.py`` with ``QUANT`` on. The int8 dot is an exact integer on any device; the dequant
scale products, the ReLU and the head sum are the reference's fp32 operations in its order.
"""
from __future__ import annotations

from .. import npu_quant_lightning_indexer as M
from ._common import CudaOp
from .npu_lightning_indexer import checks_for, topk

OP = M.OP


def _validate(a: tuple, op: str) -> tuple:
    (query, key, weights, qscale, kscale, qmode, kmode, cu_q, kv_len, table, layout_query, layout_key,
     sparse_count, sparse_mode, _pre, _next, query_dtype, key_dtype) = a
    info = M.validate_npu_quant_lightning_indexer(query, key, weights, qscale, kscale, qmode, kmode, cu_q, kv_len,
                                                  table, layout_query, layout_key, sparse_count, sparse_mode,
                                                  query_dtype, key_dtype)
    return info, checks_for(OP, info, key, table, cu_q, layout_query, layout_key)


def _launch(a: tuple, checked: tuple):
    (query, key, weights, qscale, kscale, _qmode, _kmode, cu_q, kv_len, table, layout_query, layout_key,
     sparse_count, sparse_mode) = a[:14]
    info, checks = checked
    return topk(query, key, weights, qscale, kscale, cu_q, kv_len, table, layout_query, layout_key, sparse_count,
                sparse_mode, info, checks)


#: ``offload_ref::npu_quant_lightning_indexer`` on CUDA (``_common.CudaOp``: validated once per signature with
#: the CPU reference's own checks; the data checks on the device)
KERNELS = CudaOp(M.SPEC, _validate, _launch)
run, register = KERNELS.run, KERNELS.register

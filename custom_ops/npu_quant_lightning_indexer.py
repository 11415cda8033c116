"""offload_ref::npu_quant_lightning_indexer — CPU reference of torch_npu's int8 ("C8") lightning indexer.

Same schema as ``torch.ops.npu.npu_quant_lightning_indexer`` (torch_npu's native_functions, TorchAir's
``QuantLightningIndexer`` converter) in the ``offload_ref`` namespace. It returns ONE tensor, the top-k
ids (``sparse_indices``), not the ``(indices, values)`` pair of ``npu_lightning_indexer``.

Semantics (CANN's QuantLightningIndexer formula; per query token ``t`` of batch ``b``, ``i`` = position
of ``t`` among the ``Sq`` query tokens of ``b``)::

    n       = L[b] - Sq + i + 1   (sparse_mode 3, right-down causal)   |   L[b]   (sparse_mode 0)
    score_j = sum_h W[t, h] * relu( (qscale[t, h] * kscale[j]) * (Qq[t, h] . Kq[j]) )      for j < n
    out[t, 0, :min(K, n)] = ids of the largest scores (score desc, ties: smaller id first); rest = -1

``Qq``/``Kq`` are int8 (the int8 dot product is exact, accumulated in int32 range then fp32), the
dequant scales are per token and head (query, ``[T, N]`` / ``[B, S, N]``) and per key token (key,
``key.shape[:3]`` = ``[blocks, block_size, 1]`` paged or ``[B, S_kv, 1]``), float16 (A3) or float32;
weights float16 or float32. Scale products, ReLU and the head sum are fp32.

Supported: ``query_quant_mode = key_quant_mode = 0`` (per-token(-head) scales, the only mode the recipe
uses), int8 query and key, ``query_dtype = key_dtype = None`` (they only select HiFloat8 on Ascend 950).
Float8 / HiFloat8 caches (Ascend 950) raise. Layouts, lengths and block-table rules are those of
``npu_lightning_indexer.py`` (shared checks in ``_attention_common.py``).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

# the layout / length / block-table checks and the top-k core are npu_lightning_indexer's (shared module)
from ._attention_common import (REF_NAMESPACE, check_indexer_key, check_indexer_query_lengths, check_kv_layout,
                                check_layouts, check_query_shape, check_sparse_count, fold_heads, indexer_out_shape,
                                indexer_reference, ref_check, ref_define, ref_impl, ref_register_fake)
from .opspec import OpSpec, shared_limits

log = logging.getLogger("offload_passes.custom_ops.npu_quant_lightning_indexer")

SPEC = OpSpec(
    namespace=REF_NAMESPACE,
    name="npu_quant_lightning_indexer",
    schema=(
        "npu_quant_lightning_indexer(Tensor query, Tensor key, Tensor weights, Tensor query_dequant_scale, "
        "Tensor key_dequant_scale, int query_quant_mode, int key_quant_mode, *, "
        "Tensor? actual_seq_lengths_query=None, Tensor? actual_seq_lengths_key=None, Tensor? block_table=None, "
        "str layout_query=\"BSND\", str layout_key=\"BSND\", int sparse_count=2048, int sparse_mode=3, "
        "int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, "
        "int? query_dtype=None, int? key_dtype=None) -> Tensor"
    ),
    role="decode",
    summary="CPU reference of torch_npu's int8 (quantised) decode lightning indexer",
    # ge=None: no converter of ours; on an NPU the model calls torch.ops.npu.npu_quant_lightning_indexer,
    # which TorchAir's own converter lowers
    limits=shared_limits("INDEXER_MAX_SPARSE_COUNT"),
    cuda_kernel="npu_quant_lightning_indexer",  # custom_ops/cuda/npu_quant_lightning_indexer.py
)
OP = SPEC.name

#: torch_npu's documented upper limit of ``sparse_count``.
MAX_SPARSE_COUNT = SPEC.limit("INDEXER_MAX_SPARSE_COUNT")
#: Quantised operand dtype the reference computes with.
QUANT_DTYPES = (torch.int8,)
#: weights / dequant-scale dtypes of the documented op.
SCALE_DTYPES = (torch.float16, torch.float32)
#: Ascend 950 cache dtypes (float8 e4m3 / e5m2); named in the error, never computed.
FLOAT8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))

# --------------------------------------------------------------------------------------------
# validation (shapes, dtypes, attributes only: shared by the fake and the CPU kernel)
# --------------------------------------------------------------------------------------------


def _check_quant_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype in FLOAT8_DTYPES:
        ref_check(False, OP, f"{name} is {t.dtype}: float8 indexer caches are Ascend 950 only; the CPU "
                             "reference supports int8 (li_cache_quant_mode 'int8') only")
    ref_check(t.dtype in QUANT_DTYPES, OP, f"{name} must be int8, got {t.dtype}")


def validate_npu_quant_lightning_indexer(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    query_dequant_scale: torch.Tensor,
    key_dequant_scale: torch.Tensor,
    query_quant_mode: int,
    key_quant_mode: int,
    actual_seq_lengths_query: Optional[torch.Tensor],
    actual_seq_lengths_key: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor],
    layout_query: str,
    layout_key: str,
    sparse_count: int,
    sparse_mode: int,
    query_dtype: Optional[int],
    key_dtype: Optional[int],
) -> dict:
    """Check every supported-case limit; return ``{B, S, T, N, D}`` (S = None for ragged TND)."""
    op = OP
    check_layouts(op, layout_query, layout_key, sparse_mode, layout_arg="layout_key")
    check_sparse_count(op, sparse_count)
    ref_check(query_quant_mode == 0, op,
              f"query_quant_mode must be 0 (per-token-head dequant scales), got {query_quant_mode}")
    ref_check(key_quant_mode == 0, op, f"key_quant_mode must be 0 (per-token dequant scales), got {key_quant_mode}")
    for name, v in (("query_dtype", query_dtype), ("key_dtype", key_dtype)):
        ref_check(v is None, op, f"{name} must be None ({name} only selects HiFloat8 on Ascend 950), got {v}")
    _check_quant_dtype("query", query)
    _check_quant_dtype("key", key)
    for name, t in (("weights", weights), ("query_dequant_scale", query_dequant_scale),
                    ("key_dequant_scale", key_dequant_scale)):
        ref_check(t.dtype in SCALE_DTYPES, op, f"{name} must be float16/float32, got {t.dtype}")

    B, S, T, N, D = check_query_shape(op, query, layout_query, actual_seq_lengths_query)
    if layout_query == "TND":
        per_token = (T, N)
        B = actual_seq_lengths_query.size(0) if actual_seq_lengths_query.dim() == 1 else -1
    else:
        per_token = (B, S, N)
    for name, t in (("weights", weights), ("query_dequant_scale", query_dequant_scale)):
        ref_check(
            tuple(t.shape) == per_token,
            op,
            f"{name} must be {list(per_token)} for layout_query {layout_query!r}, got {list(t.shape)}",
        )
    check_indexer_query_lengths(op, actual_seq_lengths_query, B)
    check_indexer_key(op, key, layout_key, D)
    ref_check(
        tuple(key_dequant_scale.shape) == tuple(key.shape[:3]),
        op,
        f"key_dequant_scale must be key.shape[:3] = {list(key.shape[:3])} (one scale per key token), "
        f"got {list(key_dequant_scale.shape)}",
    )
    check_kv_layout(
        op, key, block_table, actual_seq_lengths_key, layout_key, B,
        layout_arg="layout_key", lengths_arg="actual_seq_lengths_key",
    )
    return {"B": B, "S": S, "T": T, "N": N, "D": D}


def _fake(
    query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode, key_quant_mode, *,
    actual_seq_lengths_query=None, actual_seq_lengths_key=None, block_table=None,
    layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
    pre_tokens=9223372036854775807, next_tokens=9223372036854775807, query_dtype=None, key_dtype=None,
):
    info = validate_npu_quant_lightning_indexer(
        query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode, key_quant_mode,
        actual_seq_lengths_query, actual_seq_lengths_key, block_table, layout_query, layout_key,
        sparse_count, sparse_mode, query_dtype, key_dtype,
    )
    return query.new_empty(indexer_out_shape(info, layout_query, sparse_count), dtype=torch.int32)


def reference_npu_quant_lightning_indexer(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    query_dequant_scale: torch.Tensor,
    key_dequant_scale: torch.Tensor,
    query_quant_mode: int,
    key_quant_mode: int,
    *,  # keyword arguments: torch_npu's schema (SPEC.schema), those of npu_lightning_indexer plus the dtypes
    actual_seq_lengths_query: Optional[torch.Tensor] = None, actual_seq_lengths_key: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None, layout_query: str = "BSND", layout_key: str = "BSND",
    sparse_count: int = 2048, sparse_mode: int = 3,
    pre_tokens: int = 9223372036854775807, next_tokens: int = 9223372036854775807,
    query_dtype: Optional[int] = None, key_dtype: Optional[int] = None,
) -> torch.Tensor:
    """Pure-torch reference (vectorised over tokens and heads; exact int8 dots, fp32 scaling)."""
    info = validate_npu_quant_lightning_indexer(
        query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode, key_quant_mode,
        actual_seq_lengths_query, actual_seq_lengths_key, block_table, layout_query, layout_key,
        sparse_count, sparse_mode, query_dtype, key_dtype,
    )
    T, N, D = info["T"], info["N"], info["D"]

    def score(rows: torch.Tensor) -> torch.Tensor:
        keys = key.reshape(-1, D)[rows]  # [T, nmax, D] int8
        kscale = key_dequant_scale.reshape(-1)[rows].float()  # [T, nmax]
        q = query.reshape(T, N, D)
        # int8 x int8 dot: |.| <= 128*128*D, exact in int64 and (for D <= 1024) in fp32.
        dots = torch.bmm(q.to(torch.int64), keys.to(torch.int64).transpose(1, 2)).float()  # [T, N, nmax]
        qscale = query_dequant_scale.reshape(T, N).float()
        scaled = torch.relu((qscale.unsqueeze(2) * kscale.unsqueeze(1)) * dots)  # [T, N, nmax]
        w = weights.reshape(T, N).float()
        return fold_heads(w.unsqueeze(2) * scaled)  # [T, nmax]: the heads summed in order (docs/ops.md §6.3)

    # window, key gather and top-k are shared with npu_lightning_indexer
    return indexer_reference(
        OP, info, key, block_table, actual_seq_lengths_query, actual_seq_lengths_key,
        layout_query, layout_key, sparse_count, sparse_mode, score,
    )


def _cpu(query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode, key_quant_mode, **kwargs):
    return reference_npu_quant_lightning_indexer(
        query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode, key_quant_mode, **kwargs
    )


ref_define(SPEC.schema)
ref_register_fake(OP, _fake)
ref_impl(OP, "CPU", _cpu)

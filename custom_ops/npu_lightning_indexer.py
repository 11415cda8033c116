"""offload_ref::npu_lightning_indexer — CPU reference of torch_npu's decode lightning indexer (docs/ops.md §6.1).

Same schema as ``torch.ops.npu.npu_lightning_indexer`` but in the ``offload_ref`` namespace, so it never
clashes with torch_npu. Semantics (per query token ``t`` of batch ``b``, ``i`` = position of ``t`` among
the ``Sq`` query tokens of ``b``)::

    n     = L[b] - Sq + i + 1   (sparse_mode 3, right-down causal)   |   L[b]   (sparse_mode 0)
    score_j = sum_h weights[t, h] * relu(query[t, h] . key_j)          for j < n   (fp32, fixed order)
    out[t, 0, :min(K, n)] = ids of the largest scores (score desc, ties: smaller id first); rest = -1

Supported layouts: query ``TND`` (``[T, N, D]``, ``actual_seq_lengths_query`` cumulative, required) or
``BSND`` (``[B, S, N, D]``); key ``PA_BSND`` (``[blocks, block_size, 1, D]`` + ``block_table`` +
``actual_seq_lengths_key``, required) or ``BSND`` (``[B, S_kv, 1, D]``). ``return_value=True`` and any
other layout / sparse mode raise. ``pre_tokens``/``next_tokens`` are accepted and ignored (the decode
path uses sparse_mode 3, where the NPU ignores them too).

The ``offload_ref`` registration helpers and the kv-side checks shared with
``npu_sparse_flash_attention.py`` live in ``_attention_common.py``.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from ._attention_common import (  # noqa: F401  (REF_NAMESPACE, FLOAT_DTYPES: re-exported)
    FLOAT_DTYPES,
    REF_NAMESPACE,
    check_indexer_key,
    check_indexer_query_lengths,
    check_kv_layout,
    check_layouts,
    check_query_shape,
    check_sparse_count,
    fold_heads,
    indexer_out_shape,
    indexer_reference,
    pairwise_sum,
    ref_check,
    ref_define,
    ref_impl,
    ref_register_fake,
)
from .opspec import GeOp, OpSpec, shared_limits

log = logging.getLogger("offload_passes.custom_ops.npu_lightning_indexer")

SPEC = OpSpec(
    namespace=REF_NAMESPACE,
    name="npu_lightning_indexer",
    schema=(
        "npu_lightning_indexer(Tensor query, Tensor key, Tensor weights, *, "
        "Tensor? actual_seq_lengths_query=None, Tensor? actual_seq_lengths_key=None, "
        "Tensor? block_table=None, str layout_query=\"BSND\", str layout_key=\"BSND\", "
        "int sparse_count=2048, int sparse_mode=3, int pre_tokens=9223372036854775807, "
        "int next_tokens=9223372036854775807, bool return_value=False) -> (Tensor, Tensor)"
    ),
    role="decode",
    summary="CPU reference of torch_npu's decode lightning indexer (top-k key ids per query token)",
    limits=shared_limits("INDEXER_MAX_SPARSE_COUNT"),
    ge=GeOp("LightningIndexer", outputs=("sparse_indices", "sparse_values"),
            attr_names={"return_value": "return_values"}),
    cuda_kernel="npu_lightning_indexer",  # custom_ops/cuda/npu_lightning_indexer.py
)
OP = SPEC.name

#: elements of the reference's product tensor per chunk of the key window (about 4 MB of fp32)
_SCORE_CHUNK = 1 << 20

#: torch_npu's documented upper limit of ``sparse_count``.
MAX_SPARSE_COUNT = SPEC.limit("INDEXER_MAX_SPARSE_COUNT")

# --------------------------------------------------------------------------------------------
# validation (shapes, dtypes, attributes only: shared by the fake and the CPU kernel)
# --------------------------------------------------------------------------------------------


def validate_npu_lightning_indexer(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    actual_seq_lengths_query: Optional[torch.Tensor],
    actual_seq_lengths_key: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor],
    layout_query: str,
    layout_key: str,
    sparse_count: int,
    sparse_mode: int,
    return_value: bool,
) -> dict:
    """Check every supported-case limit; return ``{B, S, T, N, D}`` (S = None for ragged TND)."""
    op = OP
    check_layouts(op, layout_query, layout_key, sparse_mode, layout_arg="layout_key")
    ref_check(not return_value, op, "return_value=True is not supported by the CPU reference (must be False)")
    check_sparse_count(op, sparse_count)
    for name, t in (("query", query), ("key", key), ("weights", weights)):
        ref_check(t.dtype in FLOAT_DTYPES, op, f"{name} must be float16/bfloat16/float32, got {t.dtype}")
    ref_check(key.dtype == query.dtype, op, f"key dtype {key.dtype} must equal query dtype {query.dtype}")

    B, S, T, N, D = check_query_shape(op, query, layout_query, actual_seq_lengths_query)
    if layout_query == "TND":
        ref_check(
            weights.dim() == 2 and tuple(weights.shape) == (T, N),
            op,
            f"weights must be [T={T}, N={N}] for layout_query 'TND', got {tuple(weights.shape)}",
        )
        B = actual_seq_lengths_query.size(0) if actual_seq_lengths_query.dim() == 1 else -1
    else:
        ref_check(
            weights.dim() == 3 and tuple(weights.shape) == (B, S, N),
            op,
            f"weights must be [B={B}, S={S}, N={N}] for layout_query 'BSND', got {tuple(weights.shape)}",
        )
    check_indexer_query_lengths(op, actual_seq_lengths_query, B)
    check_indexer_key(op, key, layout_key, D)
    check_kv_layout(
        op, key, block_table, actual_seq_lengths_key, layout_key, B,
        layout_arg="layout_key", lengths_arg="actual_seq_lengths_key",
    )
    return {"B": B, "S": S, "T": T, "N": N, "D": D}


def _fake(
    query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None, block_table=None,
    layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
    pre_tokens=9223372036854775807, next_tokens=9223372036854775807, return_value=False,
):
    info = validate_npu_lightning_indexer(
        query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
        layout_query, layout_key, sparse_count, sparse_mode, return_value,
    )
    out = query.new_empty(indexer_out_shape(info, layout_query, sparse_count), dtype=torch.int32)
    return out, query.new_empty((0,))


def reference_npu_lightning_indexer(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    *,
    actual_seq_lengths_query: Optional[torch.Tensor] = None,
    actual_seq_lengths_key: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    layout_query: str = "BSND",
    layout_key: str = "BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
    pre_tokens: int = 9223372036854775807,
    next_tokens: int = 9223372036854775807,
    return_value: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference (vectorised over tokens and heads; fp32 accumulation)."""
    info = validate_npu_lightning_indexer(
        query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
        layout_query, layout_key, sparse_count, sparse_mode, return_value,
    )
    T, N, D = info["T"], info["N"], info["D"]

    def score(rows: torch.Tensor) -> torch.Tensor:
        nmax = rows.size(1)
        keys = key.reshape(-1, D)[rows].float().permute(2, 0, 1)  # [D, T, nmax]
        q = query.reshape(T, N, D).float().permute(2, 1, 0).unsqueeze(-1)  # [D, N, T, 1]
        w = weights.reshape(T, N).float().t().unsqueeze(-1)  # [N, T, 1]
        # score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[t, j]) in fp32, in the order docs/ops.md §6.1 fixes:
        # each dot a pairwise sum of its products, the heads summed in order. Products [D, N, T, chunk], the
        # sum over D first: its halves are contiguous (the same arithmetic in any layout; a few MB per chunk)
        terms = torch.empty((N, T, nmax), dtype=torch.float32)
        step = max(1, _SCORE_CHUNK // (D * N * max(T, 1)))
        for j0 in range(0, nmax, step):
            chunk = keys[:, None, :, j0:j0 + step]
            terms[:, :, j0:j0 + step] = w * torch.relu(pairwise_sum(q * chunk, dim=0))
        return fold_heads(terms.transpose(0, 1))  # [T, nmax]

    # window, key gather and top-k (score desc, ties by ascending id, -1 beyond min(K, n)) are shared
    # with the int8 indexer
    out = indexer_reference(
        OP, info, key, block_table, actual_seq_lengths_query, actual_seq_lengths_key,
        layout_query, layout_key, sparse_count, sparse_mode, score,
    )
    return out, query.new_empty((0,))


def _cpu(query, key, weights, **kwargs):
    return reference_npu_lightning_indexer(query, key, weights, **kwargs)


ref_define(SPEC.schema)
ref_register_fake(OP, _fake)
ref_impl(OP, "CPU", _cpu)

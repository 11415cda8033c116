"""offload_ref::npu_lightning_indexer — CPU reference of torch_npu's decode lightning indexer (spec/ops.md §6.1).

Same schema as ``torch.ops.npu.npu_lightning_indexer`` but in the ``offload_ref`` namespace, so it never
clashes with torch_npu. Semantics (per query token ``t`` of batch ``b``, ``i`` = position of ``t`` among
the ``Sq`` query tokens of ``b``)::

    n     = L[b] - Sq + i + 1   (sparse_mode 3, right-down causal)   |   L[b]   (sparse_mode 0)
    score_j = sum_h weights[t, h] * relu(query[t, h] . key_j)          for j < n   (fp32 accumulate)
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
    INDEX_DTYPES,
    REF_NAMESPACE,
    check_kv_layout,
    check_query_shape,
    indexer_topk,
    indexer_window,
    kv_addressing,
    paged_rows,
    ref_check,
    ref_define,
    ref_impl,
    ref_register_fake,
    token_positions,
)

log = logging.getLogger("offload_passes.custom_ops.npu_lightning_indexer")

SCHEMA = (
    "npu_lightning_indexer(Tensor query, Tensor key, Tensor weights, *, "
    "Tensor? actual_seq_lengths_query=None, Tensor? actual_seq_lengths_key=None, "
    "Tensor? block_table=None, str layout_query=\"BSND\", str layout_key=\"BSND\", "
    "int sparse_count=2048, int sparse_mode=3, int pre_tokens=9223372036854775807, "
    "int next_tokens=9223372036854775807, bool return_value=False) -> (Tensor, Tensor)"
)
OP = "npu_lightning_indexer"

#: torch_npu's documented upper limit of ``sparse_count``.
MAX_SPARSE_COUNT = 2048

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
    ref_check(layout_query in ("TND", "BSND"), op, f"layout_query must be 'TND' or 'BSND', got {layout_query!r}")
    ref_check(
        layout_key in ("PA_BSND", "BSND"), op, f"layout_key must be 'PA_BSND' or 'BSND', got {layout_key!r}"
    )
    ref_check(sparse_mode in (0, 3), op, f"sparse_mode must be 0 or 3, got {sparse_mode}")
    ref_check(not return_value, op, "return_value=True is not supported by the CPU reference (must be False)")
    ref_check(
        0 < sparse_count <= MAX_SPARSE_COUNT,
        op,
        f"sparse_count must be in (0, {MAX_SPARSE_COUNT}], got {sparse_count}",
    )
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
    if actual_seq_lengths_query is not None:
        ref_check(
            actual_seq_lengths_query.dim() == 1 and actual_seq_lengths_query.size(0) == B and B > 0,
            op,
            f"actual_seq_lengths_query must be 1-D of length B={B} (> 0), got {tuple(actual_seq_lengths_query.shape)}",
        )
        ref_check(
            actual_seq_lengths_query.dtype in INDEX_DTYPES,
            op,
            f"actual_seq_lengths_query must be int32/int64, got {actual_seq_lengths_query.dtype}",
        )

    ref_check(key.dim() == 4, op, f"key must be 4-D ({layout_key}), got {key.dim()}-D")
    ref_check(key.size(2) == 1, op, f"key dim 2 (key heads N2) must be 1, got {key.size(2)}")
    ref_check(key.size(3) == D, op, f"key head dim {key.size(3)} must equal query head dim D={D}")
    check_kv_layout(
        op, key, block_table, actual_seq_lengths_key, layout_key, B,
        layout_arg="layout_key", lengths_arg="actual_seq_lengths_key",
    )
    return {"B": B, "S": S, "T": T, "N": N, "D": D}


def _out_shape(info: dict, layout_query: str, K: int) -> tuple:
    if layout_query == "TND":
        return (info["T"], 1, K)
    return (info["B"], info["S"], 1, K)


def _fake(
    query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None, block_table=None,
    layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
    pre_tokens=9223372036854775807, next_tokens=9223372036854775807, return_value=False,
):
    info = validate_npu_lightning_indexer(
        query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
        layout_query, layout_key, sparse_count, sparse_mode, return_value,
    )
    out = query.new_empty(_out_shape(info, layout_query, sparse_count), dtype=torch.int32)
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
    B, T, D = info["B"], info["T"], info["D"]
    K = sparse_count
    b_of_t, i_of_t, sq_of_t = token_positions(layout_query, actual_seq_lengths_query, T, info["S"], OP)
    q = query.reshape(T, info["N"], D)
    w = weights.reshape(T, info["N"])
    table, kv_len, num_blocks, bs = kv_addressing(key, block_table, actual_seq_lengths_key, layout_key, B)
    ref_check(bool((kv_len >= 0).all().item()), OP, "actual_seq_lengths_key must be >= 0")

    n, nmax = indexer_window(kv_len, b_of_t, i_of_t, sq_of_t, sparse_mode)  # n <= 0: the row is all -1
    score = torch.zeros((T, 0), dtype=torch.float32)
    needed = torch.zeros((T, 0), dtype=torch.bool)
    if nmax > 0:
        pos = torch.arange(nmax, dtype=torch.int64)
        needed = pos.unsqueeze(0) < n.unsqueeze(1)  # [T, nmax]
        rows = paged_rows(
            table, b_of_t.unsqueeze(1).expand(T, nmax), pos.unsqueeze(0).expand(T, nmax), needed, bs, num_blocks, OP
        )
        keys = key.reshape(num_blocks * bs, D)[rows]  # [T, nmax, D]
        # score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[t, j])   (fp32 accumulate)
        dots = torch.bmm(q.float(), keys.float().transpose(1, 2))  # [T, N, nmax]
        score = torch.bmm(w.float().unsqueeze(1), torch.relu(dots)).squeeze(1)  # [T, nmax]
    # score desc, ties by ascending id (stable sort), -1 beyond min(K, n) (shared with the int8 indexer)
    out = indexer_topk(score, n, needed, K).view(_out_shape(info, layout_query, K))
    return out, query.new_empty((0,))


def _cpu(query, key, weights, **kwargs):
    return reference_npu_lightning_indexer(query, key, weights, **kwargs)


ref_define(SCHEMA)
ref_register_fake(OP, _fake)
ref_impl(OP, "CPU", _cpu)

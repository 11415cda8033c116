"""offload_ref::npu_sparse_flash_attention — CPU reference of torch_npu's SFA decode path (docs/ops.md §6.2).

Same schema as ``torch.ops.npu.npu_sparse_flash_attention`` in the ``offload_ref`` namespace. Semantics
(per query token ``t`` of batch ``b``, ``i`` = its position among the ``Sq`` query tokens of ``b``)::

    lim = actual_seq_lengths_kv[b] - Sq + i     (sparse_mode 3)   |   actual_seq_lengths_kv[b] - 1   (mode 0)
    P   = [p in sparse_indices[t, 0, :] if p != -1 and 0 <= p <= lim]
    z_p = scale * (q[t, h] . k(p) + q_rope[t, h] . k_rope(p))          (accumulated in fp64)
    out[t, h] = sum_p softmax(z)_p * v(p)      (v = value, or key when value is None; no P -> zeros)

``k(p)`` is read through the block table: ``key[block_table[b, p // bs], p % bs, 0]``.

Supported: ``attention_mode=2`` (MLA absorb: score on nope + rope parts, value = the nope key),
``sparse_block_size=1``, ``sparse_mode`` 0 or 3, query layout ``TND`` (cumulative
``actual_seq_lengths_query`` required) or ``BSND``, kv layout ``PA_BSND`` (``block_table`` and
``actual_seq_lengths_kv`` required) or ``BSND``, one kv head, ``return_softmax_lse=False`` (outputs 1
and 2 are empty fp32 tensors), no ``sinks``. Anything else raises a ``RuntimeError`` naming the argument.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from ._attention_common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    REF_NAMESPACE,
    check_kv_layout,
    check_layouts,
    check_query_shape,
    kv_addressing,
    paged_rows,
    ref_check,
    ref_define,
    ref_impl,
    ref_register_fake,
    token_positions,
)
from .opspec import GeOp, OpSpec

log = logging.getLogger("offload_passes.custom_ops.npu_sparse_flash_attention")

SPEC = OpSpec(
    namespace=REF_NAMESPACE,
    name="npu_sparse_flash_attention",
    schema=(
        "npu_sparse_flash_attention(Tensor query, Tensor key, Tensor? value, Tensor sparse_indices, "
        "float scale_value, *, Tensor? block_table=None, Tensor? actual_seq_lengths_query=None, "
        "Tensor? actual_seq_lengths_kv=None, Tensor? query_rope=None, Tensor? key_rope=None, "
        "int sparse_block_size=1, str layout_query=\"BSND\", str layout_kv=\"BSND\", int sparse_mode=3, "
        "int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, int attention_mode=0, "
        "bool return_softmax_lse=False, Tensor? sinks=None) -> (Tensor, Tensor, Tensor)"
    ),
    role="decode",
    summary="CPU reference of torch_npu's sparse flash attention over the selected KV rows",
    ge=GeOp("SparseFlashAttention", outputs=("attention_out", "softmax_max", "softmax_sum"), omit_if_none=("sinks",)),
    cuda_kernel="npu_sparse_flash_attention",  # custom_ops/cuda/npu_sparse_flash_attention.py
)
OP = SPEC.name


def validate_npu_sparse_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: Optional[torch.Tensor],
    sparse_indices: torch.Tensor,
    block_table: Optional[torch.Tensor],
    actual_seq_lengths_query: Optional[torch.Tensor],
    actual_seq_lengths_kv: Optional[torch.Tensor],
    query_rope: Optional[torch.Tensor],
    key_rope: Optional[torch.Tensor],
    sparse_block_size: int,
    layout_query: str,
    layout_kv: str,
    sparse_mode: int,
    attention_mode: int,
    return_softmax_lse: bool,
    sinks: Optional[torch.Tensor],
) -> dict:
    """Shapes, dtypes and attributes (fake-safe). Returns ``{B, S, T, N, D, K}``."""
    op = OP
    check_layouts(op, layout_query, layout_kv, sparse_mode, layout_arg="layout_kv")
    ref_check(
        attention_mode == 2,
        op,
        f"attention_mode must be 2 (MLA absorb, the only mode the CPU reference implements), got {attention_mode}",
    )
    ref_check(sparse_block_size == 1, op, f"sparse_block_size must be 1, got {sparse_block_size}")
    ref_check(not return_softmax_lse, op, "return_softmax_lse=True is not supported by the CPU reference")
    ref_check(sinks is None, op, "sinks are not supported by the CPU reference (must be None)")
    ref_check(query.dtype in FLOAT_DTYPES, op, f"query must be float16/bfloat16/float32, got {query.dtype}")
    ref_check(key.dtype == query.dtype, op, f"key dtype {key.dtype} must equal query dtype {query.dtype}")
    ref_check(
        sparse_indices.dtype == torch.int32, op, f"sparse_indices must be int32, got {sparse_indices.dtype}"
    )

    B, S, T, N, D = check_query_shape(op, query, layout_query, actual_seq_lengths_query)
    if layout_query == "TND":
        ref_check(
            actual_seq_lengths_query.dim() == 1 and actual_seq_lengths_query.size(0) > 0,
            op,
            f"actual_seq_lengths_query must be 1-D and non-empty, got {tuple(actual_seq_lengths_query.shape)}",
        )
        B = actual_seq_lengths_query.size(0)
        ref_check(
            sparse_indices.dim() == 3 and sparse_indices.size(0) == T and sparse_indices.size(1) == 1,
            op,
            f"sparse_indices must be [T={T}, 1, K] for layout_query 'TND', got {tuple(sparse_indices.shape)}",
        )
    else:
        ref_check(
            sparse_indices.dim() == 4 and tuple(sparse_indices.shape[:3]) == (B, S, 1),
            op,
            f"sparse_indices must be [B={B}, S={S}, 1, K] for layout_query 'BSND', got "
            f"{tuple(sparse_indices.shape)}",
        )
        if actual_seq_lengths_query is not None:
            ref_check(
                actual_seq_lengths_query.dim() == 1 and actual_seq_lengths_query.size(0) == B,
                op,
                f"actual_seq_lengths_query must be 1-D of length B={B}, got {tuple(actual_seq_lengths_query.shape)}",
            )
    if actual_seq_lengths_query is not None:
        ref_check(
            actual_seq_lengths_query.dtype in INDEX_DTYPES,
            op,
            f"actual_seq_lengths_query must be int32/int64, got {actual_seq_lengths_query.dtype}",
        )
    K = sparse_indices.size(-1)
    ref_check(K > 0, op, f"sparse_indices last dim (K) must be > 0, got {K}")

    ref_check(key.dim() == 4, op, f"key must be 4-D ({layout_kv}), got {key.dim()}-D")
    ref_check(key.size(2) == 1, op, f"key dim 2 (kv heads N2) must be 1, got {key.size(2)}")
    ref_check(key.size(3) == D, op, f"key head dim {key.size(3)} must equal query head dim D={D}")
    if value is not None:
        ref_check(
            tuple(value.shape) == tuple(key.shape) and value.dtype == key.dtype,
            op,
            f"value must match key's shape {tuple(key.shape)} and dtype (attention_mode 2), got "
            f"{tuple(value.shape)} {value.dtype}",
        )
    ref_check(
        (query_rope is None) == (key_rope is None),
        op,
        "query_rope and key_rope must be given together (or both None)",
    )
    if query_rope is not None:
        ref_check(
            query_rope.dim() == query.dim() and tuple(query_rope.shape[:-1]) == tuple(query.shape[:-1]),
            op,
            f"query_rope must be {tuple(query.shape[:-1])} + [Dr], got {tuple(query_rope.shape)}",
        )
        ref_check(
            key_rope.dim() == 4 and tuple(key_rope.shape[:3]) == tuple(key.shape[:3]),
            op,
            f"key_rope must be {tuple(key.shape[:3])} + [Dr], got {tuple(key_rope.shape)}",
        )
        ref_check(
            key_rope.size(3) == query_rope.size(-1),
            op,
            f"key_rope last dim {key_rope.size(3)} must equal query_rope last dim {query_rope.size(-1)}",
        )
        ref_check(
            query_rope.dtype == query.dtype and key_rope.dtype == query.dtype,
            op,
            f"query_rope/key_rope dtype must equal query dtype {query.dtype}",
        )
    check_kv_layout(
        op, key, block_table, actual_seq_lengths_kv, layout_kv, B,
        layout_arg="layout_kv", lengths_arg="actual_seq_lengths_kv",
    )
    return {"B": B, "S": S, "T": T, "N": N, "D": D, "K": K}


def _validate(query, key, value, sparse_indices, kw) -> dict:
    return validate_npu_sparse_flash_attention(
        query, key, value, sparse_indices,
        kw.get("block_table"), kw.get("actual_seq_lengths_query"), kw.get("actual_seq_lengths_kv"),
        kw.get("query_rope"), kw.get("key_rope"), kw.get("sparse_block_size", 1),
        kw.get("layout_query", "BSND"), kw.get("layout_kv", "BSND"), kw.get("sparse_mode", 3),
        kw.get("attention_mode", 0), kw.get("return_softmax_lse", False), kw.get("sinks"),
    )


def _fake(query, key, value, sparse_indices, scale_value, **kwargs):
    _validate(query, key, value, sparse_indices, kwargs)
    empty = query.new_empty((0,), dtype=torch.float32)
    # The CPU kernel returns a fresh contiguous tensor whatever the query's strides.
    return query.new_empty(query.shape), empty, empty.clone()


def reference_npu_sparse_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: Optional[torch.Tensor],
    sparse_indices: torch.Tensor,
    scale_value: float,
    *,
    block_table: Optional[torch.Tensor] = None,
    actual_seq_lengths_query: Optional[torch.Tensor] = None,
    actual_seq_lengths_kv: Optional[torch.Tensor] = None,
    query_rope: Optional[torch.Tensor] = None,
    key_rope: Optional[torch.Tensor] = None,
    sparse_block_size: int = 1,
    layout_query: str = "BSND",
    layout_kv: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = 9223372036854775807,
    next_tokens: int = 9223372036854775807,
    attention_mode: int = 0,
    return_softmax_lse: bool = False,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch reference, vectorised over tokens, heads and the K selected positions (fp64 accumulate)."""
    kw = dict(
        block_table=block_table, actual_seq_lengths_query=actual_seq_lengths_query,
        actual_seq_lengths_kv=actual_seq_lengths_kv, query_rope=query_rope, key_rope=key_rope,
        sparse_block_size=sparse_block_size, layout_query=layout_query, layout_kv=layout_kv,
        sparse_mode=sparse_mode, attention_mode=attention_mode, return_softmax_lse=return_softmax_lse,
        sinks=sinks,
    )
    info = _validate(query, key, value, sparse_indices, kw)
    B, T, N, D, K = info["B"], info["T"], info["N"], info["D"], info["K"]
    b_of_t, i_of_t, sq_of_t = token_positions(layout_query, actual_seq_lengths_query, T, info["S"], OP)
    table, kv_len, num_blocks, bs = kv_addressing(key, block_table, actual_seq_lengths_kv, layout_kv, B)
    lim = kv_len[b_of_t] - sq_of_t + i_of_t if sparse_mode == 3 else kv_len[b_of_t] - 1  # [T]

    idx = sparse_indices.reshape(T, K).to(torch.int64)
    valid = (idx >= 0) & (idx <= lim.unsqueeze(1))  # -1 and any other negative never selected
    rows = paged_rows(table, b_of_t.unsqueeze(1).expand(T, K), idx.clamp(min=0), valid, bs, num_blocks, OP)

    # float64 accumulation (the NPU accumulates in fp32): products of fp32/bf16 values are exact in
    # fp64, so the result no longer depends on the order of the selected positions. The offload path
    # presents the same KV set as the non-offload path in ledger order instead of top-k order; with
    # fp64 both give the same rounded output, which makes end-to-end comparisons exact.
    acc = torch.float64
    q = query.reshape(T, N, D).to(acc)
    k = key.reshape(num_blocks * bs, D)[rows].to(acc)  # [T, K, D]
    z = torch.bmm(q, k.transpose(1, 2))  # [T, N, K]
    if query_rope is not None:
        dr = query_rope.size(-1)
        qr = query_rope.reshape(T, N, dr).to(acc)
        kr = key_rope.reshape(num_blocks * bs, dr)[rows].to(acc)
        z = z + torch.bmm(qr, kr.transpose(1, 2))
    z = (z * scale_value).masked_fill(~valid.unsqueeze(1), float("-inf"))
    # Rows without any visible position give all -inf: softmax would be NaN, the NPU writes zeros.
    any_valid = valid.any(dim=1)
    z = torch.where(any_valid.view(T, 1, 1), z, torch.zeros_like(z))
    p = torch.softmax(z, dim=-1)
    same_as_key = value is None or (
        value.data_ptr() == key.data_ptr() and value.stride() == key.stride() and value.shape == key.shape
    )
    v = k if same_as_key else value.reshape(num_blocks * bs, D)[rows].to(acc)
    out = torch.bmm(p, v) * any_valid.view(T, 1, 1)
    empty = query.new_empty((0,), dtype=torch.float32)
    return out.to(query.dtype).reshape(query.shape), empty, empty.clone()


def _cpu(query, key, value, sparse_indices, scale_value, **kwargs):
    return reference_npu_sparse_flash_attention(query, key, value, sparse_indices, scale_value, **kwargs)


ref_define(SPEC.schema)
ref_register_fake(OP, _fake)
ref_impl(OP, "CPU", _cpu)

"""custom::npu_gather_selection_kv_cache (+ _functional) — baseline gather with a reuse ledger (spec/ops.md §1)."""
from __future__ import annotations

from . import _library as L

SCHEMA = (
    "npu_gather_selection_kv_cache(Tensor(a!) selection_k_rope, Tensor(b!) selection_kv_cache, "
    "Tensor(c!) selection_kv_block_table, Tensor(d!) selection_kv_block_status, "
    "Tensor selection_topk_indices, Tensor full_k_rope, Tensor full_kv_cache, "
    "Tensor full_kv_block_table, Tensor full_kv_actual_seq, Tensor full_q_actual_seq, *, "
    "int selection_topk_block_size=64) -> Tensor"
)
FUNCTIONAL_SCHEMA = (
    "npu_gather_selection_kv_cache_functional(Tensor selection_k_rope, Tensor selection_kv_cache, "
    "Tensor selection_kv_block_table, Tensor selection_kv_block_status, Tensor selection_topk_indices, "
    "Tensor full_k_rope, Tensor full_kv_cache, Tensor full_kv_block_table, Tensor full_kv_actual_seq, "
    "Tensor full_q_actual_seq, *, int selection_topk_block_size=64) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor)"
)
L.define(SCHEMA)
L.define(FUNCTIONAL_SCHEMA)

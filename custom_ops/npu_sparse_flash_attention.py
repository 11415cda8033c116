"""offload_ref::npu_sparse_flash_attention — CPU reference of torch_npu's SFA decode path (spec/ops.md §6.2)."""
from __future__ import annotations

import torch

REF_NAMESPACE = "offload_ref"
SCHEMA = (
    "npu_sparse_flash_attention(Tensor query, Tensor key, Tensor? value, Tensor sparse_indices, "
    "float scale_value, *, Tensor? block_table=None, Tensor? actual_seq_lengths_query=None, "
    "Tensor? actual_seq_lengths_kv=None, Tensor? query_rope=None, Tensor? key_rope=None, "
    "int sparse_block_size=1, str layout_query=\"BSND\", str layout_kv=\"BSND\", int sparse_mode=3, "
    "int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, int attention_mode=0, "
    "bool return_softmax_lse=False, Tensor? sinks=None) -> (Tensor, Tensor, Tensor)"
)

"""offload_ref::npu_lightning_indexer — CPU reference of torch_npu's decode lightning indexer (spec/ops.md §6.1)."""
from __future__ import annotations

import torch

REF_NAMESPACE = "offload_ref"
SCHEMA = (
    "npu_lightning_indexer(Tensor query, Tensor key, Tensor weights, *, "
    "Tensor? actual_seq_lengths_query=None, Tensor? actual_seq_lengths_key=None, "
    "Tensor? block_table=None, str layout_query=\"BSND\", str layout_key=\"BSND\", "
    "int sparse_count=2048, int sparse_mode=3, int pre_tokens=9223372036854775807, "
    "int next_tokens=9223372036854775807, bool return_value=False) -> (Tensor, Tensor)"
)

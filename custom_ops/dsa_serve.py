"""custom::dsa_serve / dsa_serve_functional — fill a layer's selection buffer (spec/ops.md §3)."""
from __future__ import annotations

from . import _library as L

SCHEMA = (
    "dsa_serve(Tensor plan, Tensor full_kv_cache, Tensor full_k_rope, Tensor pool_kv_cache, "
    "Tensor pool_k_rope, Tensor(a!) selection_kv_cache, Tensor(b!) selection_k_rope, *, "
    "int raw_seq=1, int topk=2048, int selection_block_size=128, int compact_layout=1) -> ()"
)
FUNCTIONAL_SCHEMA = (
    "dsa_serve_functional(Tensor plan, Tensor full_kv_cache, Tensor full_k_rope, "
    "Tensor pool_kv_cache, Tensor pool_k_rope, Tensor selection_kv_cache, Tensor selection_k_rope, *, "
    "int raw_seq=1, int topk=2048, int selection_block_size=128, int compact_layout=1) -> (Tensor, Tensor)"
)
L.define(SCHEMA)
L.define(FUNCTIONAL_SCHEMA)

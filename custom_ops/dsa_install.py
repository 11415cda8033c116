"""custom::dsa_install / dsa_install_functional — refill a layer's pool after attention (spec/ops.md §4)."""
from __future__ import annotations

from . import _library as L

SCHEMA = (
    "dsa_install(Tensor install_records, Tensor selection_kv_cache, Tensor selection_k_rope, "
    "Tensor selection_kv_block_table, Tensor(a!) pool_kv_cache, Tensor(b!) pool_k_rope, "
    "Tensor(c!) pool_ids, Tensor(d!) id_to_slot, Tensor(e!) lru_counter, *, int raw_seq=1, "
    "int topk=2048, int selection_block_size=128, int metadata_update=1) -> ()"
)
FUNCTIONAL_SCHEMA = (
    "dsa_install_functional(Tensor install_records, Tensor selection_kv_cache, "
    "Tensor selection_k_rope, Tensor selection_kv_block_table, Tensor pool_kv_cache, "
    "Tensor pool_k_rope, Tensor pool_ids, Tensor id_to_slot, Tensor lru_counter, *, int raw_seq=1, "
    "int topk=2048, int selection_block_size=128, int metadata_update=1) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor)"
)
L.define(SCHEMA)
L.define(FUNCTIONAL_SCHEMA)

"""custom::dsa_plan — classify one IndexShare group's top-k once per step (spec/ops.md §2)."""
from __future__ import annotations

from . import _library as L

SCHEMA = (
    "dsa_plan(Tensor selection_topk_indices, Tensor full_kv_actual_seq, Tensor pool_ids, "
    "Tensor id_to_slot, Tensor lru_counter, *, int raw_seq=1, int group_id=0, int owner_layer=0, "
    "int group_kind=0) -> (Tensor, Tensor, Tensor)"
)
L.define(SCHEMA)

"""How each of our torch ops maps onto its CANN (GE) op. Pure data: importable without TorchAir.

One :class:`GeOpSpec` per in-place/functional pair (and one for ``dsa_plan``). The GE op's inputs are
the op's tensor arguments in schema order with the same names, its attrs the non-tensor arguments
(same names unless :attr:`GeOpSpec.attr_names` renames one), and its outputs are
:attr:`GeOpSpec.ge_outputs`. A mutated input is a *ref* pair: a GE output with the input's name.

Derived contract (spec/torchair.md §3):

* in-place op   -> GE node on the original inputs; returns only the GE outputs that are not refs
  (``()`` for ``dsa_serve`` / ``dsa_install``, ``selection_kv_actual_seq`` for the gather);
* functional twin -> ``TensorMove`` of exactly the mutated inputs, GE node on the copies; returns
  ``(*non-ref outputs, *ref outputs in schema order)`` = the functional schema's returns.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class GeOpSpec:
    namespace: str
    op: str                       # in-place (or only) op name, e.g. "dsa_serve"
    ge_type: str                  # CANN op type, e.g. "DsaServe"
    ge_outputs: Tuple[str, ...]   # GE output names in IR order
    mutated: Tuple[str, ...] = ()  # schema names of mutated inputs (ref pairs), schema order
    functional: Optional[str] = None  # functional twin name, if any
    attr_names: Dict[str, str] = field(default_factory=dict)  # torch kwarg -> GE attr (renames only)
    #: optional inputs left out of the node (not even as an empty input) when absent, as torch_npu's
    #: own converter does (older CANN definitions lack them)
    omit_if_none: Tuple[str, ...] = ()

    @property
    def non_ref_outputs(self) -> Tuple[str, ...]:
        return tuple(o for o in self.ge_outputs if o not in self.mutated)

    def ge_attr(self, torch_name: str) -> str:
        return self.attr_names.get(torch_name, torch_name)


CUSTOM_SPECS: Tuple[GeOpSpec, ...] = (
    GeOpSpec(
        "custom", "dsa_plan", "DsaPlan",
        ge_outputs=("plan", "install_records", "selection_kv_actual_seq"),
    ),
    GeOpSpec(
        "custom", "dsa_serve", "DsaServe",
        ge_outputs=("selection_kv_cache", "selection_k_rope"),
        mutated=("selection_kv_cache", "selection_k_rope"),
        functional="dsa_serve_functional",
    ),
    GeOpSpec(
        "custom", "dsa_install", "DsaInstall",
        ge_outputs=("pool_kv_cache", "pool_k_rope", "pool_ids", "id_to_slot", "lru_counter"),
        mutated=("pool_kv_cache", "pool_k_rope", "pool_ids", "id_to_slot", "lru_counter"),
        functional="dsa_install_functional",
    ),
    GeOpSpec(
        "custom", "npu_gather_selection_kv_cache", "GatherSelectionKvCache",
        ge_outputs=("selection_k_rope", "selection_kv_cache", "selection_kv_block_table",
                    "selection_kv_block_status", "selection_kv_actual_seq"),
        mutated=("selection_k_rope", "selection_kv_cache", "selection_kv_block_table",
                 "selection_kv_block_status"),
        functional="npu_gather_selection_kv_cache_functional",
    ),
)

#: CPU references of torch_npu's decode attention ops (``offload_ref::``). On an NPU the model calls
#: ``torch.ops.npu.*`` whose converters ship with torch_npu; these map our references onto the same
#: CANN ops so that a graph built on CPU converts exactly like the NPU one.
REF_SPECS: Tuple[GeOpSpec, ...] = (
    GeOpSpec(
        "offload_ref", "npu_lightning_indexer", "LightningIndexer",
        ge_outputs=("sparse_indices", "sparse_values"),
        attr_names={"return_value": "return_values"},
    ),
    GeOpSpec(
        "offload_ref", "npu_sparse_flash_attention", "SparseFlashAttention",
        ge_outputs=("attention_out", "softmax_max", "softmax_sum"),
        omit_if_none=("sinks",),
    ),
)

ALL_SPECS: Tuple[GeOpSpec, ...] = CUSTOM_SPECS + REF_SPECS

#: GE ref analysis (TorchAir ``_get_output_to_input_ref_idx``): output index -> input index, for the
#: DSA ops TorchAir does not know. Without it every step copies the selection caches / pools.
REF_IDX: Dict[str, Dict[int, int]] = {
    "DsaServe": {0: 5, 1: 6},
    "DsaInstall": {0: 4, 1: 5, 2: 6, 3: 7, 4: 8},
}


def spec_for(op_name: str) -> GeOpSpec:
    for s in ALL_SPECS:
        if op_name in (s.op, s.functional):
            return s
    raise KeyError(op_name)

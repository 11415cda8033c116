"""Triton kernel of ``offload_ref::dsa_install_sc`` (twin of ``csrc/dsa_install_sc.cpp``).

The install kernels of ``cuda/dsa_install.py`` with the second-chance victim choice: each ``(b, set)``
program first ORs the reference bits of its set's POOL_HIT plan rows into its private counter, then
probes from the pointer, clearing and skipping referenced ways (at most 16, so one vector step).
"""
from __future__ import annotations


from .. import dsa_install_sc as M
from .._attention_common import ref_impl
from . import dsa_install as I

OP = M.OP


def run(plan, install_records, selection_kv_cache, selection_k_rope, selection_kv_block_table, pool_kv_cache,
        pool_k_rope, pool_ids, id_to_slot, lru_counter, *, raw_seq: int = 1, topk: int = 2048,
        selection_block_size: int = 128, metadata_update: int = 1) -> None:
    """``offload_ref::dsa_install_sc`` through the Triton kernels (in place; same validation as on CPU)."""
    M.validate_dsa_install_sc(plan, install_records, selection_kv_cache, selection_k_rope, selection_kv_block_table,
                              pool_kv_cache, pool_k_rope, pool_ids, id_to_slot, lru_counter,
                              raw_seq, topk, selection_block_size, metadata_update)
    I.launch(install_records, selection_kv_cache, selection_k_rope, pool_kv_cache, pool_k_rope, pool_ids,
             id_to_slot, lru_counter, raw_seq, topk, selection_block_size, metadata_update, plan=plan)


def register() -> list[str]:
    return [OP] if ref_impl(OP, "CUDA", run) else []

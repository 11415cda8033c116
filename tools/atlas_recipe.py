"""Route our GLM model's DSA sites through the reference's hand-wired shared-indexer offload path.

``offload-atlas-check --recipe PATH`` compares our rewrite with cann-recipes-infer's own implementation
on the same model, weights and tokens. The reference function
(``models/glm_5_2/models/shared_indexer_offload.py::run_shared_indexer_offload``, imported from the
checkout, never copied) is called eagerly in place of the model's gather op, layer by layer, with an
adapter object that provides the pool / metadata / plan bookkeeping the reference reads from its
``OffloadCache`` (the method names it calls). Pools and metadata are allocated like ours
(``OffloadState``): pool ``[B, PS, D]``, ``pool_ids [B, PS]`` = -1, ``id_to_slot [B, IR]`` = -1,
``lru_counter [B, PS/16]`` = 0 per group.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

RECIPE_MODULE = "models.glm_5_2.models.shared_indexer_offload"
RECIPE_FUNCTION = "run_shared_indexer_offload"


def import_recipe(path: str | Path) -> Any:
    """The reference function from a checkout at ``path`` (its root goes on ``sys.path``)."""
    root = str(Path(path).resolve())
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        mod = importlib.import_module(RECIPE_MODULE)
    except Exception as e:
        raise RuntimeError(f"--recipe {path}: cannot import {RECIPE_MODULE} ({type(e).__name__}: {e})") from e
    fn = getattr(mod, RECIPE_FUNCTION, None)
    if fn is None:
        raise RuntimeError(f"--recipe {path}: {RECIPE_MODULE} has no {RECIPE_FUNCTION}")
    return fn


class RecipeCache:
    """The bookkeeping object ``run_shared_indexer_offload`` expects (``offload_cache``)."""

    def __init__(self, groups: List[List[int]], sel: Dict[int, Tuple[torch.Tensor, torch.Tensor]],
                 sel_tables: Dict[int, torch.Tensor], B: int, pool_size: int, id_range: int, device: Any):
        self.dsa_pool_size = pool_size
        self.groups = [list(g) for g in groups]
        self._group_of = {l: i for i, g in enumerate(self.groups) for l in g}
        L = max(self._group_of) + 1
        self.selected_key_values = [sel.get(l, (None, None)) for l in range(L)]
        self.selection_kv_block_table = [sel_tables.get(l) for l in range(L)]
        self.meta = []
        for _ in self.groups:
            self.meta.append((torch.full((B, pool_size), -1, dtype=torch.int32, device=device),
                              torch.full((B, id_range), -1, dtype=torch.int32, device=device),
                              torch.zeros((B, pool_size // 16), dtype=torch.int32, device=device)))
        self.pools: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        for l, (kv, rope) in sel.items():
            self.pools[l] = (torch.zeros((B, pool_size, kv.shape[-1]), dtype=kv.dtype, device=device),
                             torch.zeros((B, pool_size, rope.shape[-1]), dtype=rope.dtype, device=device))
        self._plans: Dict[int, tuple] = {}

    # -- what the reference calls
    def get_dsa_shared_group_metadata(self, layer: int):
        g = self._group_of[layer]
        return (g, *self.meta[g])

    def get_dsa_shared_group_spec(self, group_id: int) -> dict:
        return {"owner_layer": self.groups[group_id][0], "group_kind": 0, "layers": list(self.groups[group_id])}

    def is_dsa_shared_group_owner(self, layer: int) -> bool:
        return self.groups[self._group_of[layer]][0] == layer

    def is_dsa_shared_group_last_layer(self, layer: int) -> bool:
        return self.groups[self._group_of[layer]][-1] == layer

    def set_dsa_shared_group_plan(self, group_id: int, plan, records, actual_seq) -> None:
        self._plans[group_id] = (plan, records, actual_seq)

    def get_dsa_shared_group_plan(self, group_id: int):
        return self._plans[group_id]

    def clear_dsa_shared_group_plan(self, group_id: int) -> None:
        self._plans.pop(group_id, None)

    def update_selected_key_values(self, layer: int, kv, rope) -> None:
        self.selected_key_values[layer] = (kv, rope)

    def get_dsa_layer_pool_values(self, layer: int):
        return self.pools[layer]

    def update_dsa_layer_pool_values(self, layer: int, kv, rope) -> None:
        self.pools[layer] = (kv, rope)

    def update_dsa_shared_group_metadata(self, group_id: int, pool_ids, id_to_slot, lru) -> None:
        self.meta[group_id] = (pool_ids, id_to_slot, lru)

    def metadata(self) -> List[tuple]:
        return [tuple(t.cpu() for t in m) for m in self.meta]


def _layers(model) -> List[Any]:
    """Attention modules with the offload buffers, in layer order."""
    return [m for m in model.modules() if hasattr(m, "sel_kv") and hasattr(m, "kv_cache")]


@contextlib.contextmanager
def recipe_route(path: str | Path, built, pool_size: Optional[int] = None, fn: Any = None) -> Iterator[RecipeCache]:
    """Within the block, every gather of ``built.model`` runs the reference's path for its layer."""
    from offload_passes.models.glm import npu_ops
    from offload_passes.custom_ops._pool import id_range_for
    from offload_passes.options import OffloadOptions

    run = fn if fn is not None else import_recipe(path)
    model = built.model
    attn = _layers(model)
    by_sel = {m.sel_kv.data_ptr(): i for i, m in enumerate(attn)}
    B = built.driver.B
    S = built.driver.S
    K = built.driver.K
    sample = attn[0].kv_cache
    F = sample.shape[0] * sample.shape[1] // B
    ps = OffloadOptions(pool_size=pool_size).resolved_pool_size
    cache = RecipeCache(built.driver.groups, {i: (m.sel_kv, m.sel_rope) for i, m in enumerate(attn)},
                        {i: m.sel_block_table for i, m in enumerate(attn)}, B, ps, id_range_for(F), sample.device)
    original = npu_ops.gather_selection_kv_cache

    def route(sel_rope, sel_kv, sel_table, sel_status, topk4, full_rope, full_kv, block_table, kv_len, cu_q,
              selection_topk_block_size=1):
        layer = by_sel[sel_kv.data_ptr()]
        out = run(layer_idx=layer, topk_indices=topk4, full_kv_actual_seq=kv_len,
                  full_kv_cache=full_kv.reshape(B, F, full_kv.shape[-1]),
                  full_k_rope=full_rope.reshape(B, F, full_rope.shape[-1]),
                  selection_kv_cache=sel_kv, selection_k_rope=sel_rope,
                  pool_kv_cache=cache.pools[layer][0], pool_k_rope=cache.pools[layer][1], offload_cache=cache,
                  raw_seq=S, topk=K, selection_block_size=sel_kv.shape[1], enable_install_stream=False,
                  exe_mode="eager")
        return out[2].reshape(-1)  # selection_kv_actual_seq, one per query token, like the gather's

    npu_ops.gather_selection_kv_cache = route
    try:
        yield cache
    finally:
        npu_ops.gather_selection_kv_cache = original

"""``offload-atlas-check --recipe``: the routing of the model's DSA sites into a reference-style
``run_shared_indexer_offload`` (tools/atlas_recipe.py), on CPU.

The real function lives in cann-recipes-infer, which cannot be installed here. ``shared_indexer_standin``
below is a TEST DOUBLE with the same keyword interface, written from docs/ops.md §5 (owner plans, every
layer serves, shared layers install with metadata_update=0, the last layer installs the owner's with
metadata_update=1), calling our ops. It checks the adapter's plumbing (layer identity, shapes, plan
hand-over, pools, metadata), not the reference's code.
"""
from __future__ import annotations

import copy

import torch

from offload_passes import models
from offload_passes.tools import atlas_recipe

PS = 64
STEPS = 3


def shared_indexer_standin(*, layer_idx, topk_indices, full_kv_actual_seq, full_kv_cache, full_k_rope,
                           selection_kv_cache, selection_k_rope, pool_kv_cache, pool_k_rope, offload_cache,
                           raw_seq, topk, selection_block_size, enable_install_stream=False, install_stream=None,
                           install_events=(), exe_mode="ge_graph"):
    """TEST DOUBLE of the reference's run_shared_indexer_offload (interface only; see module doc)."""
    c = offload_cache
    g, pool_ids, id_to_slot, lru = c.get_dsa_shared_group_metadata(layer_idx)
    spec = c.get_dsa_shared_group_spec(g)
    if c.is_dsa_shared_group_owner(layer_idx):
        c.set_dsa_shared_group_plan(g, *torch.ops.custom.dsa_plan(
            topk_indices, full_kv_actual_seq, pool_ids, id_to_slot, lru, raw_seq=raw_seq, group_id=g,
            owner_layer=spec["owner_layer"]))
    plan, rec, act = c.get_dsa_shared_group_plan(g)
    torch.ops.custom.dsa_serve(plan, full_kv_cache, full_k_rope, pool_kv_cache, pool_k_rope, selection_kv_cache,
                               selection_k_rope, raw_seq=raw_seq, topk=topk,
                               selection_block_size=selection_block_size, compact_layout=1)
    c.update_selected_key_values(layer_idx, selection_kv_cache, selection_k_rope)

    def install(layer, md):
        kv, rope = c.selected_key_values[layer]
        pkv, prope = c.get_dsa_layer_pool_values(layer)
        torch.ops.custom.dsa_install(rec, kv, rope, c.selection_kv_block_table[layer], pkv, prope, pool_ids,
                                     id_to_slot, lru, raw_seq=raw_seq, topk=topk,
                                     selection_block_size=selection_block_size, metadata_update=md)

    if not c.is_dsa_shared_group_owner(layer_idx):
        install(layer_idx, 0)
    if c.is_dsa_shared_group_last_layer(layer_idx):
        install(spec["owner_layer"], 1)
        c.clear_dsa_shared_group_plan(g)
    return selection_kv_cache, selection_k_rope, act, pool_kv_cache, pool_k_rope


def test_recipe_route_matches_the_unmodified_model_and_our_rewrite():
    from offload_passes.backend import OffloadBackend

    base = models.build("tiny", enable_offload=True, shared_indexer_offload=True)
    base.driver.prefill()
    ref, routed, ours = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    want = [ref.driver.step().logits for _ in range(STEPS)]
    with atlas_recipe.recipe_route(None, routed, pool_size=PS, fn=shared_indexer_standin) as cache:
        got = [routed.driver.step().logits for _ in range(STEPS)]
        meta = cache.metadata()
    from offload_passes.models.glm import npu_ops

    assert npu_ops.gather_selection_kv_cache is torch.ops.custom.npu_gather_selection_kv_cache  # restored
    assert [len(g) for g in cache.groups] == [4, 4]
    diffs = [float((g.float() - w.float()).abs().max()) for g, w in zip(got, want)]
    assert max(diffs) <= 2e-2, diffs
    assert int((meta[0][0] >= 0).sum()) > 0  # the pools were filled through the adapter
    torch._dynamo.reset()
    be = OffloadBackend(pool_size=PS)
    step = torch.compile(ours.model, backend=be)
    for _ in range(STEPS):
        ours.driver.step(step)
    mine = [(g.pool_ids, g.id_to_slot, g.lru_counter) for g in be.state.groups]
    assert all(torch.equal(a, b) for ga, gb in zip(meta, mine) for a, b in zip(ga, gb))


def test_import_recipe_names_what_is_missing(tmp_path):
    import pytest

    with pytest.raises(RuntimeError, match=r"--recipe .*: cannot import models\.glm_5_2\.models\."
                                           r"shared_indexer_offload"):
        atlas_recipe.import_recipe(tmp_path)

"""``cache_write: inplace`` (docs/models.md, docs/ops.md §11.2): the model writes its caches the reference's way — KV latent and
rope through the MLA-prolog cache write, the indexer cache (and the int8 cache's scales) through
``npu_scatter_nd_update_`` (``offload_ref::`` test doubles of the NPU ops, custom_ops/cache_write.py).

AOT wraps these mutable custom ops in ``auto_functionalized_v2``; after lowering (eager) the final
graph must call the in-place ops on the caches themselves: no ``auto_functionalized*`` node, no copy
of a full cache; the outputs are bit-identical to the default (``index_put_``) model.
"""
from __future__ import annotations

import pytest
import torch

from backend_helpers import assert_final_graph, ops_of
from offload_passes import models
from offload_passes.backend import make_offload_backend

PS = 64
STEPS = 6
HOPS = {torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2}
PROLOG = "offload_ref.npu_mla_prolog_cache_write_.default"
SCATTER = "offload_ref.npu_scatter_nd_update_.default"


def _big_shapes(model, B: int) -> set:
    """Shapes of every full / indexer cache and selection buffer, and the views the graph takes of them."""
    out = set()
    for name, t in model.cache_buffers().items():
        if name.rsplit(".", 1)[-1] not in ("kv_cache", "k_rope_cache", "key_cache", "key_scale_cache",
                                           "sel_kv", "sel_rope"):
            continue
        D = t.size(-1)
        out |= {tuple(t.shape), (t.numel() // D, D), (B, t.numel() // (B * D), D), (t.numel(),)}
        if t.dim() == 4:
            out.add((t.size(0), t.size(1), D))
    return out


@pytest.fixture(scope="module", params=["tiny", "tiny-w8a8"])
def runs(request):
    preset = request.param
    over = dict(enable_offload=True, decode_steps=STEPS)
    default, inplace = models.build(preset, **over), models.build(preset, cache_write="inplace", **over)
    assert inplace.runner.cache_write == "inplace" and default.runner.cache_write == "index_put"
    be = make_offload_backend(pool_size=PS, pa_block_size=inplace.runner.pa_block_size)
    ref = default.driver.run(collect=True)  # the default model, uncompiled
    out = inplace.driver.run(step_fn=torch.compile(inplace.model, backend=be), collect=True)
    return {"preset": preset, "ref": ref.steps, "out": out.steps, "backend": be, "model": inplace.model,
            "final_graph": be.final_graph()}


def test_outputs_bit_identical_to_the_default_model(runs):
    assert len(runs["out"]) == len(runs["ref"]) == STEPS
    for a, b in zip(runs["ref"], runs["out"]):
        assert torch.equal(a.positions, b.positions)
        assert (a.logits.float() - b.logits.float()).abs().max().item() == 0  # the rewrite is exact
        assert all(torch.equal(x, y) for x, y in zip(a.attn, b.attn))


def test_final_graph_writes_caches_in_place_without_copies(runs):
    be, model = runs["backend"], runs["model"]
    rep = be.reports[-1]
    assert rep["rewritten"] and rep["reinplace"]["kept_functional"] == []
    n_layers, n_full = len(model.model.layers), sum(1 for g in model.index_groups())
    int8 = runs["preset"] == "tiny-w8a8"
    assert rep["reinplace"]["reinplaced"][PROLOG] == n_layers
    assert rep["reinplace"]["reinplaced"][SCATTER] == n_full * (2 if int8 else 1)  # + scale cache
    graph = runs["final_graph"]
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert not HOPS & set(targets), "auto_functionalized left after reinplace"
    assert len(ops_of(graph, "npu_mla_prolog_cache_write_")) == n_layers
    # the in-place ops write the cache graph inputs themselves, not copies of them
    for n in ops_of(graph, "npu_mla_prolog_cache_write_"):
        assert n.args[0].op == n.args[1].op == "placeholder"  # kv_cache, kr_cache
    for n in ops_of(graph, "npu_scatter_nd_update_"):
        assert n.args[0].op == "placeholder"  # the indexer's key (or scale) cache
    B = model.batch_size
    assert_final_graph(graph, None, PS, model.index_groups(), big=_big_shapes(model, B))

"""``tiny-w8a8`` (W8A8C16: int8 indexer cache, ``npu_quant_lightning_indexer`` as the top-k producer)
through the offload backend, eager mode, S = 1 and S = 4: the implied IndexShare groups, one plan per
group, outputs bit-identical to the unmodified quantised model. Pool size 64 = K: every step evicts."""
from __future__ import annotations

import pytest
import torch

from backend_helpers import assert_final_graph
from offload_passes import models
from offload_passes.backend import make_offload_backend

PS = 64
STEPS = 12


def _big_shapes(model, B: int) -> set:
    """Cache / selection buffers (int8 indexer cache and its scale cache included) and the pools."""
    out = set()
    data = ("kv_cache", "k_rope_cache", "key_cache", "key_scale_cache", "sel_kv", "sel_rope")
    for name, t in model.cache_buffers().items():
        if name.rsplit(".", 1)[-1] not in data:
            continue
        D = t.size(-1)
        out |= {tuple(t.shape), (t.numel() // D, D), (B, t.numel() // (B * D), D)}
    a = model.model.layers[0].self_attn
    out |= {(B, PS, a.kv_lora_rank), (B, PS, a.rope_dim)}
    return out


@pytest.fixture(scope="module", params=[0, 3], ids=["S1", "S4-next_n3"])
def w8a8_run(request):
    next_n = request.param
    over = dict(enable_offload=True, decode_steps=STEPS, next_n=next_n)
    base, comp = models.build("tiny-w8a8", **over), models.build("tiny-w8a8", **over)
    be = make_offload_backend(pool_size=PS, pa_block_size=comp.runner.pa_block_size, next_n=next_n)
    ref = base.driver.run(steps=STEPS, collect=True)
    torch._dynamo.reset()
    out = comp.driver.run(steps=STEPS, step_fn=torch.compile(comp.model, backend=be), collect=True)
    return {"ref": ref.steps, "out": out.steps, "backend": be, "model": comp.model, "S": next_n + 1,
            "final_graph": be.final_graph()}


def test_outputs_bit_identical_to_unmodified_quantised_model(w8a8_run):
    r = w8a8_run
    assert len(r["ref"]) == len(r["out"]) == STEPS
    for i, (a, b) in enumerate(zip(r["ref"], r["out"])):
        assert torch.equal(a.logits, b.logits), f"step {i}: logits differ"
        assert all(torch.equal(x, y) for x, y in zip(a.attn, b.attn)), f"step {i}: attention differs"
        assert all(torch.equal(x, y) for x, y in zip(a.topk, b.topk)), f"step {i}: top-k differs"
        assert a.topk[0].shape == (2, r["S"], 64)


def test_groups_plans_and_final_graph(w8a8_run):
    r = w8a8_run
    be = r["backend"]
    rep = be.reports[-1]
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rep["rewritten"] and rep["refusals"] == []
    assert [g["layers"] for g in rep["groups"]] == groups
    assert [(g["owner_layer"], g["S"], g["K"]) for g in rep["groups"]] == [(0, r["S"], 64), (4, r["S"], 64)]
    assert len(rep["detect"]["indexers"]) == 2
    before, after = rep["ops"]["before"], rep["ops"]["after"]
    assert before["npu_quant_lightning_indexer"] == 2 and before["npu_lightning_indexer"] == 0
    assert (after["dsa_plan"], after["dsa_serve"], after["dsa_install"]) == (2, 8, 8)
    assert after["npu_gather_selection_kv_cache"] == 0 and after["npu_quant_lightning_indexer"] == 2
    assert_final_graph(r["final_graph"], None, PS, groups, big=_big_shapes(r["model"], 2))

"""The real GLM-5.2 ``tiny`` preset (FSSS FSSS, K = 64), eager mode, 64 decode steps at S = 1 and S = 4.

The unmodified model (eager, gather path) and a copy compiled with the offload backend see the same
tokens (the driver's token stream does not depend on the logits). Per step: logits, per-layer
attention outputs, per-layer gather/serve lengths and per-group top-k are compared, and the pool
invariants (docs/ops.md §8.4-8.5) are asserted after every step. Pool size 64 = K, so every step evicts.
"""
from __future__ import annotations

import pytest
import torch

from backend_helpers import assert_final_graph, check_ledger_layer, check_pool_state
from offload_passes import models
from offload_passes.backend import make_offload_backend

PS = 64
STEPS = 64


def _attn(model, l: int):
    return model.model.layers[l].self_attn


def _full_rows(model, l: int, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``l``'s full caches ``[blocks, BS, 1, D]`` (identity paged layout) as ``[B, F, D]``."""
    a = _attn(model, l)
    return a.kv_cache.view(B, -1, a.kv_cache.size(-1)), a.k_rope_cache.view(B, -1, a.k_rope_cache.size(-1))


def _big_shapes(model, B: int) -> set:
    """Shapes of every cache / selection buffer (and the views the graph takes of them) and the pools."""
    out = set()
    data = ("kv_cache", "k_rope_cache", "key_cache", "sel_kv", "sel_rope")  # not the ledger (sel_status)
    for name, t in model.cache_buffers().items():
        if name.rsplit(".", 1)[-1] not in data:
            continue
        D = t.size(-1)
        out |= {tuple(t.shape), (t.numel() // D, D), (B, t.numel() // (B * D), D)}
        if t.dim() == 4:
            out.add((t.size(0), t.size(1), D))
    a = _attn(model, 0)
    out |= {(B, PS, a.kv_lora_rank), (B, PS, a.rope_dim)}
    return out


@pytest.fixture(scope="module", params=[0, 3], ids=["S1", "S4-next_n3"])
def tiny_run(request):
    next_n = request.param
    over = dict(enable_offload=True, decode_steps=STEPS, next_n=next_n)
    base, comp = models.build("tiny", **over), models.build("tiny", **over)
    B, S = comp.model.batch_size, comp.model.seq_per_step
    assert S == next_n + 1
    be = make_offload_backend(pool_size=PS, pa_block_size=comp.runner.pa_block_size, next_n=next_n)
    step = torch.compile(comp.model, backend=be)
    ref = base.driver.run(steps=STEPS, collect=True)

    comp.model.return_internals = True  # what Driver.run(collect=True) does, but stepping ourselves
    resident = []
    try:
        comp.driver.prefill()
        outs = []
        for _ in range(STEPS):
            outs.append(comp.driver.step(step))
            resident.append(check_pool_state(be.state, B, lambda l: _full_rows(comp.model, l, B)))
    finally:
        comp.model.return_internals = False
    return {"ref": ref.steps, "out": outs, "backend": be, "state": be.state, "model": comp.model,
            "final_graph": be.final_graph(),
            "B": B, "S": S, "K": comp.model.config.index_topk, "resident": resident,
            "groups": comp.model.index_groups(), "lengths": comp.driver.cur_len.clone()}


def test_outputs_match_unmodified_model(tiny_run):
    r = tiny_run
    assert len(r["out"]) == len(r["ref"]) == STEPS
    max_logits = max_attn = 0.0
    for i, (a, b) in enumerate(zip(r["ref"], r["out"])):
        assert torch.equal(a.positions, b.positions)
        max_logits = max(max_logits, (a.logits.float() - b.logits.float()).abs().max().item())
        assert len(a.attn) == len(b.attn) == 8
        for l, (x, y) in enumerate(zip(a.attn, b.attn)):
            max_attn = max(max_attn, (x.float() - y.float()).abs().max().item())
        # the indexer is untouched and serve reports the gather's valid length, layer by layer
        for g, (x, y) in enumerate(zip(a.topk, b.topk)):
            assert torch.equal(x, y), f"step {i}: top-k of group {g} differs"
        for l, (x, y) in enumerate(zip(a.act, b.act)):
            assert torch.equal(x, y), f"step {i}: actual length of layer {l} differs"
    assert max_logits == 0 and max_attn == 0, (max_logits, max_attn)  # eager: the rewrite is exact


def test_pool_holds_rows_every_step(tiny_run):
    r = tiny_run
    # invariants were asserted after each step; the pool is never empty after the first step
    assert len(r["resident"]) == STEPS and min(r["resident"]) > 0
    assert max(r["resident"]) <= len(r["groups"]) * r["B"] * PS
    m, S, K = r["model"], r["S"], r["K"]
    for l in range(8):
        a = _attn(m, l)
        check_ledger_layer(a.sel_status, a.sel_kv, _full_rows(m, l, r["B"])[0], S, K, r["lengths"], f"layer {l}")


def test_structure_and_report(tiny_run):
    r = tiny_run
    be = r["backend"]
    assert r["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(be.reports) == 1  # one graph served all 64 steps
    rep = be.reports[-1]
    assert rep["rewritten"] and rep["refusals"] == [] and rep["mode"] == "eager"
    assert [g["layers"] for g in rep["groups"]] == r["groups"]
    assert [(g["owner_layer"], g["S"], g["K"], g["B"]) for g in rep["groups"]] == \
        [(0, r["S"], r["K"], r["B"]), (4, r["S"], r["K"], r["B"])]
    assert rep["ops"]["before"]["npu_gather_selection_kv_cache"] == 8
    after = rep["ops"]["after"]
    assert (after["dsa_plan"], after["dsa_serve"], after["dsa_install"]) == (2, 8, 8)
    assert after["npu_gather_selection_kv_cache"] == 0 and after["npu_lightning_indexer"] == 2
    assert rep["reinplace"]["kept_functional"] == []
    assert_final_graph(r["final_graph"], None, PS, r["groups"], big=_big_shapes(r["model"], r["B"]))


def test_counters(tiny_run):
    r = tiny_run
    B, S, K = r["B"], r["S"], r["K"]
    for c, layers in zip(r["state"].counters(), r["groups"]):
        tot = c["total"]
        assert c["layers"] == layers and tot["steps"] == STEPS
        # prefill 256 > K: every top-k row is valid and is exactly one of hit / miss / window
        assert tot["hits"] + tot["misses"] + tot["window"] == STEPS * B * S * K
        assert tot["hits"] > 0 and tot["misses"] > 0
        assert tot["host_rows_read"] == (tot["misses"] + tot["window"]) * 4

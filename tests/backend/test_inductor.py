"""Inductor mode (one compile: slow on 2 cores): a singleton group plus an FSS group, S = 4, 64 steps."""
from __future__ import annotations

import pytest
import torch

import dsa_synth as synth
from backend_helpers import assert_final_graph, run_pair
from offload_passes.backend import _inductor_pass, make_offload_backend

PS = 64


@pytest.fixture(scope="module")
def inductor_run():
    # the FX graph cache would skip our post-grad pass on a warm cache; structure is checked on the pass
    with torch._inductor.config.patch(fx_graph_cache=False):
        cfg = synth.SynthConfig(pattern="FFSS", S=4, router=False)
        res = run_pair(cfg, 64, make_offload_backend(pool_size=PS, exe_mode="inductor"))
    res["cfg"] = cfg
    return res


def test_inductor_outputs_and_structure(inductor_run):
    r = inductor_run
    assert r["max_a"] <= 2e-2 and r["max_h"] <= 2e-2
    assert r["resident"] > 0
    rep = r["backend"].reports[-1]
    assert rep["rewritten"] and rep["mode"] == "inductor"
    assert [g["layers"] for g in rep["groups"]] == [[0], [1, 2, 3]]
    assert rep["reinplace"]["kept_functional"] == []
    assert_final_graph(r["backend"].final_graph(), r["cfg"], PS, [[0], [1, 2, 3]])
    tot = r["state"].counters()[1]["total"]
    assert tot["steps"] == 64 and tot["hits"] + tot["misses"] + tot["window"] == 64 * 2 * 4 * 64


def test_custom_pass_is_cacheable():
    a, b = _inductor_pass(lambda g, s: None), _inductor_pass(lambda g, s: None)
    assert a.uuid() == b.uuid() and len(a.uuid()) == 64

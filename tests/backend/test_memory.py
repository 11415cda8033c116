"""What a backend keeps is bounded, and ``torch._dynamo.reset()`` plus deleting the model returns it:
the post-reinplace graph, the pools and the compiled callable are freed; reports are a bounded deque."""
from __future__ import annotations

import gc
import weakref

import torch

import dsa_synth as synth
from backend_helpers import run_pair
from offload_passes import backend as backend_mod
from offload_passes.backend import make_offload_backend


def test_dynamo_reset_and_deleting_the_model_free_graphs_and_pools():
    cfg = synth.SynthConfig(pattern="FSSS", S=1)
    be = make_offload_backend(pool_size=64)
    res = run_pair(cfg, 2, be)
    graph = weakref.ref(be.final_graph())
    pool = weakref.ref(be.state.pools[0][0])
    compiled = weakref.ref(be._compiled[be.reports[-1].graph_id])
    assert graph() is not None and pool() is not None and compiled() is not None
    res.clear()
    del res
    torch._dynamo.reset()  # calls be.reset(): the graphs kept for inspection go too
    gc.collect()
    assert compiled() is None, "the compiled callable outlived torch._dynamo.reset()"
    assert graph() is None, "the final fx.Graph outlived torch._dynamo.reset() and the model"
    assert pool() is None, "the pools outlived their caches"
    assert be.final_graph() is None and len(be.reports) == 1  # the report (small) stays


def test_reports_are_bounded(monkeypatch):
    be = make_offload_backend(pool_size=64)
    n = backend_mod.MAX_REPORTS
    for i in range(n + 5):
        be.reports.append({"graph_id": f"g{i}"})
    assert len(be.reports) == n and be.reports[0]["graph_id"] == "g5"

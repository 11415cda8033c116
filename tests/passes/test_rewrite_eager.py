"""Eager mode end to end on the synthetic model: equal outputs, pool invariants, final-graph structure."""
from __future__ import annotations

import logging

import pytest
import torch

import dsa_synth as synth
from backend_helpers import assert_final_graph, check_ledger, check_pool_invariants, run_pair
from offload_passes.backend import OffloadRefused, make_offload_backend

PS = 64

CASES = [
    ("FSSS", 1, [[0, 1, 2, 3]]),
    ("FSSS", 4, [[0, 1, 2, 3]]),
    ("FFSFSSSSF", 1, [[0], [1, 2], [3, 4, 5, 6, 7], [8]]),
    ("FFSFSSSSF", 4, [[0], [1, 2], [3, 4, 5, 6, 7], [8]]),
    ("FFF", 2, [[0], [1], [2]]),
]


@pytest.fixture(scope="module", params=CASES, ids=[f"{p}-S{s}" for p, s, _ in CASES])
def run64(request):
    pattern, S, groups = request.param
    cfg = synth.SynthConfig(pattern=pattern, S=S)
    res = run_pair(cfg, 64, make_offload_backend(pool_size=PS), check_every=1)
    res.update(cfg=cfg, groups=groups)
    return res


def test_outputs_equal_and_invariants(run64):
    # SFA over the served selection equals SFA over the gathered one, bit for bit (same rows; the
    # reference SFA accumulates in fp64, so the order of the rows does not change the result)
    assert run64["max_a"] == 0, run64["max_a"]
    assert run64["max_h"] == 0, run64["max_h"]
    assert run64["resident"] > 0  # the pool really holds rows (invariants were checked every step)


def test_groups_and_report(run64):
    be = run64["backend"]
    rep = be.reports[-1]
    assert rep["rewritten"] is True and rep["refusals"] == []
    assert [g["layers"] for g in rep["groups"]] == run64["groups"]
    assert [g["owner_layer"] for g in rep["groups"]] == [g[0] for g in run64["groups"]]
    ops = rep["ops"]["after"]
    n = sum(len(g) for g in run64["groups"])
    assert (ops["dsa_plan"], ops["dsa_serve"], ops["dsa_install"]) == (len(run64["groups"]), n, n)
    assert ops["npu_gather_selection_kv_cache"] == 0 and rep["ops"]["before"]["npu_gather_selection_kv_cache"] == n
    assert rep["reinplace"]["kept_functional"] == []
    # other top-k producers (the router) are seen but never grouped
    assert len(rep["detect"]["other_topk"]) == n


def test_final_graph_structure(run64):
    be = run64["backend"]
    assert_final_graph(run64["final_graph"], run64["cfg"], PS, run64["groups"])


def test_counters(run64):
    cfg = run64["cfg"]
    counters = run64["state"].counters()
    for c, layers in zip(counters, run64["groups"]):
        tot = c["total"]
        assert tot["steps"] == 64
        # every valid top-k row is exactly one of hit / miss / window (docs/ops.md §8.8)
        assert tot["hits"] + tot["misses"] + tot["window"] == 64 * cfg.B * cfg.S * cfg.K
        assert tot["hits"] > 0 and tot["misses"] > 0
        assert tot["host_rows_read"] == (tot["misses"] + tot["window"]) * len(layers)
    st = run64["state"]
    assert sum(st.bytes().values()) == st.total_bytes > 0
    assert st.bytes()["pool_kv_l0"] == cfg.B * PS * cfg.Dkv * 2 and st.bytes()["id_to_slot_g0"] == cfg.B * 131072 * 4


def test_ledger_stays_valid(run64):
    """After the rewrite the model's gather ledger still describes the selection buffer."""
    check_ledger(run64["model"], run64["lengths"])


def test_reset_rows_prevents_stale_rows():
    cfg = synth.SynthConfig(pattern="FSS", S=1)
    res = run_pair(cfg, 12, make_offload_backend(pool_size=PS))
    base, m, c, be = res["base"], res["model"], res["compiled"], res["backend"]
    st = res["state"]
    # row 0 starts a new request (new prompt, same length): caches rewritten
    for mod in (base, m):
        mod.prefill([int(x) for x in res["lengths"]], seed=99, rows=[0])
    with pytest.raises(AssertionError, match="differs from full cache"):
        check_pool_invariants(st, m)  # stale pool rows of row 0 would be served as hits
    before_row1 = [g.pool_ids[1].clone() for g in st.groups]
    st.reset(rows=[0])
    for g, keep in zip(st.groups, before_row1):
        assert bool((g.pool_ids[0] == -1).all()) and bool((g.id_to_slot[0] == -1).all())
        assert bool((g.lru_counter[0] == 0).all())
        assert torch.equal(g.pool_ids[1], keep)  # other rows keep their pool
    check_pool_invariants(st, m)
    res2 = run_pair(cfg, 12, be, pair=(base, m), compiled=c, start_step=100, lengths=res["lengths"])
    assert res2["max_a"] == 0 and res2["max_h"] == 0
    with pytest.raises(ValueError, match=r"OffloadState.reset: rows entries must be in \[0, 2\)"):
        st.reset(rows=[cfg.B])


def test_full_reset_and_counters():
    cfg = synth.SynthConfig(pattern="FS", S=1, router=False)
    res = run_pair(cfg, 4, make_offload_backend(pool_size=PS))
    st = res["state"]
    assert st.totals()["misses"] > 0
    st.reset()
    assert st.totals() == {"hits": 0, "misses": 0, "window": 0, "host_rows_read": 0}
    assert all(bool((g.pool_ids == -1).all()) for g in st.groups)
    assert all(float(kv.abs().sum()) == 0 for kv, _ in st.pools.values())


def test_graph_without_dsa_passes_through():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(8, 8)

        def forward(self, x):
            v, i = torch.topk(self.w(x), 3)
            return v, i

    mod = Plain()
    be = make_offload_backend()
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = torch.compile(mod, backend=be)(x)
        ref = mod(x)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    rep = be.reports[-1]
    assert rep["rewritten"] is False and rep["refusals"] == [] and rep["detect"]["gathers"] == 0
    assert rep["ops"]["before"] == rep["ops"]["after"]
    assert be.state is None and be.final_graph() is None


def _capture(cfg):
    """The Dynamo graph and example inputs of the synthetic model (no rewrite)."""
    got = {}

    def grab(gm, ex):
        got["gm"], got["ex"] = gm, list(ex)
        return gm.forward

    _, m = synth.make_pair(cfg, [300, 280])
    with torch.no_grad():
        torch.compile(m, backend=grab)(*m.inputs(torch.tensor([301, 281]), 0))
    return got["gm"], got["ex"]


def test_quantised_kv_refused(caplog):
    """int8 KV keeps the gather path: the synthetic model has no int8 attention kernel, so the graph's
    full caches are re-typed in the node metadata the precondition pass reads."""
    from offload_passes.backend import rewrite_for_offload
    from offload_passes.options import OffloadOptions

    cfg = synth.SynthConfig(pattern="FS", S=1, router=False)
    gm, ex = _capture(cfg)
    for n in gm.graph.nodes:
        if n.op == "placeholder" and "full_kv" in n.name:
            n.meta["example_value"] = torch.empty(n.meta["example_value"].shape, dtype=torch.int8, device="meta")
    code = gm.code
    with caplog.at_level(logging.WARNING, logger="offload_passes"):
        gm2, state, rep = rewrite_for_offload(gm, ex, OffloadOptions(pool_size=PS))
    assert state is None and rep["rewritten"] is False and gm2.code == code
    assert {r["reason"] for r in rep["refusals"]} == {"quantised_kv"}
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 1
    with pytest.raises(OffloadRefused, match="quantised_kv"):
        rewrite_for_offload(gm, ex, OffloadOptions(pool_size=PS, strict=True))


REFUSALS = [
    ("topk_alignment", dict(K=96)),
]


@pytest.mark.parametrize("reason,kw", REFUSALS, ids=[r for r, _ in REFUSALS])
def test_refusals(reason, kw, caplog):
    cfg = synth.SynthConfig(pattern="FS", S=1, router=False, **kw)
    be = make_offload_backend(pool_size=PS)
    with caplog.at_level(logging.WARNING, logger="offload_passes"):
        res = run_pair(cfg, 3, be)
    rep = res["backend"].reports[-1]
    assert rep["rewritten"] is False
    assert reason in {r["reason"] for r in rep["refusals"]}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "not applied" in r.getMessage()]
    assert len(warnings) == 1 and reason in warnings[0].getMessage()
    assert res["max_h"] == 0.0 and res["max_a"] == 0.0  # unmodified graph: identical results
    assert rep["ops"]["after"]["npu_gather_selection_kv_cache"] == 2
    # strict: raise instead
    _, m = synth.make_pair(cfg, [300, 280])
    c = torch.compile(m, backend=make_offload_backend(pool_size=PS, strict=True))
    with pytest.raises(Exception, match=reason) as ei, torch.no_grad():
        c(*m.inputs(torch.tensor([301, 281]), 0))
    assert isinstance(ei.value, OffloadRefused) or isinstance(ei.value.__cause__, OffloadRefused) or \
        "OffloadRefused" in str(ei.value)


def test_pool_size_not_multiple_of_block_is_refused():
    cfg = synth.SynthConfig(pattern="F", S=1, router=False, BS=32)
    res = run_pair(cfg, 1, make_offload_backend(pool_size=16))
    assert "pool_size" in {r["reason"] for r in res["backend"].reports[-1]["refusals"]}


@pytest.mark.parametrize("S", [1, 2])
def test_no_rope_model_is_offloaded_exactly(S):
    """The gather's no-rope mode (1-D empty rope tensors) is the ops' no-rope mode (docs/ops.md §3.3): the
    group is offloaded with zero-width rope pools, the outputs equal the unmodified model's, the pools hit."""
    cfg = synth.SynthConfig(pattern="FSF", S=S, rope=False)
    res = run_pair(cfg, 16, make_offload_backend(pool_size=PS), check_every=1)
    rep = res["backend"].reports[-1]
    assert rep["rewritten"] is True and rep["refusals"] == []
    assert res["max_a"] == 0 and res["max_h"] == 0
    ops = rep["ops"]["after"]
    assert (ops["dsa_plan"], ops["dsa_serve"], ops["dsa_install"]) == (2, 3, 3)
    assert ops["npu_gather_selection_kv_cache"] == 0
    st = res["state"]
    assert all(rope.shape == (cfg.B, PS, 0) for _, rope in st.pools.values())
    assert st.totals()["hits"] > 0 and res["resident"] > 0


def test_no_rope_model_keeps_the_gather_in_the_npu_modes(caplog):
    """CANN's serve / install tilings reject a zero rope width (docs/ops.md §3.3): in an NPU mode the
    no-rope model is refused by name (the graph keeps its gathers) before anything is lowered."""
    from offload_passes.backend import rewrite_for_offload
    from offload_passes.options import OffloadOptions

    got = {}

    def grab(gm, ex):
        got["gm"], got["ex"] = gm, list(ex)
        return gm.forward

    cfg = synth.SynthConfig(pattern="FS", S=1, router=False, rope=False)
    _, m = synth.make_pair(cfg, [300, 280])
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(m, backend=grab)(*m.inputs(torch.tensor([300, 280]) + cfg.S, 0))
    code = got["gm"].code
    with caplog.at_level(logging.WARNING, logger="offload_passes"):
        gm, state, rep = rewrite_for_offload(got["gm"], got["ex"], OffloadOptions(pool_size=PS, exe_mode="ge_graph"))
    assert state is None and rep["rewritten"] is False and gm.code == code
    assert {r["reason"] for r in rep["refusals"]} == {"no_rope_npu"} and [r["layer"] for r in rep["refusals"]] == [0, 1]
    assert all("CANN's dsa_serve / dsa_install tilings reject a zero rope width" in r["detail"] for r in rep["refusals"])
    with pytest.raises(OffloadRefused, match="no_rope_npu"):
        rewrite_for_offload(got["gm"], got["ex"], OffloadOptions(pool_size=PS, exe_mode="ge_graph", strict=True))

"""The HF front-end gets everything the recipe path has (one core, passes/rewrite.py): the opt-in
second-chance policy (its counters equal offload-sim's replay of its own trace), the run-time lengths
guard, the same refusal reasons and ``strict`` behaviour, the same report schema."""
from __future__ import annotations

import logging

import pytest
import torch

from offload_passes.backend import OffloadRefused, make_offload_backend
from offload_passes.models import hf
from offload_passes.trace import sim

PS = 64  # = K: every step evicts


def _run(steps: int, **opts):
    torch._dynamo.reset()
    over = dict(dtype="bfloat16", decode_steps=steps)
    base, comp = hf.build("hf-tiny", **over), hf.build("hf-tiny", **over)
    be = make_offload_backend(**opts)
    fn = torch.compile(comp.model, backend=be, fullgraph=True)
    db, dc = base.decoder(), comp.decoder()
    db.prefill()
    dc.prefill()
    return be, fn, db, dc


def test_second_chance_on_hf_is_exact_and_replays_to_sa_clock():
    be, fn, db, dc = _run(8, pool_size=PS, replacement_policy="second_chance")
    a, b = db.step(), dc.step(fn)  # compiles
    st = be.state
    rep = be.reports[-1]
    assert rep["ops"]["after"]["dsa_install_sc"] == 8 and rep["ops"]["after"]["dsa_install"] == 0
    st.reset()  # cold, counters cleared: the replay starts from the same empty pool
    st.record_trace()
    diffs = []
    try:
        for _ in range(6):
            a, b = db.step(), dc.step(fn)
            diffs.append(float((a.float() - b.float()).abs().max() / a.float().abs().max()))
    finally:
        st.record_trace(False)
    tr = st.trace("hf-tiny")
    tot = st.totals()
    sc = sim.simulate(tr, "sa_clock", PS)
    assert (sc.hits, sc.misses, sc.window) == (tot["hits"], tot["misses"], tot["window"])
    fifo = sim.simulate(tr, "sa_fifo", PS)
    assert (fifo.hits, fifo.misses) != (sc.hits, sc.misses), "the trace does not tell the policies apart"
    assert max(diffs) <= 2e-2, diffs  # the policy changes what is cached, never what is served


def test_hf_graph_has_the_lengths_guard_and_the_invalidation():
    be, fn, db, dc = _run(2)
    dc.step(fn)
    rep = be.reports[-1]
    assert rep["frontend"] == "hf" and rep["rewritten"] and rep["hf"]["offload"]
    assert len(rep["guards"]) == 2  # the cache-length guard of each group (before its invalidation and plan)
    assert rep["ops"]["after"]["dsa_plan"] == 2
    names = {s["name"] for s in rep["state"]}
    assert {"external_write_g0", "seen_len_g0", "external_write_g1"} <= names


def test_hf_offload_refusal_keeps_sparse_attention_and_strict_raises(caplog):
    torch._dynamo.reset()
    over = dict(dtype="float32", decode_steps=2)
    comp = hf.build("hf-tiny", **over)
    be = make_offload_backend()
    fn = torch.compile(comp.model, backend=be, fullgraph=True)
    dc = comp.decoder()
    dc.prefill()
    with caplog.at_level(logging.WARNING, logger="offload_passes"):
        dc.step(fn)
    rep = be.reports[-1]
    assert rep["rewritten"] and not rep["hf"]["offload"]  # sparse attention only
    assert {r["reason"] for r in rep["hf"]["offload_refusals"]} == {"kv_dtype"}
    warns = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "not applied" in r.getMessage()]
    # one warning, each reason named once with the layers it applies to
    assert len(warns) == 1 and warns[0].count("kv_dtype") == 1 and "layers 0, 1, 2" in warns[0], warns
    torch._dynamo.reset()
    strict = make_offload_backend(strict=True)
    fn = torch.compile(comp.model, backend=strict, fullgraph=True)
    dc = comp.decoder()
    dc.prefill()
    with pytest.raises(Exception, match="kv_dtype"):
        dc.step(fn)

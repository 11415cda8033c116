"""offload-capacity --what-if: a physically constrained latency model, validated out of sample, fitted and
predicting with one set of hit rates per trace-ensemble member; the 8K-vs-16K answer anchored on the
reference's measured difference; a recorded trace turned into a latency prediction."""
from __future__ import annotations

import json
import sys

import pytest

from offload_passes.tools import capacity_plan, capacity_plan_whatif as W

SIM_HITS = {8192: 0.848, 16384: 0.961}   # SA-FIFO rates of a long warm calibrated trace
FAST = ["--what-if", "--seeds", "1", "--steps", "24", "--warmup", "24", "--models", "segments"]


def test_fit_is_physical_and_reproduces_the_reference():
    for hits in (None, SIM_HITS):
        f = W.fit(hits=hits)
        assert len(f.residuals) == 6
        assert all(o >= 0 for o in f.O.values()), f.O
        assert 0 < f.bw_h2d <= W.CONSTANTS["pcie5_x16"][0]
        assert [r["error_pct"] for r in f.residuals if not r["offload"]] == [0.0, 0.0]
        assert max(abs(r["error_pct"]) for r in f.residuals) < 1.0
    # the reference's stated 85 % / 90 % want a negative ge_graph overhead: the bound is active, recorded
    f = W.fit()
    assert f.free["O_ms"]["ge_graph"] < 0 and f.O["ge_graph"] == 0.0 and "O[ge_graph] = 0" in f.constrained


def test_non_physical_fit_is_refused():
    # more hits at 8K than at 16K: the 8K-16K latency gap would need a negative host time
    with pytest.raises(W.NonPhysicalFit, match="non-physical: the host transfer time"):
        W.fit(hits={8192: 0.95, 16384: 0.85})
    # 8K missing 18x more rows than 16K for only 8.5 ms more: a host rate above the PCIe ceiling would be
    # needed; at the ceiling the latencies are missed by far more than the tolerance -> refused
    with pytest.raises(W.NonPhysicalFit, match="no physical parameters.*BW_h2d = PCIe 5.0 x16 ceiling"):
        W.fit(hits={8192: 0.05, 16384: 0.95})


def test_validation_errors_are_computed_not_typed():
    v = W.validate(hits=SIM_HITS)
    assert len(v["leave_one_out"]) == 4 and len(v["cross_mode"]) == 4
    # recompute one leave-one-out error by hand: fit without ge_graph 16K, predict it
    rest = [p for p in W.REFERENCE if not (p[0] == "ge_graph" and p[2] == 16384)]
    f = W.fit(hits=SIM_HITS, points=rest, tol_pct=float("inf"))
    pred = f.latency("ge_graph", W.Shape(), 128, True, SIM_HITS[16384]) * 1e3
    row = [r for r in v["leave_one_out"] if r["mode"] == "ge_graph" and r["pool"] == 16384][0]
    assert row["error_pct"] == round(100 * (pred - 92.03) / 92.03, 2)
    assert v["loo_max_abs_pct"] == max(abs(r["error_pct"]) for r in v["leave_one_out"])
    # out of sample is worse than in sample (the fit has one spare degree of freedom)
    fit_err = max(abs(r["error_pct"]) for r in W.fit(hits=SIM_HITS).residuals)
    assert v["loo_max_abs_pct"] > fit_err and v["cross_mode_max_abs_pct"] > v["loo_max_abs_pct"]
    # the hit rates change the errors (they are not constants)
    assert W.validate(hits={8192: 0.80, 16384: 0.93})["leave_one_out"] != v["leave_one_out"] or \
        W.fit(hits={8192: 0.80, 16384: 0.93}).bw_h2d != W.fit(hits=SIM_HITS).bw_h2d


def test_every_constant_states_a_source():
    for name, (value, unit, source) in W.CONSTANTS.items():
        assert value > 0 and len(source) > 20, name


def test_predictions_are_monotone_in_hit_rate_and_batch():
    f = W.fit(hits=SIM_HITS)
    s = W.Shape()
    t = [f.latency("ge_graph", s, 128, True, h) for h in (0.7, 0.85, 0.95)]
    assert t[0] > t[1] > t[2]
    assert f.latency("ge_graph", s, 192, True, 0.9) > f.latency("ge_graph", s, 128, True, 0.9)
    assert f.latency("ge_graph", W.Shape(context=131072), 64, False) > f.latency("ge_graph", s, 64, False)
    assert W.pool_bytes_per_rank(s, 8192, 128) == 8192 * 4 * 78 * 1152


def test_cli_what_if_json_ranges_and_question(capsys):
    assert capacity_plan.main(FAST + ["--pools", "8192,16384", "--policies", "sa_fifo,sa_clock", "--batches",
                                      "128", "--json"]) == 0
    o = json.loads(capsys.readouterr().out)
    rows = {(r["policy"], r["pool"]): r for r in o["rows"]}
    assert set(rows) == {("no offload", 0), ("sa_fifo", 8192), ("sa_fifo", 16384), ("sa_clock", 8192),
                         ("sa_clock", 16384)}
    r = rows[("sa_fifo", 8192)]
    assert r["ms"]["min"] <= r["ms"]["median"] <= r["ms"]["max"]
    lo, hi = r["ms_interval_with_loo"]
    assert lo <= r["ms"]["min"] and hi >= r["ms"]["max"]
    assert rows[("sa_fifo", 16384)]["ms"]["median"] < r["ms"]["median"]
    m = o["members"][0]
    assert set(m["fit_hits"]) == {"8192", "16384"} and m["O_ms"]["ge_graph"] >= 0
    q = {(p["policy"], p["pool"]): p for p in o["question"]["pairs"]}
    assert q[("sa_clock", 8192)]["pool_gib_saved_per_rank"] == round(8192 * 4 * 78 * 1152 / 2**30, 3)


@pytest.mark.parametrize("args,msg", [
    (["--pools", "3"], "--pools must be a multiple of 16 (dsa_plan / dsa_install limits), got 3"),
    (["--pools", "768"], "--pools / 16 (sets) must be a power of two (dsa_plan / dsa_install limits), got 48"),
    (["--pools", "32768"], "--pools must be in (0, 16384] (dsa_plan / dsa_install limits), got 32768"),
    (["--seeds", "0"], "--seeds must be in [1, 16], got 0"),
    (["--contexts", "99999999999"], "--contexts must be in (2048, 1048576], got 99999999999"),
    (["--policies", "mru"], "unknown mru"),
    (["--models", "zipf"], "--models: unknown zipf"),
])
def test_cli_mistakes_are_one_line_exit_2(args, msg, capsys):
    with pytest.raises(SystemExit) as e:
        capacity_plan.main(["--what-if"] + args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err and err.count("\n") == 1


def test_missing_scipy_is_one_line_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "scipy", None)  # as if scipy were not installed
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    with pytest.raises(SystemExit) as e:
        capacity_plan.main(["--what-if"] + FAST)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--what-if needs numpy and scipy" in err and "offload_passes[plan]" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_indexer_cache_is_the_production_int8_with_fp16_scales():
    s = W.Shape()
    assert (s.index_bytes, s.index_scale_bytes) == (1, 2)
    attn = s.layers * s.S * s.K * s.row_bytes
    idx = s.full_layers * s.context * (128 + 2)
    assert W.t_row(s) == (attn + idx) / (3.2e12 / 2)


def test_anchored_answer_is_the_models_own_for_any_fitted_constants():
    assert W.REFERENCE_DELTA_MS == {"ge_graph": 8.52, "npugraph_ex": 9.37}
    assert W.anchored_ms(0.85, 0.94) == pytest.approx(8.52)
    assert W.anchored_ms(0.94, 0.94) == 0.0 and W.anchored_ms(0.95, 0.94) < 0
    assert W.anchored_ms(0.85, 0.94, mode="npugraph_ex") == pytest.approx(9.37)
    # the model is affine in h with a pool-independent slope: every fit gives the same ratio
    for hits in (SIM_HITS, {8192: 0.85, 16384: 0.93}):
        f, s = W.fit(hits=hits), W.Shape()
        h8, h16 = hits[8192], hits[16384]
        t = lambda h: f.latency("ge_graph", s, 128, True, h)  # noqa: E731
        for h in (0.80, 0.9, 0.99):
            ratio = (t(h) - t(h16)) / (t(h8) - t(h16))
            assert ratio == pytest.approx(W.anchored_ms(h, h16, h8) / 8.52, rel=1e-9)
    with pytest.raises(ValueError, match="need 0 <= h8 < h16 <= 1"):
        W.anchored_ms(0.9, 0.85)


def test_reference_table_does_not_pin_the_16k_rate():
    rows = W.h16_consistency([0.905, 0.94, 0.97])
    assert all("worst_error_pct" in r and r["worst_error_pct"] < 0.5 for r in rows), rows
    assert rows[0]["ms_per_point"] > rows[-1]["ms_per_point"]


def _trace_file(tmp_path):
    from offload_passes.trace import cli as trace_cli

    path = tmp_path / "t.npz"
    spec = "synth:context=40000,steps=24,B=1,S=1,K=2048,P=2048,drift=0.55,skew=1.8,seed=2"
    assert trace_cli.main([spec, "--pool-sizes", "8192", "--policies", "sa_fifo", "--save-trace", str(path),
                           "--json"]) == 0
    return path


def test_trace_to_latency_command(tmp_path, capsys):
    from offload_passes.trace import sim
    from offload_passes.trace.format import load_trace

    path = _trace_file(tmp_path)
    capsys.readouterr()
    assert capacity_plan.main(["--what-if", "--trace", str(path), "--policy", "sa_clock", "--pool", "8192",
                               "--warmup", "8", "--json"]) == 0
    o = json.loads(capsys.readouterr().out)
    tr = load_trace(path)
    h = sim.simulate(tr, "sa_clock", 8192, warmup=8).hit_rate
    f8 = sim.simulate(tr, "sa_fifo", 8192, warmup=8).hit_rate
    f16 = sim.simulate(tr, "sa_fifo", 16384, warmup=8).hit_rate
    assert o["hit"] == round(h, 6) and o["fifo_hits"] == {"8192": round(f8, 6), "16384": round(f16, 6)}
    assert f8 < h < f16
    a = o["anchored"]
    assert a["ms_vs_fifo16k"] == round(W.anchored_ms(h, f16, f8), 3) > 0 and not a["reaches_fifo16k"]
    assert a["ms"] == round(92.03 + W.anchored_ms(h, f16, f8), 2)
    f = W.fit(hits={8192: f8, 16384: f16})
    assert o["model"]["ms"] == round(f.latency("ge_graph", W.Shape(), 128, True, h) * 1e3, 2)
    # the real FIFO rates given: the anchored answer uses them
    assert capacity_plan.main(["--what-if", "--trace", str(path), "--policy", "sa_clock", "--warmup", "8",
                               "--fifo8k-hit", "0.85", "--fifo16k-hit", "0.95"]) == 0
    text = capsys.readouterr().out
    assert f"{W.anchored_ms(h, 0.95, 0.85):+.2f} ms vs SA-FIFO 16K" in text and "(given)" in text


@pytest.mark.parametrize("args,msg", [
    (["--trace", "/no/such/trace.npz"], "--trace /no/such/trace.npz: trace file /no/such/trace.npz does not exist"),
    (["--policy", "mru"], "--policy: unknown 'mru'"),
    (["--pool", "3000", "--policy", "sa_clock"], "--pool must be a multiple of 16 (dsa_plan / dsa_install limits), "
                                                 "got 3000"),
    (["--pool", "768", "--policy", "lru"], "--pool / 16 (sets) must be a power of two (dsa_plan / dsa_install "
                                           "limits), got 48"),
    (["--fifo16k-hit", "1.5"], "--fifo16k-hit must be a hit rate in [0, 1], got 1.5"),
    (["--warmup", "500"], "--warmup must be in [0, steps=24) of the trace, got 500"),
])
def test_trace_command_mistakes_are_one_line_exit_2(args, msg, tmp_path, capsys):
    path = _trace_file(tmp_path) if "/no/such" not in args[-1] else None
    argv = ["--what-if"] + ([] if path is None else ["--trace", str(path)]) + args
    capsys.readouterr()
    try:
        rc = capacity_plan.main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err and err.count("\n") == 1


def test_anchored_table_from_a_study_json(tmp_path, capsys):
    st = {"policies": [
        {"policy": "sa_clock", "pool": 8192, "hit_consistent": {"mean": 0.90, "min": 0.89, "max": 0.91, "n": 3}},
        {"policy": "sa_clock", "pool": 16384, "hit_consistent": {"mean": 0.95, "min": 0.94, "max": 0.96, "n": 3}},
        {"policy": "lru", "pool": 8192, "hit_consistent": None}]}
    path = tmp_path / "study.json"
    path.write_text(json.dumps(st))
    assert capacity_plan.main(["--what-if", "--anchored", str(path), "--h16", "0.92,0.95"]) == 0
    out = capsys.readouterr().out
    consistency, answer = out.strip().split("\n\n")
    # first the fit for each candidate 16K rate, then the answer per policy at 8K (the row without rates skipped)
    assert consistency.splitlines()[2].startswith("| 92.0 % | 0.23 % |") and len(consistency.splitlines()) == 4
    lines = answer.splitlines()
    assert len(lines) == 3 and lines[2].startswith("| sa_clock | 90.00 (89.00–91.00) |")
    mid, lo, hi = (W.anchored_ms(h, 0.95) for h in (0.90, 0.91, 0.89))
    assert f"{mid:+.2f} ({lo:+.2f} to {hi:+.2f})" in lines[2]
    with pytest.raises(SystemExit) as e:
        capacity_plan.main(["--what-if", "--anchored", str(path), "--h16", "0.8"])
    assert e.value.code == 2 and "--h16 must be hit rates in (0.85, 1]" in capsys.readouterr().err
    assert capacity_plan.main(["--what-if", "--anchored", str(tmp_path / "none.json")]) == 2
    assert "--anchored" in capsys.readouterr().err

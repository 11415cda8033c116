"""offload-plan --what-if: the latency model reproduces the reference table and predicts sensibly."""
from __future__ import annotations

import json

import pytest

from offload_passes.tools import capacity_plan, capacity_plan_whatif as W


def test_fit_reproduces_all_six_reference_latencies_within_10_percent():
    f = W.fit()
    assert len(f.residuals) == 6
    for r in f.residuals:
        assert abs(r["model_ms"] - r["reference_ms"]) <= 0.10 * r["reference_ms"], r
    # the no-offload points are matched exactly (A_m is solved from them)
    assert [r["error_pct"] for r in f.residuals if not r["offload"]] == [0.0, 0.0]
    # a physical effective host rate: positive and below the PCIe 5.0 x16 peak
    assert 0 < f.bw_h2d < W.CONSTANTS["pcie5_x16"][0]


def test_every_constant_states_a_source():
    for name, (value, unit, source) in W.CONSTANTS.items():
        assert value > 0 and len(source) > 20, name


def test_predictions_are_monotone_in_hit_rate_and_batch():
    f = W.fit()
    s = W.Shape()
    t = [f.latency("ge_graph", s, 128, True, h) for h in (0.7, 0.85, 0.95)]
    assert t[0] > t[1] > t[2]
    assert f.latency("ge_graph", s, 192, True, 0.9) > f.latency("ge_graph", s, 128, True, 0.9)
    longer = W.Shape(context=131072)
    assert f.latency("ge_graph", longer, 64, False) > f.latency("ge_graph", s, 64, False)


def test_cli_what_if_json(capsys):
    assert capacity_plan.main(["--what-if", "--pools", "8192", "--policies", "sa_fifo", "--batches", "128",
                               "--seeds", "1", "--json"]) == 0
    o = json.loads(capsys.readouterr().out)
    rows = {(r["policy"], r["pool"]): r for r in o["rows"]}
    assert set(rows) == {("no offload", 0), ("sa_fifo", 8192)}
    assert 0.8 < rows[("sa_fifo", 8192)]["hit"] < 0.9
    assert rows[("sa_fifo", 8192)]["ms"] > rows[("no offload", 0)]["ms"]
    assert len(o["residuals"]) == 6 and o["fit"]["bw_h2d_GBps"] > 0


def test_cli_rejects_unknown_policy(capsys):
    with pytest.raises(SystemExit):
        capacity_plan.main(["--what-if", "--policies", "mru"])
    assert "unknown mru" in capsys.readouterr().err

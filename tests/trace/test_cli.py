"""offload-sim command line: table, --json, --plot, errors."""
from __future__ import annotations

import json

import pytest

from offload_passes.trace import cli, sim
from offload_passes.trace.format import load_trace

SPEC = "synth:context=600,steps=8,B=1,S=1,K=64,P=128,seed=4"


def test_json_and_plot(tmp_path, capsys):
    png = tmp_path / "p.png"
    saved = tmp_path / "t.npz"
    assert cli.main([SPEC, "--pool-sizes", "64,128", "--json", "--plot", str(png), "--save-trace", str(saved)]) == 0
    out = json.loads(capsys.readouterr().out)
    pols = [r["policy"] for r in out["results"]]
    # every policy (ranked ones too: P > K) at both sizes, adjacent once
    assert pols.count("adjacent") == 1
    for p in sim.POLICIES:
        if p != "adjacent":
            assert pols.count(p) == 2, p
    by = {(r["policy"], r["pool_size"]): r for r in out["results"]}
    for ps in (64, 128):
        for p in sim.ONLINE[1:] + ("rank_keep",):
            assert by[("belady", ps)]["hit_rate"] >= by[(p, ps)]["hit_rate"]
    assert out["lookups_per_s"] > 0 and out["header"]["K"] == 64
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert load_trace(saved).topk.shape == (8, 1, 1, 1, 128)


def test_table_and_smaller_k(capsys):
    assert cli.main([SPEC, "--pool-sizes", "64", "--policies", "lru,sa_fifo,belady", "--k", "32"]) == 0
    text = capsys.readouterr().out
    assert "K=32" in text and "M lookups/s" in text
    lines = [ln.split()[0] for ln in text.splitlines()[3:6]]
    assert lines == ["lru", "sa_fifo", "belady"]


def test_errors(capsys, tmp_path):
    with pytest.raises(SystemExit):
        cli.main([SPEC, "--policies", "lru,mru"])
    assert "unknown mru" in capsys.readouterr().err
    assert cli.main([str(tmp_path / "none.npz")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main([SPEC, "--pool-sizes", "48", "--policies", "sa_fifo"]) == 2
    assert "16 x a power of two, got 48" in capsys.readouterr().err
    assert cli.main(["synth:bogus=1"]) == 2
    assert "unknown synthetic parameter 'bogus'" in capsys.readouterr().err

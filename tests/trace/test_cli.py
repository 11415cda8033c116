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


# ---------------------------------------------------------------------------------- bad traces and arguments
def _tiny_trace(tmp_path, ids, L):
    import numpy as np

    from offload_passes.trace.format import Trace, save_trace

    topk = np.array(ids, dtype=np.int32).reshape(len(ids), 1, 1, 1, -1)
    return save_trace(Trace(topk, np.full((len(ids), 1), L, dtype=np.int32), topk.shape[-1]), tmp_path / "t.npz")


def test_huge_ids_beyond_the_lengths_do_not_size_the_id_maps(tmp_path, capsys):
    # a 2-step trace with id 1e9: the maps are sized by the lengths (was 24 GB and an OOM kill)
    path = _tiny_trace(tmp_path, [[5, 1_000_000_000], [5, 7]], 100)
    from offload_passes.trace.format import load_trace

    assert load_trace(path).id_range == 100
    assert cli.main([str(path), "--pool-sizes", "16", "--policies", "lru,sa_fifo,belady", "--json"]) == 0
    by = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert by["lru"]["hits"] == 1 and by["belady"]["hits"] == 1  # id 5 reused; 1e9 is beyond the length


def test_unreadable_trace_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"PK\x03\x04 definitely not a zip")
    assert cli.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("offload-sim: error:") and "unreadable trace file" in err and err.count("\n") == 1
    assert cli.main([str(tmp_path)]) == 2
    assert "is not a file" in capsys.readouterr().err


@pytest.mark.parametrize("args,msg", [
    (["--ways", "0"], "--ways must be an integer in [1, 1024], got 0"),
    (["--plot", "/nonexistent_dir_h2/p.png"], "folder '/nonexistent_dir_h2' does not exist"),
    (["--warmup", "-1"], "--warmup must be an integer >= 0, got -1"),
    (["--pool-sizes", "64,nan"], "--pool-sizes must be comma-separated integers >= 1, got '64,nan'"),
    (["--save-trace", "/nonexistent_dir_h2/t.npz"], "--save-trace '/nonexistent_dir_h2/t.npz': folder"),
])
def test_bad_options_exit_2_before_the_run(args, msg, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([SPEC, "--pool-sizes", "64"] + args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err and err.count("\n") == 1


def test_plot_into_a_directory_is_rejected_up_front(tmp_path, capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(sim, "sweep", lambda *a, **k: ran.append(1) or [])
    with pytest.raises(SystemExit):
        cli.main([SPEC, "--plot", str(tmp_path)])
    assert "is a directory" in capsys.readouterr().err and not ran


# ---------------------------------------------------------------------------------- files named synth*, the spec
def test_an_existing_file_named_synth_is_read_not_generated(tmp_path, monkeypatch, capsys):
    """``offload-sim synth_run.npz``: the file, whatever its name (it once ran the built-in synthetic model)."""
    monkeypatch.chdir(tmp_path)
    assert cli.main([SPEC, "--pool-sizes", "64", "--policies", "lru,belady", "--json",
                     "--save-trace", "synth_run.npz"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert cli.main(["synth_run.npz", "--pool-sizes", "64", "--policies", "lru,belady", "--json"]) == 0
    read = json.loads(capsys.readouterr().out)
    assert read["header"]["steps"] == 8 and read["header"]["K"] == 64 and read["header"]["P"] == 128
    assert read["header"]["model"] == written["header"]["model"] == load_trace("synth_run.npz").model
    assert [(r["policy"], r["hits"], r["lookups"]) for r in read["results"]] == \
        [(r["policy"], r["hits"], r["lookups"]) for r in written["results"]]
    # a hand-made trace under a spec-like name: its figures are exact (id 5 hits in steps 2 and 3, 7 in step 3)
    _tiny_trace(tmp_path, [[5, 6], [5, 7], [5, 7]], 100).rename(tmp_path / "synth")
    assert cli.main(["synth", "--pool-sizes", "16", "--policies", "lru", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["header"]["steps"] == 3 and out["header"]["K"] == 2
    assert [(r["hits"], r["lookups"]) for r in out["results"] if r["policy"] == "lru"] == [(3, 6)]


def test_a_missing_file_named_synth_is_an_error_not_a_synthetic_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["synth_run.npz"]) == 2
    assert capsys.readouterr().err == "offload-sim: error: trace file synth_run.npz does not exist\n"


def test_comma_spec_keeps_its_parameters(capsys):
    """``synth,steps=10`` (the form ``--help`` shows) runs 10 steps, not the default 96."""
    assert cli.main(["synth,steps=10", "--pool-sizes", "2048", "--policies", "lru", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["header"]["steps"] == 10 and out["header"]["synth"]["steps"] == 10
    lru = [r for r in out["results"] if r["policy"] == "lru"]
    assert [r["lookups"] for r in lru] == [10 * 2048]   # 10 steps x B=1 x S=1 x K=2048


@pytest.mark.parametrize("spec,msg", [
    ("synth:skew=nan", "skew must be a finite number in [0, 100], got 'nan'"),
    ("synth:skew=-5", "skew must be a finite number in [0, 100], got '-5'"),
    ("synth,bogus=1", "unknown synthetic parameter 'bogus'; known: context, steps, B, S, K, P, sinks, skew, drift, "
                      "recency, tau, seed, pop_drift"),
    ("synth,steps=0", "steps must be an integer in [1, 1048576], got '0'"),
    ("synth:tau=inf", "tau must be a finite number in (0, 4194304], got 'inf'"),
])
def test_bad_synthetic_specs_exit_2_with_one_line(spec, msg, capsys):
    assert cli.main([spec, "--pool-sizes", "64"]) == 2
    assert capsys.readouterr().err == f"offload-sim: error: synthetic spec {spec!r}: {msg}\n"


def test_console_script_reads_a_relative_synth_file(tmp_path):
    import subprocess
    import sys

    _tiny_trace(tmp_path, [[5, 6], [5, 7]], 100).rename(tmp_path / "synth_run.npz")
    run = [sys.executable, "-m", "offload_passes.trace.cli"]
    r = subprocess.run(run + ["synth_run.npz", "--pool-sizes", "16", "--policies", "lru"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("trace synth_run.npz: model=unknown K=2 P=2 S=1 B=1 steps=2 ")
    r = subprocess.run(run + ["synth:skew=nan"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert (r.returncode, r.stderr) == (2, "offload-sim: error: synthetic spec 'synth:skew=nan': skew must be a "
                                           "finite number in [0, 100], got 'nan'\n")

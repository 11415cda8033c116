"""The Atlas A3 check script: argument parsing, dry run and reporting on CPU (it is never run here)."""
from __future__ import annotations

import sys

import pytest

from offload_passes.tools import atlas_check as ac


def test_defaults_cover_both_presets_and_modes():
    a = ac.parse_args([])
    assert a.models == ["tiny", "glm-5.2-78l"] and a.modes == ["ge_graph", "npugraph_ex"]
    assert (a.steps, a.warmup, a.tol, a.device, a.dry_run) == (8, 2, 2e-2, "npu:0", False)
    b = ac.parse_args(["--models", "tiny", "--modes", "npugraph_ex", "--steps", "3", "--set", "batch_size=4",
                       "next_n=1"])
    assert b.models == ["tiny"] and b.modes == ["npugraph_ex"] and b.overrides == {"batch_size": 4, "next_n": 1}


@pytest.mark.parametrize("argv,msg", [
    (["--modes", "eager"], "--modes: unknown mode(s) ['eager']"),
    (["--steps", "0"], "--steps and --warmup must be >= 1, got steps=0 warmup=2"),
    (["--set", "batch_size"], "--set expects KEY=VALUE, got 'batch_size'"),
])
def test_bad_arguments_are_rejected_with_a_reason(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        ac.parse_args(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_dry_run_prints_the_plan_and_imports_no_npu_stack(capsys):
    had = "torch_npu" in sys.modules
    assert ac.main(["--dry-run", "--models", "tiny", "--steps", "4", "--pool-size", "16384"]) == 0
    out = capsys.readouterr().out
    assert ("device npu:0, 2 warmup + 4 measured steps, tol 0.02, pool_size 16384, side stream True, "
            "recipe compiler config") in out
    assert "  tiny: eager (reference), ge_graph, npugraph_ex" in out
    assert "environment: python=" in out
    assert ("torch_npu" in sys.modules) == had


def test_without_torch_npu_the_real_run_stops_with_exit_code_2(monkeypatch, capsys):
    monkeypatch.setattr(ac, "environment", lambda: {"torch_npu": False, "torchair": False})
    assert ac.main(["--models", "tiny"]) == 2
    assert "torch_npu is not importable; this check needs an Atlas A3" in capsys.readouterr().err


def test_result_table():
    rs = [ac.RunResult("tiny", "ge_graph", ok=True, compile_s=12.0, step_ms=2.0, eager_step_ms=5.0,
                       max_abs_diff=1e-3, hit_rate=0.85, rewritten=True),
          ac.RunResult("glm-5.2-78l", "npugraph_ex", ok=False, error="RuntimeError: boom")]
    lines = ac.format_table(rs, 2e-2).splitlines()
    assert lines[0].split() == ["preset", "mode", "compile", "s", "step", "ms", "eager", "ms", "speedup",
                                "max|diff|", "hit", "rate", "result"]
    assert lines[2].split() == ["tiny", "ge_graph", "12.0", "2.00", "5.00", "2.50x", "0.001", "85.0%", "PASS"]
    assert lines[3].endswith("ERROR: RuntimeError: boom")


def test_hit_rate_from_counters():
    class State:
        def counters(self):
            return [{"total": {"hits": 3, "misses": 1}}, {"total": {"hits": 5, "misses": 1}}]

    assert ac._hit_rate(State()) == pytest.approx(0.8)
    assert ac._hit_rate(None) is None

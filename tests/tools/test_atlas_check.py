"""``offload-atlas-check`` on CPU: argument handling, dry run, preflight and report writing (its device
runs need an Atlas A3). CANN's op library is the labelled C++ TEST DOUBLE of ``tests/testdoubles``; GE's IR
registry is the ``_torchair`` TEST DOUBLE of ``tests/testdoubles``."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from offload_passes.tools import atlas_check as ac

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_cover_both_presets_and_modes():
    a = ac.parse_args([])
    assert a.models == ["tiny", "glm-5.2-78l"] and a.modes == ["ge_graph", "npugraph_ex"]
    assert (a.steps, a.warmup, a.tol, a.device, a.dry_run) == (8, 2, 2e-2, "npu:0", False)
    assert (a.kv_memory, a.bookkeeping, a.recipe, a.cann_ops, a.report) == (
        "swapped", False, None, None, "atlas_check_report.json")
    b = ac.parse_args(["--models", "tiny", "--modes", "npugraph_ex", "--steps", "3", "--set", "batch_size=4",
                       "next_n=1"])
    assert b.models == ["tiny"] and b.modes == ["npugraph_ex"] and b.overrides == {"batch_size": 4, "next_n": 1}
    assert ac.case_names(b) == ["unmodified", "rewrite-npugraph_ex"]


@pytest.mark.parametrize("argv,msg", [
    (["--modes", "eager"], "--modes: unknown value(s) ['eager']; choose from ['ge_graph', 'npugraph_ex']"),
    (["--modes", ","], "--modes: give at least one of ['ge_graph', 'npugraph_ex']"),
    (["--models", "huge"], "--models: unknown value(s) ['huge']"),
    (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
    (["--warmup", "nan"], "--warmup must be an integer >= 1, got 'nan'"),
    (["--pool-size", "1000"], "--pool-size: option pool_size must be a multiple of 16, got 1000"),
    # --set keys and values are checked on the presets' configs before anything runs (--dry-run too)
    (["--dry-run", "--set", "nope=1"], "--set: config key 'nope': unknown key"),
    (["--dry-run", "--set", "pool_size=abc"], "--set: config key 'pool_size': unknown key (not a glm_moe_dsa model "
                                              "key nor a runner key) (preset 'tiny'; --set takes model / runner keys, "
                                              "the pool size is --pool-size)"),
    (["--dry-run", "--set", "next_n=abc"], "--set: config key 'next_n': must be a non-negative integer, got 'abc'"),
    (["--dry-run", "--set", "=3"], "--set expects KEY=VALUE, got '=3'"),
    (["--tol", "0"], "--tol must be > 0, got 0.0"),
    (["--set", "batch_size"], "--set expects KEY=VALUE, got 'batch_size'"),
    (["--kv-memory", "pinned"], "argument --kv-memory: invalid choice: 'pinned'"),
    (["--recipe", "/nonexistent/recipes"], "--recipe: '/nonexistent/recipes' is not a directory"),
    (["--cann-ops", "/nonexistent/custom_ops_lib.so"], "--cann-ops: '/nonexistent/custom_ops_lib.so' does not exist"),
])
def test_bad_arguments_are_rejected_with_a_reason(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        ac.parse_args(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_dry_run_prints_the_plan_of_cases_and_imports_no_npu_stack(capsys, tmp_path):
    had = "torch_npu" in sys.modules
    report = tmp_path / "r.json"
    assert ac.main(["--dry-run", "--models", "tiny,glm-5.2-78l", "--steps", "4", "--pool-size", "16384",
                    "--recipe", str(tmp_path), "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert ("device npu:0, 2 warmup + 4 measured steps (median), tol 0.02, pool_size 16384, side stream True, "
            "recipe compiler config, full KV in host memory (swapped), bookkeeping off") in out
    assert "  tiny: unmodified, rewrite-ge_graph, rewrite-npugraph_ex, recipe" in out
    assert "  glm-5.2-78l: unmodified, rewrite-ge_graph, rewrite-npugraph_ex, recipe" in out
    assert "GE IR DsaPlan, DsaServe, DsaInstall, GatherSelectionKvCache, ScatterNdUpdate" in out
    assert f"  report: {report}" in out and "environment: python=" in out
    assert not report.exists()  # a dry run writes nothing
    assert ("torch_npu" in sys.modules) == had


def test_without_torch_npu_every_case_is_reported_and_exit_code_is_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(ac, "environment", lambda: {"torch_npu": False, "torchair": False})
    report = tmp_path / "r.json"
    assert ac.main(["--models", "tiny", "--modes", "ge_graph", "--report", str(report)]) == 2
    assert "torch_npu is not importable; this check needs an Atlas A3" in capsys.readouterr().err
    doc = json.loads(report.read_text())
    assert doc["format"] == ac.REPORT_FORMAT == "offload_passes.atlas_check/3" and doc["summary"] == {"passed": 0, "failed": 0, "error": 0,
                                                                    "skipped": 2}
    assert [(c["preset"], c["case"], c["status"]) for c in doc["cases"]] == [
        ("tiny", "unmodified", "skipped"), ("tiny", "rewrite-ge_graph", "skipped")]


def test_result_table():
    rs = [ac.CaseResult("tiny", "rewrite-ge_graph", status="passed", ok=True, compile_s=12.0, step_ms_median=2.0,
                        max_abs_diff=1e-3, hit_rate=0.85, h2d_bytes_per_step=4096.0, rewritten=True),
          ac.CaseResult("glm-5.2-78l", "rewrite-npugraph_ex", status="error", reason="RuntimeError: boom"),
          ac.CaseResult("tiny", "recipe", status="failed", reason="max |diff| 0.5 > tol 0.02")]
    lines = ac.format_table(rs, 2e-2).splitlines()
    assert lines[0].split() == ["preset", "case", "compile", "s", "step", "ms", "max|diff|", "hit", "rate",
                                "H2D", "KiB/step", "result"]
    assert lines[2].split() == ["tiny", "rewrite-ge_graph", "12.0", "2.00", "0.001", "85.0%", "4.0", "PASS"]
    assert lines[3].endswith("ERROR: RuntimeError: boom")
    assert lines[4].endswith("FAIL (max |diff| 0.5 > tol 0.02)")


def test_finish_compares_every_step_against_the_reference():
    import torch

    r = ac.CaseResult("tiny", "rewrite-ge_graph", rewritten=True)
    ref = [torch.zeros(2, 3), torch.zeros(2, 3)]
    ac._finish(r, [torch.zeros(2, 3), torch.full((2, 3), 0.5)], ref, 2e-2)
    assert (r.status, r.ok, r.per_step_diff, r.max_abs_diff) == ("failed", False, [0.0, 0.5], 0.5)
    assert r.reason == "max |diff| 0.5 > tol 0.02"
    r2 = ac.CaseResult("tiny", "rewrite-ge_graph", rewritten=False, reason="graph not rewritten: pool_size")
    ac._finish(r2, ref, ref, 2e-2)
    assert (r2.status, r2.reason) == ("failed", "graph not rewritten: pool_size")


def test_hit_rate_from_counters():
    class State:
        def counters(self):
            return [{"total": {"hits": 3, "misses": 1}}, {"total": {"hits": 5, "misses": 1}}]

    assert ac._hit_rate(State()) == pytest.approx(0.8)
    assert ac._hit_rate(None) is None


def test_ge_ir_preflight_names_what_the_registry_lacks(torchair_core_double):
    """Against the ``_torchair`` TEST DOUBLE's IR table (the DSA ops, not the attention / scatter ops)."""
    status = ac.ge_ir_status(ac.GE_IR["ge_graph"])
    table = set(torchair_core_double.IR_TABLE)
    assert {"DsaPlan", "DsaServe", "DsaInstall", "GatherSelectionKvCache"} <= table
    assert status == {n: "SUCCESS" if n in table else "ERROR" for n in ac.GE_IR["ge_graph"]}
    args = ac.parse_args(["--models", "tiny"])
    cann = {"ops": {"dsa_plan": {}}, "missing_npu_kernels": [], "schema_mismatches": []}
    missing = dict(status, ScatterNdUpdate="ERROR")
    pre = ac.preflight(args, cann, missing)
    assert list(pre["missing"]) == ["rewrite-ge_graph"]
    (msg,) = pre["missing"]["rewrite-ge_graph"]
    assert msg.startswith("GE op definitions not registered with CANN: ") and "ScatterNdUpdate (ERROR)" in msg


_STANDIN_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[3])
from offload_passes.tools import atlas_check as ac
args = ac.parse_args(["--models", "tiny", "--modes", "npugraph_ex", "--cann-ops", sys.argv[1],
                      "--report", sys.argv[2]])
cann = ac.load_cann(args)
pre = ac.preflight(args, cann, None)
res = [ac.CaseResult("tiny", c, status="skipped", reason="; ".join(pre["missing"].get(c, ["cpu"])))
       for c in ac.case_names(args)]
ac.write_report(args.report, args, ac.environment(), pre, res)
print(json.dumps({"loaded": cann.get("loaded"), "source": cann.get("source"), "missing": pre["missing"]}))
"""


def test_cann_library_first_then_preflight_and_report_with_the_cpp_standin(tmp_path):
    """CANN's library (C++ TEST DOUBLE: schemas, Meta, throwing NPU kernels) loaded through --cann-ops in a
    fresh process: every op then has an NPU kernel, nothing is reported missing, and the report holds
    the library status."""
    sys.path.insert(0, str(ROOT / "tests" / "testdoubles"))
    try:
        import cann_standin
    finally:
        sys.path.pop(0)
    lib = cann_standin.build()
    report = tmp_path / "r.json"
    out = subprocess.run([sys.executable, "-c", _STANDIN_SCRIPT, str(lib), str(report), str(ROOT)],
                         capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "OFFLOAD_PASSES_CANN_OPS_LIB": "none"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"loaded": True, "source": "explicit", "missing": {}}
    doc = json.loads(report.read_text())
    assert doc["preflight"]["cann"]["path"] == str(Path(lib).resolve())
    assert doc["preflight"]["cann"]["missing_npu_kernels"] == []
    assert [c["case"] for c in doc["cases"]] == ["unmodified", "rewrite-npugraph_ex"]


def test_without_cann_every_op_is_named_missing():
    """This process has no CANN library: the preflight names all seven ops and how to load them."""
    args = ac.parse_args(["--models", "tiny", "--modes", "npugraph_ex"])
    cann = ac.load_cann(args)
    assert cann["loaded"] is False and len(cann["missing_npu_kernels"]) == 7
    pre = ac.preflight(args, cann, None)
    assert set(pre["missing"]) == {"unmodified", "rewrite-npugraph_ex"}
    (msg,) = pre["missing"]["rewrite-npugraph_ex"]
    assert msg.startswith("no NPU kernel for custom::") and "custom::dsa_install" in msg
    assert "--cann-ops PATH or OFFLOAD_PASSES_CANN_OPS_LIB" in msg

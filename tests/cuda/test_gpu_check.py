"""benchmarks/gpu_check.py (the GPU timings) on a CPU machine: it exits 2 with one line; its harness's pure parts
(ratios, timing rows, the table, the section budget) give exact values; every section runs in a process of its
own, so a section that crashes or passes its limit leaves one error row and the next section runs;
``--dry-run`` runs every section's process (every timing cell "no GPU", the capacity arithmetic computed) and
``--merge`` keeps the sections it does not rerun; ``scripts/lent_gpu.sh`` names every file with device tests.
The correctness checks the GPU runs are the device tests (``tests/cuda/test_device_*.py`` and the other tests
marked ``device``)."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
ENV = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}


@pytest.fixture(scope="module")
def gc():
    import _device  # noqa: F401  (benchmarks/ on sys.path: the script imports its section modules by name)

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def _run(args, timeout):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=ENV)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit (this machine has CUDA)")
def test_without_cuda_exits_2_with_one_line():
    p = _run(["--sections", "serve"], 300)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device"), p.stderr
    assert p.stdout == ""


def test_bad_arguments_exit_2(gc, capsys):
    assert gc.main(["--sections", "serve,nope"]) == 2
    assert capsys.readouterr().err.strip() == (
        "gpu_check: --sections: unknown ['nope']; known: ['serve', 'kernels', 'graphs', 'capacity']")
    assert gc.main(["--steps", "0"]) == 2
    assert "--steps, --reps and --capacity-steps must be >= 1, got 0, 20 and 4" in capsys.readouterr().err
    assert gc.main(["--hbm-gib", "0"]) == 2
    assert "--hbm-gib and --host-gib must be > 0, got 0.0 and 64.0" in capsys.readouterr().err
    assert gc.main(["--capacity-layers", "6"]) == 2
    assert capsys.readouterr().err.strip() == (
        "gpu_check: --capacity-layers: StackGeo: layers must be a positive multiple of group=4, got 6")


def test_ratios_table_and_timing_rows():
    import _harness as gc

    assert gc.ratio(1.0, 4.0) == 0.25 and gc.ratio(None, 1.0) is None and gc.ratio(1.0, 0) is None
    assert gc.gbps(2 * 10 ** 9, 0.5) == 4.0 and gc.gbps(10, None) is None
    t = gc.format_table([{"a": 1, "b": 0.123456}, {"a": "x", "b": None}, {"b": 12345.6}], ("a", "b"))
    assert t.splitlines() == ["| a | b |", "|---|---|", "| 1 | 0.123 |", "| x | - |", "| - | 12346 |"]
    serve, ceiling = gc.Timing(0.5, 174e-6, "graph replay"), gc.Timing(0.4, 20e-6, "graph replay")
    assert gc.timing_row("serve", "x", serve, ceiling, 0.8, nbytes=10 ** 9) == {
        "section": "serve", "check": "x", "value": 0.8, "goal": 0.8, "note": "2 GB/s vs 2.5 GB/s (graph replay)",
        "ok": None, "host_us": pytest.approx(174.0)}
    k = gc.timing_row("kernels", "y", gc.Timing(0.002, 3e-5, "queued launches"))
    assert (k["value"], k["host_us"], k["note"]) == (2.0, pytest.approx(30.0), "ms on the device (queued launches)")
    assert gc.timing_row("kernels", "y", None, dry=True)["value"] == gc.NO_GPU


def test_rows_and_failures():
    import _harness as gc

    res = {"equal": [gc.row("equal", "chain", 1, 1, "3 steps", ok=True),
                     gc.row("equal", "gather", 0, 1, "step 0", ok=False)],
           "serve": {"error": "TimeoutError: section serve passed its limit of 45 s"},
           "capacity": [gc.row("capacity", "rows", 2.9)], "unknown": [gc.row("x", "y")]}
    rows = gc.summary_rows(res, ["equal", "serve", "kernels", "capacity"])
    assert [(r["section"], r["check"]) for r in rows] == [("equal", "chain"), ("equal", "gather"),
                                                          ("serve", "section serve"), ("capacity", "rows")]
    assert rows[2]["note"] == "TimeoutError: section serve passed its limit of 45 s" and rows[2]["ok"] is False
    assert [r["check"] for r in gc.failed(rows)] == ["gather", "section serve"]


def test_sections_fit_five_minutes(gc):
    assert list(gc.SECTIONS) == ["serve", "kernels", "graphs", "capacity"]
    assert sum(s.limit_s for s in gc.SECTIONS.values()) == 280 <= 5 * 60
    assert sum(s.estimate_s for s in gc.SECTIONS.values()) == 190
    assert all(0 < s.estimate_s <= s.limit_s and s.why and s.dry_limit_s > 0 for s in gc.SECTIONS.values())
    assert set(gc.RUNNERS) == set(gc.SECTIONS)
    assert gc.gpu_ops.BATCHES == (1, 32, 128) and gc.gpu_capacity.CAPACITY_CONTEXTS == (65536, 131072)


def _args(gc, **kw):
    a = gc.parse(["--dry-run", *[x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]])
    return a


def test_a_section_that_crashes_or_hangs_leaves_one_row_and_the_next_runs(gc, monkeypatch):
    """Each section is its own process: one that dies (here: abort(), as a fatal CUDA error would end it) or passes
    its limit gives one error row; the sections after it still run and report."""
    args = _args(gc)
    real = gc.worker_argv

    def fake(name, a):
        if name == "serve":
            return ["-c", "import os, sys; print('CUDA error: an illegal memory access', file=sys.stderr); os.abort()"]
        if name == "graphs":
            return ["-c", "import time; time.sleep(60)"]
        return real(name, a)

    monkeypatch.setattr(gc, "worker_argv", fake)
    monkeypatch.setitem(gc.SECTIONS, "graphs", gc.SECTIONS["graphs"]._replace(dry_limit_s=3))
    res = gc.run_sections(["serve", "kernels", "graphs"], args, {})
    assert res["serve"] == {"error": "the section's process exited with -6: CUDA error: an illegal memory access"}
    assert res["graphs"] == {"error": "TimeoutError: section graphs passed its limit of 3 s"}
    assert 3 <= res["section_s"]["graphs"] < 30
    assert [r["check"] for r in res["kernels"]][:2] == ["dsa_plan B=1", "install fifo md=1 B=1"]
    assert res["device"] == "cpu (dry run, Triton interpreter)" and res["torch"] == torch.__version__


def test_worker_arguments_pass_the_options_on(gc):
    a = gc.parse(["--dry-run", "--steps", "3", "--hbm-gib", "12", "--capacity-layers", "12"])
    argv = gc.worker_argv("capacity", a)
    assert argv[0] == str(SCRIPT) and argv[1:3] == ["--worker", "capacity"] and argv[-1] == "--dry-run"
    pairs = dict(zip(argv[3:-1:2], argv[4:-1:2]))
    assert pairs == {"--steps": "3", "--reps": "20", "--hbm-gib": "12.0", "--host-gib": "64.0",
                     "--capacity-layers": "12", "--capacity-steps": "4"}


def test_dry_run_runs_every_section_and_marks_timings_no_gpu(tmp_path):
    """``--dry-run`` on the CPU: every section's process runs and reports; every timing cell says "no GPU"; the
    capacity arithmetic is there; no row is a failure."""
    out = tmp_path / "dry.json"
    p = _run(["--dry-run", "--json", str(out)], 600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert list(res["section_s"]) == ["serve", "kernels", "graphs", "capacity"]
    rows = [r for name in res["section_s"] for r in res[name]]
    by = {r["check"]: r for r in rows}
    assert all(r["ok"] is None for r in rows)
    no_gpu = [r["check"] for r in rows if r["value"] == "no GPU"]
    assert len(no_gpu) == 9 + 15 + 2 + 6 == len(rows) - 6
    assert "serve misses random B=128 vs host link" in no_gpu and "install second_chance md=0 B=32" in no_gpu
    assert "tokens/s offloaded @ 131072" in no_gpu
    assert "hf-glm5-attn (HF, host KV, 16K): replay vs op by op (ms/step ratio)" in no_gpu
    assert by["largest batch, offloaded @ 131072"]["value"] == 56 and by["largest batch, dense @ 131072"]["value"] == 19
    assert "| serve | serve hits B=128 vs device copy | no GPU | 0.8 | no GPU | no GPU |" in p.stdout


def test_merge_keeps_the_sections_not_rerun(tmp_path):
    out = tmp_path / "g.json"
    out.write_text(json.dumps({"serve": [{"section": "serve", "check": "kept", "value": 1, "goal": 1, "note": "",
                                          "ok": None}], "section_s": {"serve": 1.0}}))
    p = _run(["--dry-run", "--sections", "kernels", "--merge", "--json", str(out)], 300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["serve"][0]["check"] == "kept" and set(res["section_s"]) == {"serve", "kernels"}
    assert "| serve | kept | 1 | 1 | - |  |" in p.stdout and "| kernels | dsa_plan B=32 | no GPU |" in p.stdout


def _lent(*args):
    return subprocess.run(["bash", str(ROOT / "scripts" / "lent_gpu.sh"), *args], capture_output=True, text=True,
                          timeout=60)


def test_lent_gpu_runs_every_file_with_device_tests():
    """scripts/lent_gpu.sh's groups name exactly the test files that hold device tests, each once."""
    p = _lent("--help")
    assert p.returncode == 0 and p.stdout.startswith("usage: bash scripts/lent_gpu.sh fetch | run [gpu_check args]")
    listed = p.stdout.split("device test groups (group, limit in seconds, files):\n", 1)[1].splitlines()
    groups = {line.split()[0]: (int(line.split()[1]), line.split()[2:]) for line in listed}
    assert set(groups) == {"kernels", "models"} and sum(limit for limit, _ in groups.values()) == 300
    files = [f for _, fs in groups.values() for f in fs]
    marked = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests" / "cuda").glob("test_*.py")
                    if re.search(r"^(@pytest\.mark\.device$|pytestmark = pytest\.mark\.device$)", f.read_text(), re.M))
    assert sorted(files) == marked and len(set(files)) == len(files)


def test_lent_gpu_refuses_an_unknown_mode():
    p = _lent("sections")
    assert p.returncode == 2 and p.stderr.startswith("usage: bash scripts/lent_gpu.sh fetch")

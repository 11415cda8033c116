"""benchmarks/gpu_check.py on a CPU machine: it exits 2 with one line; its pure parts (the capacity arithmetic,
ratios, timing rows, the table, the section budget) give exact values; every section runs in a process of its
own, so a section that crashes or passes its limit leaves one error row and the next section runs;
``--dry-run`` runs every section's correctness part (Triton's interpreter, the models on the CPU) and ``--merge``
keeps the sections it does not rerun."""
from __future__ import annotations

import importlib.util
import json
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
        "gpu_check: --sections: unknown ['nope']; known: ['equal', 'models', 'serve', 'kernels', 'graphs', "
        "'capacity']")
    assert gc.main(["--steps", "0"]) == 2
    assert "--steps, --reps and --capacity-steps must be >= 1, got 0, 20 and 4" in capsys.readouterr().err
    assert gc.main(["--hbm-gib", "0"]) == 2
    assert "--hbm-gib and --host-gib must be > 0, got 0.0 and 64.0" in capsys.readouterr().err
    assert gc.main(["--capacity-layers", "6"]) == 2
    assert capsys.readouterr().err.strip() == (
        "gpu_check: --capacity-layers: StackGeo: layers must be a positive multiple of group=4, got 6")


def test_stack_bytes_and_the_largest_batches(gc):
    """GLM-5's per-layer shapes, 8 layers in 2 IndexShare groups, at 64K + 20 tokens: the bytes per row by the
    formula written out here, and the batches that fit 24 GiB of HBM and 64 GiB of pinned host memory."""
    geo, T = gc.GLM5_STACK, 65536 + 20
    assert (geo.layers, geo.group, geo.groups, geo.row) == (8, 4, 2, 1152)
    b = gc.stack_bytes(geo, T)
    transient = 2 * (T * (32 * 2 + 12) + 2048 * (1152 + 64 * 8 + 16) + 2 * 8 * 64 * 512 * 2)
    idx = 2 * T * 128 * 2
    assert b["transient"] == transient
    assert b["dense"] == 8 * T * 1152 + idx + transient
    assert b["offload"] == 8 * (8192 + 2048) * 1152 + 2 * (8192 * 4 + T * 4 + 512 * 4) + idx + transient
    assert b["host"] == 8 * T * 1152
    hbm, host = 24 * 2 ** 30, 64 * 2 ** 30
    cap = gc.capacity_batches(geo, T, hbm, host)
    assert cap["dense"] == hbm // b["dense"] == 39
    assert cap["offload_by_hbm"] == hbm // b["offload"] == 174 and cap["offload_by_host"] == host // b["host"] == 113
    assert cap["offload"] == 113 and cap["binds"] == "host"
    # with host memory to spare the device binds, and the offload still holds 4x the rows at 128K
    big = gc.capacity_batches(geo, 131072 + 20, hbm, 1024 * 2 ** 30)
    assert big["binds"] == "hbm" and big["offload"] == big["offload_by_hbm"] > 4 * big["dense"]
    assert gc.capacity_batches(geo, T, 2 ** 20, host)["dense"] == 0
    with pytest.raises(ValueError, match="layers must be a positive multiple of group=4, got 0"):
        gc.StackGeo(layers=0)


def test_ratios_table_and_timing_rows(gc):
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


def test_rows_and_failures(gc):
    res = {"equal": [gc.row("equal", "chain", 1, 1, "3 steps", ok=True),
                     gc.row("equal", "gather", 0, 1, "step 0", ok=False)],
           "serve": {"error": "TimeoutError: section serve passed its limit of 45 s"},
           "capacity": [gc.row("capacity", "rows", 2.9)], "unknown": [gc.row("x", "y")]}
    rows = gc.summary_rows(res)
    assert [(r["section"], r["check"]) for r in rows] == [("equal", "chain"), ("equal", "gather"),
                                                          ("serve", "section serve"), ("capacity", "rows")]
    assert rows[2]["note"] == "TimeoutError: section serve passed its limit of 45 s" and rows[2]["ok"] is False
    assert [r["check"] for r in gc.failed(rows)] == ["gather", "section serve"]


def test_sections_fit_eight_minutes(gc):
    assert list(gc.SECTIONS) == ["equal", "models", "serve", "kernels", "graphs", "capacity"]
    assert sum(s.limit_s for s in gc.SECTIONS.values()) == 470 <= 8 * 60
    assert sum(s.estimate_s for s in gc.SECTIONS.values()) == 315
    assert all(0 < s.estimate_s <= s.limit_s and s.why for s in gc.SECTIONS.values())
    assert set(gc.RUNNERS) == set(gc.SECTIONS) == set(gc.DRY_LIMITS)
    assert gc.BATCHES == (1, 32, 128) and gc.CAPACITY_CONTEXTS == (65536, 131072)


def _args(gc, **kw):
    a = gc.parse(["--dry-run", *[x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]])
    return a


def test_a_section_that_crashes_or_hangs_leaves_one_row_and_the_next_runs(gc, monkeypatch):
    """Each section is its own process: one that dies (here: abort(), as a fatal CUDA error would end it) or passes
    its limit gives one error row; the sections after it still run and report."""
    args = _args(gc)
    real = gc.worker_argv

    def fake(name, out, a):
        if name == "serve":
            return ["-c", "import os, sys; print('CUDA error: an illegal memory access', file=sys.stderr); os.abort()"]
        if name == "graphs":
            return ["-c", "import time; time.sleep(60)"]
        return real(name, out, a)

    monkeypatch.setattr(gc, "worker_argv", fake)
    monkeypatch.setitem(gc.DRY_LIMITS, "graphs", 3)
    res = gc.run_sections(["serve", "kernels", "graphs"], args, {})
    assert res["serve"] == {"error": "the section's process exited with -6: CUDA error: an illegal memory access"}
    assert res["graphs"] == {"error": "TimeoutError: section graphs passed its limit of 3 s"}
    assert 3 <= res["section_s"]["graphs"] < 30
    assert [r["check"] for r in res["kernels"]][:2] == ["dsa_plan B=1", "install fifo md=1 B=1"]
    assert res["device"] == "cpu (dry run, Triton interpreter)" and res["torch"] == torch.__version__


def test_worker_arguments_pass_the_options_on(gc):
    a = gc.parse(["--dry-run", "--steps", "3", "--hbm-gib", "12", "--capacity-layers", "12"])
    argv = gc.worker_argv("capacity", "/tmp/x.json", a)
    assert argv[1:5] == ["--worker", "capacity", "--out", "/tmp/x.json"] and argv[-1] == "--dry-run"
    pairs = dict(zip(argv[5:-1:2], argv[6:-1:2]))
    assert pairs == {"--steps": "3", "--reps": "20", "--hbm-gib": "12.0", "--host-gib": "64.0",
                     "--capacity-layers": "12", "--capacity-steps": "4"}


def test_dry_run_runs_every_correctness_part_and_marks_timings_no_gpu(tmp_path, triton_interpreted):
    """``--dry-run`` on the CPU: the kernel chains (small and GLM-5 geometry, FIFO and second chance), the gather,
    both host-KV writes and the serve plans equal the CPU twins under Triton's interpreter; the tiny model and
    hf-tiny with host KV in the cuda mode equal the unmodified ones (and hf-tiny's device-KV run); the offloaded
    attention stack equals the dense one; every timing cell says "no GPU"; the capacity arithmetic is there."""
    out = tmp_path / "dry.json"
    p = _run(["--dry-run", "--json", str(out)], 2400)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert list(res["section_s"]) == ["equal", "models", "serve", "kernels", "graphs", "capacity"]
    rows = [r for name in res["section_s"] for r in res[name]]
    by = {r["check"]: r for r in rows}
    verdicts = {r["check"]: r["value"] for r in rows if r["ok"] is not None}
    assert verdicts == {
        "chain small (FIFO) == CPU twins": 1, "chain small (second chance) == CPU twins": 1,
        "chain GLM-5 (K 2048, pool 8192, 512 + 64) (FIFO) == CPU twins": 1,
        "chain GLM-5 (K 2048, pool 8192, 512 + 64) (second chance) == CPU twins": 1,
        "gather K=16 bsz=4 == CPU twin": 1, "gather K=64 bsz=1 == CPU twin": 1,
        "host-KV write (pinned) == CPU kernel": 1, "HF host-KV write (pinned) == index_copy_": 1,
        "tiny (host tensors, interpreter) == unmodified": 0.0,
        "tiny (side-stream delay, host tensors, interpreter) == unmodified": 0.0,
        "hf-tiny host KV (host tensors) == device KV, compiled": 0.0,
        "hf-tiny host KV (host tensors) vs unmodified (max diff / max logit)": 0.0,
        "hf-tiny host KV, side-stream delay == no delay": 0.0,
        "serve hits == CPU twin": 1, "serve misses sequential == CPU twin": 1, "serve misses random == CPU twin": 1,
        "attention stack (8 layers): offloaded == dense": 1,
        "tiny (recipe, host KV): replay == op by op (max abs diff)": 0.0,
        "tiny (recipe, host KV): decode graph capture problems": 0,
        "hf-tiny (HF, host KV, 128): replay == op by op (max abs diff)": 0.0,
        "hf-tiny (HF, host KV, 128): decode graph capture problems": 0,
    }
    assert all(r["ok"] for r in rows if r["ok"] is not None)
    no_gpu = [r["check"] for r in rows if r["value"] == "no GPU"]
    assert len(no_gpu) == 1 + 1 + 9 + 15 + 2 + 6
    assert "serve misses random B=128 vs host link" in no_gpu and "install second_chance md=0 B=32" in no_gpu
    assert "tokens/s offloaded @ 131072" in no_gpu and "hf-tiny (HF, host KV, 128): replay vs op by op (ms/step ratio)" in no_gpu
    assert by["largest batch, offloaded @ 131072"]["value"] == 56 and by["largest batch, dense @ 131072"]["value"] == 19
    assert "| serve | serve hits B=128 vs device copy | no GPU | 0.8 | no GPU | no GPU |" in p.stdout


def test_merge_keeps_the_sections_not_rerun(tmp_path):
    out = tmp_path / "g.json"
    out.write_text(json.dumps({"equal": [{"section": "equal", "check": "kept", "value": 1, "goal": 1, "note": "",
                                          "ok": True}], "section_s": {"equal": 1.0}}))
    p = _run(["--dry-run", "--sections", "kernels", "--merge", "--json", str(out)], 300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["equal"][0]["check"] == "kept" and set(res["section_s"]) == {"equal", "kernels"}
    assert "| equal | kept | 1 | 1 | - |  |" in p.stdout and "| kernels | dsa_plan B=32 | no GPU |" in p.stdout

"""benchmarks/gpu_check.py on a CPU machine: it exits 2 with one line; its pure parts (byte accounting,
ratios, the table, the section budget) give exact values; ``--dry-run`` runs every section's correctness
part under Triton's interpreter and ``--merge`` keeps the sections it does not rerun."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit (this machine has CUDA)")
def test_without_cuda_exits_2_with_one_line():
    p = subprocess.run([sys.executable, str(SCRIPT), "--sections", "serve"], capture_output=True, text=True,
                       timeout=300, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device"), p.stderr
    assert p.stdout == ""


def test_bad_arguments_exit_2(gc, capsys):
    assert gc.main(["--sections", "serve,nope"]) == 2
    assert capsys.readouterr().err.strip() == (
        "gpu_check: --sections: unknown ['nope']; known: ['equal', 'models', 'serve', 'kernels', 'decode', 'graphs']")
    assert gc.main(["--steps", "0"]) == 2
    assert "--steps and --reps must be >= 1, got 0 and 20" in capsys.readouterr().err


def test_byte_accounting_glm5_attention_at_64k(gc):
    # GLM-5 attention dims: latent 512, rope 64, indexer head 128; 1 layer with an indexer
    dense = gc.dense_kv_bytes(layers=1, context=65536, latent=512, rope=64, indexer_dim=128, indexer_layers=1)
    assert dense == {"latent_rope": 65536 * 576 * 2, "indexer": 65536 * 128 * 2, "total": 65536 * 704 * 2}
    off = gc.offload_kv_bytes(layers=1, context=65536, latent=512, rope=64, indexer_dim=128, indexer_layers=1,
                              pool=8192, topk=2048)
    assert off["pool"] == 8192 * 576 * 2 and off["selection"] == 2048 * 576 * 2
    assert off["indexer"] == dense["indexer"] and off["host"] == dense["latent_rope"]
    assert off["total"] == off["pool"] + off["selection"] + off["indexer"]
    # the goal (<= 0.3x the dense KV at 64K with an 8K pool): every layer with its own indexer
    # misses it (the indexer keys stay on the device, in full) ...
    frac = gc.ratio(off["total"], dense["total"])
    assert frac == pytest.approx((8192 * 576 + 2048 * 576 + 65536 * 128) / (65536 * 704))
    assert frac > gc.GOALS["kv_fraction_64k_8k"]
    # ... four layers sharing one indexer (GLM-5's IndexShare groups) meet it
    d4 = gc.dense_kv_bytes(layers=4, context=65536, latent=512, rope=64, indexer_dim=128, indexer_layers=1)
    o4 = gc.offload_kv_bytes(layers=4, context=65536, latent=512, rope=64, indexer_dim=128, indexer_layers=1,
                             pool=8192, topk=2048)
    frac4 = gc.ratio(o4["total"], d4["total"])
    assert frac4 == pytest.approx((4 * 10240 * 576 + 65536 * 128) / (4 * 65536 * 576 + 65536 * 128))
    assert frac4 <= gc.GOALS["kv_fraction_64k_8k"]
    assert gc.host_bytes_per_step(1000, 512, 64) == 1000 * 576 * 2


def test_ratios_and_table(gc):
    assert gc.ratio(1.0, 4.0) == 0.25 and gc.ratio(None, 1.0) is None and gc.ratio(1.0, 0) is None
    assert gc.gbps(2 * 10 ** 9, 0.5) == 4.0 and gc.gbps(10, None) is None
    t = gc.format_table([{"a": 1, "b": 0.123456}, {"a": "x", "b": None}, {"b": 12345.6}], ("a", "b"))
    assert t.splitlines() == ["| a | b |", "|---|---|", "| 1 | 0.123 |", "| x | - |", "| - | 12346 |"]


def test_sections_fit_eight_minutes(gc):
    assert list(gc.SECTIONS) == ["equal", "models", "serve", "kernels", "decode", "graphs"]
    assert sum(s.limit_s for s in gc.SECTIONS.values()) == 470 <= 8 * 60
    assert sum(s.estimate_s for s in gc.SECTIONS.values()) == 315
    assert all(0 < s.estimate_s <= s.limit_s and s.why for s in gc.SECTIONS.values())
    assert set(gc.RUNNERS) == set(gc.SECTIONS) == set(gc.DRY_LIMITS)


def test_device_kv_fraction_of_hf_glm5_attn(gc):
    # 2 layers of 512 + 64, one indexer layer of 128, top-k 2048 (models/configs/hf-glm5-attn.yaml)
    assert gc.glm5_attn_kv_fraction(65536, 8192) == pytest.approx(
        (2 * (8192 + 2048) * 576 + 65536 * 128) / (2 * 65536 * 576 + 65536 * 128))
    assert gc.glm5_attn_kv_fraction(65536, 8192) == pytest.approx(0.24063, abs=1e-5)
    assert gc.glm5_attn_kv_fraction(16384, 16384) > 1  # a pool as large as the context: more than dense


def test_rows_timings_and_failures(gc):
    assert gc.timing_row("serve", "x", 0.5, 0.4, 0.8, nbytes=10 ** 9) == {
        "section": "serve", "check": "x", "value": 0.8, "goal": 0.8, "note": "2 GB/s vs 2.5 GB/s", "ok": None}
    assert gc.timing_row("kernels", "y", 0.002)["value"] == 2.0 and gc.timing_row("kernels", "y", 0.002)["note"] == "ms"
    assert gc.timing_row("kernels", "y", 0.002, dry=True)["value"] == gc.NO_GPU
    res = {"equal": [gc.row("equal", "chain", 1, 1, "3 steps", ok=True),
                     gc.row("equal", "gather", 0, 1, "step 0", ok=False)],
           "serve": {"error": "TimeoutError: section serve passed its limit of 40 s"},
           "decode": [gc.row("decode", "fraction", 0.24, 0.3)], "unknown": [gc.row("x", "y")]}
    rows = gc.summary_rows(res)
    assert [(r["section"], r["check"]) for r in rows] == [("equal", "chain"), ("equal", "gather"),
                                                          ("serve", "section serve"), ("decode", "fraction")]
    assert rows[2]["note"] == "TimeoutError: section serve passed its limit of 40 s" and rows[2]["ok"] is False
    assert [r["check"] for r in gc.failed(rows)] == ["gather", "section serve"]


def _run(args, tmp_path, timeout):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})


def test_dry_run_runs_every_correctness_part_and_marks_timings_no_gpu(tmp_path, triton_interpreted):
    """``--dry-run`` on the CPU: the kernel chains (small and GLM-5 geometry, FIFO and second chance), the
    gather, the host-KV write and the serve plans equal the CPU twins under Triton's interpreter; the tiny and
    hf-tiny models in the cuda mode equal the unmodified ones; every timing cell says "no GPU". A fresh
    process: TRITON_INTERPRET must be set before triton is imported."""
    import json

    out = tmp_path / "dry.json"
    p = _run(["--dry-run", "--json", str(out)], tmp_path, 1500)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = [r for name in res["section_s"] for r in res[name]]
    assert list(res["section_s"]) == ["equal", "models", "serve", "kernels", "decode", "graphs"]
    by = {r["check"]: r for r in rows}
    verdicts = {r["check"]: r["value"] for r in rows if r["ok"] is not None}
    assert verdicts == {
        "chain small (FIFO) == CPU twins": 1, "chain small (second chance) == CPU twins": 1,
        "chain GLM-5 (K 2048, pool 8192, 512 + 64) (FIFO) == CPU twins": 1,
        "chain GLM-5 (K 2048, pool 8192, 512 + 64) (second chance) == CPU twins": 1,
        "gather K=16 bsz=4 == CPU twin": 1, "gather K=64 bsz=1 == CPU twin": 1,
        "host-KV write (pinned) == CPU kernel": 1,
        "tiny (host tensors, interpreter) == unmodified": 0.0,
        "tiny (side-stream delay, host tensors, interpreter) == unmodified": 0.0,
        "hf-tiny (host tensors, interpreter) == unmodified": 0.0,
        "hf-tiny (side-stream delay, host tensors, interpreter) == unmodified": 0.0,
        "serve hits == CPU twin": 1, "serve misses sequential == CPU twin": 1, "serve misses random == CPU twin": 1,
    }
    assert all(r["ok"] for r in rows if r["ok"] is not None)
    no_gpu = [r["check"] for r in rows if r["value"] == "no GPU"]
    assert len(no_gpu) == 22 and "CUDA graph replay vs eager (ms/step ratio)" in no_gpu
    assert "serve hits B=128 vs device copy" in no_gpu and "decode offload pool 16384 @ 65536 ms/step" in no_gpu
    assert by["device KV fraction @ 65536 pool 8192 (arithmetic)"]["value"] == pytest.approx(0.24063, abs=1e-5)
    assert "| serve | serve hits B=128 vs device copy | no GPU | 0.8 | no GPU |" in p.stdout


def test_merge_keeps_the_sections_not_rerun(tmp_path):
    import json

    out = tmp_path / "g.json"
    out.write_text(json.dumps({"equal": [{"section": "equal", "check": "kept", "value": 1, "goal": 1, "note": "",
                                          "ok": True}], "section_s": {"equal": 1.0}}))
    p = _run(["--dry-run", "--sections", "kernels", "--merge", "--json", str(out)], tmp_path, 300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["equal"][0]["check"] == "kept" and set(res["section_s"]) == {"equal", "kernels"}
    assert "| equal | kept | 1 | 1 |  |" in p.stdout and "| kernels | dsa_plan B=32 ms | no GPU |" in p.stdout

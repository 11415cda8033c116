"""benchmarks/gpu_check.py on a CPU machine: it exits 2 with one line; its pure parts (byte accounting,
ratios, the table) give exact values."""
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
    p = subprocess.run([sys.executable, str(SCRIPT), "--sections", "ops"], capture_output=True, text=True,
                       timeout=300, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device"), p.stderr
    assert p.stdout == ""


def test_bad_arguments_exit_2(gc, capsys):
    assert gc.main(["--sections", "ops,nope"]) == 2
    assert capsys.readouterr().err.strip() == (
        "gpu_check: --sections: unknown ['nope']; known: ['correctness', 'ops', 'decode']")
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


def test_summary_rows_carry_goals_and_errors(gc):
    res = {"correctness": [{"model": "tiny", "max_abs_diff": 0.0, "steps": 4, "fallback_calls": 3},
                           {"model": "small", "error": "RuntimeError: boom"}],
           "ops": [{"what": "serve hits vs D2D copy", "ratio": 0.9, "goal": 0.8, "gbps": 2000.0, "ref_gbps": 2200.0}],
           "decode": [{"variant": "offload pool 8192", "context": 65536, "ms_per_step": 12.5, "goal": 0.3,
                       "device_kv_mib": 30.0, "host_mib_per_step": 1.5, "kv_fraction": 0.2}]}
    rows = gc.summary_rows(res)
    assert [r["check"] for r in rows] == ["correctness tiny", "correctness small", "serve hits vs D2D copy",
                                          "decode offload pool 8192 @ 65536"]
    assert rows[0]["value"] == 0.0 and rows[0]["goal"] == 0 and rows[0]["note"] == "4 steps, fallback calls 3"
    assert rows[1]["note"] == "RuntimeError: boom" and rows[1]["value"] is None
    assert rows[2]["note"] == "2000 GB/s vs 2200 GB/s"
    assert rows[3]["note"] == "device KV 30 MiB, host read/step 1.5 MiB, KV fraction 0.2"


def test_dry_run_runs_every_correctness_part_and_marks_timings_no_gpu(tmp_path, triton_interpreted):
    """``--dry-run`` on the CPU: the kernel chains (FIFO and second chance) and the host-KV write equal the CPU
    twins under Triton's interpreter, the tiny model in the cuda mode equals the unmodified one; every
    timing cell says "no GPU". A fresh process: TRITON_INTERPRET must be set before triton is imported."""
    import json

    out = tmp_path / "dry.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--json", str(out)], capture_output=True,
                       text=True, timeout=900, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": "/usr/bin:/bin",
                                                    "HOME": str(Path.home())})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    by = {r["check"]: r for r in rows}
    for check in ("ops chain (FIFO) == CPU twins", "ops chain (second chance) == CPU twins",
                  "host-KV write == CPU kernel"):
        assert by[check]["value"] == 1, by[check]
    assert by["correctness tiny (cuda mode, host tensors)"]["value"] == 0
    timing = [r for r in rows if r["goal"] is None]
    assert len(timing) == 6 and all(r["value"] == r["note"] == "no GPU" for r in timing)
    assert "| serve hits B=128 vs D2D | no GPU | - | no GPU |" in p.stdout

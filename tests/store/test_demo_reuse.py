"""``offload-demo --serve --workload multiturn --store ...``: the serving demo reloads stored prefixes, reports
them under ``reuse`` in ``--json``, and every step of the reloaded lanes equals the unmodified model recomputing
the same prefixes with the same boundaries; a second run (a new process's store: no RAM) reloads from disk and
writes through to a real Mooncake Store. Bad ``--store`` values are one line and exit 2, before any model."""
from __future__ import annotations

import json

import pytest

from offload_passes.apps import demo
from offload_passes.store.mooncake_local import free_port


def _run(capsys, store: str, steps: int) -> dict:
    rc = demo.main(["--serve", "--workload", "multiturn", "--store", store, "--steps", str(steps), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    return out


def test_demo_serves_multiturn_with_a_store(tmp_path, capsys, mooncake):
    disk = tmp_path / "kv"
    first = _run(capsys, f"ram=64MiB,disk={disk}:64MiB", 20)
    r = first["reuse"]
    assert first["workload"] == "multiturn" and first["within_tolerance"] is True and first["max_abs_diff"] == 0.0
    assert r["tiers"] == ["ram", "disk"] and r["chunk_tokens"] == 16
    assert 0 < r["prefill_tokens_computed"] < r["prefill_tokens_total"], r
    assert r["chunks_loaded"].get("ram", 0) > 0 and r["admitted_with_hit"] > 0, r
    assert r["chunks_stored"]["ram"] == r["chunks_stored"]["disk"] > 0, r
    assert r["chunks_rejected"] == 0 and r["tier_faults"] == {} and r["max_abs_diff"] == 0.0, r
    shared = f"{mooncake.master_addr}@{mooncake.metadata_url.split('//')[1].split('/')[0]}"
    again = _run(capsys, f"disk={disk}:64MiB,mooncake={shared}", 40)  # the same conversations, further
    r2 = again["reuse"]
    assert r2["tiers"] == ["disk", "mooncake"] and again["max_abs_diff"] == 0.0 and r2["max_abs_diff"] == 0.0
    assert r2["chunks_loaded"].get("disk", 0) > 0 and r2["chunks_stored"].get("mooncake", 0) > 0, r2
    # what the first run stored is reloaded (its first turns too): a smaller share of the prompts is computed
    assert r2["prefill_tokens_computed"] * r["prefill_tokens_total"] < \
        r["prefill_tokens_computed"] * r2["prefill_tokens_total"], (r, r2)
    assert r2["chunks_rejected"] == 0 and r2["tier_faults"] == {}, r2


@pytest.mark.parametrize("argv,msg", [
    (["--store", "ram=64MiB"], "--buckets / --arrival / --workload / --store apply to --serve only"),
    (["--serve", "--store", "ram=12XB"], "--store: ram size '12XB' is not a byte count or a number with KiB"),
    (["--serve", "--store", "ram=1KiB"], "--store: ram size '1KiB' must be in [1MiB, 1TiB], got 1024 bytes"),
    (["--serve", "--store", "ram=64MiB,ram=8MiB"], "--store names the ram tier twice"),
    (["--serve", "--store", "redis=1.2.3.4:5"], "--store: 'redis=1.2.3.4:5' is not ram=..., disk=... or mooncake"),
    (["--serve", "--store", "disk=64MiB"], "--store: disk needs PATH:SIZE, got '64MiB'"),
    (["--serve", "--store", "mooncake=127.0.0.1:5"], "--store: mooncake needs MASTER_HOST:PORT@METADATA_HOST:PORT"),
    (["--serve", "--store", "mooncake=127.0.0.1:0@h:1"], "--store: mooncake master '127.0.0.1:0' is not HOST:PORT"),
    (["--serve", "--store", ""], "--store must name at least one tier"),
])
def test_bad_store_values_are_one_line_and_exit_2(capsys, argv, msg):
    assert demo.main(argv + ["--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err, err


def test_store_that_cannot_be_used_is_refused_before_any_model(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert demo.main(["--serve", "--store", f"disk={blocker}:8MiB", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"offload-demo: error: --store: DiskTier: path {str(blocker)!r} exists and is not a directory"
    dead = free_port()
    assert demo.main(["--serve", "--store", f"mooncake=127.0.0.1:{dead}@127.0.0.1:{dead}", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"offload-demo: error: --store: MooncakeTier: master '127.0.0.1:{dead}' does not answer")

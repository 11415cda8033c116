"""offload-capacity (and offload-plan, and --what-if) refuse every number no kernel or deployment could have:
one line naming the flag and its limit, exit 2; the limits that kernels set are read from their OpSpec."""
from __future__ import annotations

import json

import pytest

from offload_passes.custom_ops import spec_for
from offload_passes.tools import capacity_plan as cp
from offload_passes.tools import capacity_plan_budget as cb

GiB = 1 << 30
MAX_ID_RANGE = spec_for("dsa_install").limit("MAX_ID_RANGE")
ID_WHY = "custom::dsa_install's MAX_ID_RANGE: the pool's id_to_slot table holds one id per cached token"


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_the_context_limit_is_the_install_kernels_id_range():
    assert cb.MAX_CONTEXT == MAX_ID_RANGE == 1409024
    assert cb.MAX_NEXT_N == spec_for("dsa_install").limit("MAX_RAW_SEQ") - 1
    assert (cb.MIN_BLOCK, cb.MAX_BLOCK) == (spec_for("dsa_install").limit("MIN_SELECTION_BLOCK_SIZE"),
                                            spec_for("dsa_install").limit("MAX_SELECTION_BLOCK_SIZE"))


@pytest.mark.parametrize("main,prog", [(cp.main, "offload-capacity"), (cp.main_alias, "offload-plan")])
def test_context_beyond_the_id_range_is_refused(main, prog, capsys):
    assert main(["--context", "99999999999999999999999"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (f"offload-capacity: error: --context must be an integer in [1, {MAX_ID_RANGE}] ({ID_WHY}), "
                       "got 99999999999999999999999")
    assert len(err) == (2 if prog == "offload-plan" else 1)   # the alias adds its one note
    assert main(["--context", str(MAX_ID_RANGE + 1)]) == 2
    assert f"got {MAX_ID_RANGE + 1}" in capsys.readouterr().err


def test_the_longest_context_plans_with_the_widest_id_table(capsys):
    assert cp.main(["--context", str(MAX_ID_RANGE), "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["per_request"]["context_tokens"] == MAX_ID_RANGE
    assert j["per_request"]["pool_8192_metadata_per_group"] == (8192 + MAX_ID_RANGE + 8192 // 16) * 4
    for m in j["modes"]:  # nothing negative, no window where no request fits
        assert m["device_per_request"] > 0 and m["max_per_rank"] >= 0
        win = m["reserve_window_gib"]
        assert (win is None) == (m["max_per_rank"] == 0) and (win is None or 0 <= win[0] < win[1])


BAD = [
    (["--devices", "99999999999999999999"], "--devices must be an integer in [1, 8192] (up to 8192 devices), got "
                                            "99999999999999999999"),
    (["--ranks-per-device", "1000000"], "--ranks-per-device must be an integer in [1, 8] (dies per device), got "
                                        "1000000"),
    (["--hbm-gib", "1e300"], "--hbm-gib must be a finite number in (0, 4096] (GiB of HBM per device), got 1e+300"),
    (["--hbm-gib", "0"], "--hbm-gib must be a finite number in (0, 4096] (GiB of HBM per device), got 0.0"),
    (["--hbm-gib=-inf"], "--hbm-gib must be a finite number in (0, 4096] (GiB of HBM per device), got -inf"),
    (["--host-gib", "nan"], "--host-gib must be a finite number in (0, 65536] (GiB of host memory per device), "
                            "got nan"),
    (["--host-gib", "1e300"], "--host-gib must be a finite number in (0, 65536] (GiB of host memory per device), "
                              "got 1e+300"),
    (["--context", "0"], "--context must be an integer >= 1, got 0"),
    (["--next-n", "4"], "--next-n must be an integer in [0, 3] (raw_seq = 1 + next_n <= custom::dsa_install's "
                        "MAX_RAW_SEQ 4), got 4"),
    (["--block-size", "1"], "--block-size must be an integer in [16, 128] (a power of two: custom::dsa_install's "
                            "selection block sizes), got 1"),
    (["--block-size", "99999999999"], "--block-size must be an integer in [16, 128] (a power of two: "
                                      "custom::dsa_install's selection block sizes), got 99999999999"),
    (["--block-size", "48"], "--block-size must be a power of two (custom::dsa_install's selection block sizes), "
                             "got 48"),
    (["--kv-bytes", "3"], "--kv-bytes must be 2 (f16/bf16) or 4 (f32), got 3: the int8 (C8) cache layout is not "
                          "modeled, and the pass refuses quantised KV"),
    (["--indexer-bytes", "3"], "--indexer-bytes must be 1 (int8), 2 (f16/bf16) or 4 (f32), got 3"),
    (["--indexer-bytes", "99999999999999"], "--indexer-bytes must be an integer in [1, 4] (int8, f16/bf16 or f32), "
                                            "got 99999999999999"),
    (["--indexer-scale-bytes", "999999999999999"], "--indexer-scale-bytes must be an integer in [0, 512] (a token's "
                                                   "indexer-key scales: 512 B is a whole 128-dim f32 key), got "
                                                   "999999999999999"),
    (["--weight-bytes", "1e300"], "--weight-bytes must be a finite number in [0.125, 4] (1-bit to f32 per "
                                  "parameter), got 1e+300"),
    (["--weight-bytes", "1e-300"], "--weight-bytes must be a finite number in [0.125, 4] (1-bit to f32 per "
                                   "parameter), got 1e-300"),
    (["--weight-bytes", "nan"], "--weight-bytes must be a finite number in [0.125, 4] (1-bit to f32 per "
                                "parameter), got nan"),
    (["--weights-gib", "-1"], "--weights-gib must be a finite number in (0, 4096] (GiB per rank), got -1.0"),
    (["--weights-gib", "100"], "--weights-gib must be <= --hbm-gib / --ranks-per-device (64 GiB per rank), got 100"),
    (["--reserve-gib", "65"], "--reserve-gib must be <= --hbm-gib / --ranks-per-device (64 GiB per rank), got 65"),
    (["--reserve-gib", "nan"], "--reserve-gib must be a finite number in [0, 4096] (GiB per rank), got nan"),
    (["--reserve-gib", "-0.5"], "--reserve-gib must be a finite number in [0, 4096] (GiB per rank), got -0.5"),
    (["--prefill-mini-batch", "0"], "--prefill-mini-batch must be an integer >= 1, got 0"),
    (["--prefill-mini-batch", "999999999999"], "--prefill-mini-batch must be an integer in [1, 4096] (requests in "
                                               "the prefill staging cache), got 999999999999"),
    (["--batch", "0"], "--batch must be an integer in [1, 65536], got 0"),
    (["--batch", "99999999999999999999"], "--batch must be an integer in [1, 65536], got 99999999999999999999"),
    (["--batch", "100"], "batch must be a positive multiple of the 32 ranks (attention is data-parallel), got 100"),
    (["--pool-size", "0"], "--pool-size must be in (0, 16384] (dsa_plan / dsa_install limits), got 0"),
    (["--pool-size=-16"], "--pool-size must be in (0, 16384] (dsa_plan / dsa_install limits), got -16"),
]


@pytest.mark.parametrize("argv,msg", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_every_numeric_flag_is_checked(argv, msg, capsys):
    assert cp.main(argv) == 2
    assert _error(capsys) == f"offload-capacity: error: {msg}\n"


def test_a_refused_budget_from_the_library_names_the_field():
    with pytest.raises(ValueError, match=rf"^context_len must be an integer in \[1, {MAX_ID_RANGE}\] "):
        cb.Budget(context_len=MAX_ID_RANGE + 1).validate()
    with pytest.raises(ValueError, match=r"^devices must be an integer in \[1, 8192\] \(up to 8192 devices\), got 2.0$"):
        cb.Budget(devices=2.0).validate()
    with pytest.raises(ValueError, match=r"^gate_bytes must be a finite number in \[0.125, 4\]"):
        cb.Budget(gate_bytes=float("inf")).validate()
    cb.Budget(host_mem_per_device_gib=None, weights_gib_per_rank=None).validate()  # None: unbounded / estimated


def test_reserve_windows_are_never_negative(capsys):
    """A reserve of 0 keeps the batch from reserve 0 up ("[0.00, hi]"); where nothing fits, no window."""
    assert cp.main(["--reserve-gib", "0", "--json"]) == 0
    modes = {m["mode"]: m for m in json.loads(capsys.readouterr().out)["modes"]}
    lo, hi = modes["no offload"]["reserve_window_gib"]
    assert lo == 0.0 and 0 < hi and modes["no offload"]["max_per_rank"] == 4
    assert cp.main(["--reserve-gib", "0"]) == 0
    assert f"[0.00, {hi:.2f}] GiB" in capsys.readouterr().out
    # a staging cache of 4096 requests leaves the offload modes nothing: 0 requests, no window
    assert cp.main(["--prefill-mini-batch", "4096", "--json"]) == 0
    modes = {m["mode"]: m for m in json.loads(capsys.readouterr().out)["modes"]}
    assert modes["basic offload"]["max_global"] == 0 and modes["basic offload"]["reserve_window_gib"] is None
    assert modes["no offload"]["max_global"] == 64


def test_help_states_each_range():
    text = cp._parser().format_help()
    assert f"[1, {MAX_ID_RANGE}]" in text.replace("\n", " ").replace("  ", " ")


# -- --what-if ------------------------------------------------------------------------------------------------

WHATIF_BAD = [
    (["--batches", "0"], "--batches must be comma-separated integers >= 1, got '0'"),
    (["--batches", "99999999999999999999"], "--batches must be <= 65536, got 99999999999999999999"),
    (["--pools", "nan"], "--pools must be comma-separated integers >= 1, got 'nan'"),
    (["--pools", "99999999"], "--pools must be in (0, 16384] (dsa_plan / dsa_install limits), got 99999999"),
    (["--contexts", "-5"], "--contexts must be comma-separated integers >= 1, got '-5'"),
    (["--contexts", "99999999999999999999"], "--contexts must be in (2048, 1048576], got 99999999999999999999"),
    (["--seeds", "0"], "--seeds must be in [1, 16], got 0"),
    (["--seeds", "nan"], "--seeds must be an integer, got 'nan'"),
    (["--steps", "0"], "--steps must be in [1, 100000], got 0"),
    (["--steps", "999999999999"], "--steps must be in [1, 100000], got 999999999999"),
    (["--warmup", "-1"], "--warmup must be in [0, 100000], got -1"),
    (["--batch", "0", "--trace", "synth:steps=4,context=600,K=64,P=64"], "--batch must be in [1, 65536], got 0"),
    (["--pool", "99999999", "--trace", "synth:steps=4,context=600,K=64,P=64"],
     "--pool must be in (0, 16384] (dsa_plan / dsa_install limits), got 99999999"),
    (["--fifo8k-hit", "nan", "--trace", "synth:steps=4,context=600,K=64,P=64"],
     "--fifo8k-hit must be a hit rate in [0, 1], got nan"),
    (["--fifo16k-hit", "-1", "--trace", "synth:steps=4,context=600,K=64,P=64"],
     "--fifo16k-hit must be a hit rate in [0, 1], got -1.0"),
    (["--anchored", "x.json", "--h16", "inf"], "--h16 must be hit rates in (0.85, 1], got 'inf'"),
    (["--trace", "synth:skew=nan"], "--trace synth:skew=nan: synthetic spec 'synth:skew=nan': skew must be a "
                                    "finite number in [0, 100], got 'nan'"),
    (["--trace", "synth,bogus=1"], "--trace synth,bogus=1: synthetic spec 'synth,bogus=1': unknown synthetic "
                                   "parameter 'bogus'; known: context, steps, B, S, K, P, sinks, skew, drift, "
                                   "recency, tau, seed, pop_drift"),
]


@pytest.mark.parametrize("argv,msg", WHATIF_BAD, ids=[" ".join(a) for a, _ in WHATIF_BAD])
def test_every_what_if_number_is_checked(argv, msg, capsys):
    try:
        rc = cp.main(["--what-if"] + argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    assert _error(capsys) == f"offload-capacity --what-if: error: {msg}\n"


def test_what_if_reads_a_file_named_synth(tmp_path, monkeypatch, capsys):
    """``--trace synth_run.npz`` is the file (written by offload-sim's synthetic writer), not a generated trace."""
    from offload_passes.trace import cli as trace_cli
    from offload_passes.trace import sim
    from offload_passes.trace.format import load_trace

    monkeypatch.chdir(tmp_path)
    spec = "synth:context=20000,steps=12,K=2048,P=2048,drift=0.5,skew=1.8,seed=5"
    assert trace_cli.main([spec, "--pool-sizes", "8192", "--policies", "sa_fifo", "--save-trace",
                           "synth_run.npz"]) == 0
    capsys.readouterr()
    assert cp.main(["--what-if", "--trace", "synth_run.npz", "--policy", "lru", "--pool", "8192", "--json"]) == 0
    o = json.loads(capsys.readouterr().out)
    tr = load_trace("synth_run.npz")
    assert tr.steps == 12 and o["trace"] == "synth_run.npz"
    assert o["hit"] == round(sim.simulate(tr, "lru", 8192).hit_rate, 6)
    assert o["fifo_hits"]["8192"] == round(sim.simulate(tr, "sa_fifo", 8192).hit_rate, 6)

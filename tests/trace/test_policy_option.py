"""The opt-in second-chance pool (``replacement_policy="second_chance"``): the rewrite installs with
``offload_ref::dsa_install_sc``; outputs stay bit-identical to the unmodified model (the policy changes
what is cached, never what is served), and the compiled run's counters equal ``offload-sim``'s
``sa_clock`` replay of its own trace — the same exactness test as the default FIFO against ``sa_fifo``."""
from __future__ import annotations

import pytest

from offload_passes.apps import demo
from offload_passes.options import OffloadOptions
from offload_passes.trace import sim
from offload_passes.trace.format import load_trace


def test_second_chance_option_is_exact_and_replays_to_sa_clock(tmp_path):
    out = demo.run("tiny", steps=3, pool_size=32, record_trace=str(tmp_path / "sc.npz"),
                   replacement_policy="second_chance")
    assert out["rewritten"] and out["replacement_policy"] == "second_chance"
    assert out["ops"] == {"dsa_plan": 2, "dsa_serve": 8, "dsa_install": 0, "dsa_install_sc": 8}
    assert out["max_abs_diff"] == {"logits": 0.0, "attn": 0.0}
    tr = load_trace(out["trace"])
    sc = sim.simulate(tr, "sa_clock", out["pool_size"])
    assert (sc.hits, sc.misses, sc.window) == (out["hits"], out["misses"], out["window"])
    assert sc.host_rows_total == out["host_rows_read"]
    fifo = sim.simulate(tr, "sa_fifo", out["pool_size"])
    assert (fifo.hits, fifo.misses) != (sc.hits, sc.misses), "the trace does not tell the policies apart"


def test_second_chance_is_cpu_only_and_names_are_checked():
    assert OffloadOptions(replacement_policy="second_chance").replacement_policy == "second_chance"
    with pytest.raises(ValueError, match="option replacement_policy must be one of"):
        OffloadOptions(replacement_policy="lru")
    with pytest.raises(ValueError, match="needs exe_mode in .*CANN's NPU kernels implement only 'fifo'"):
        OffloadOptions(replacement_policy="second_chance", exe_mode="ge_graph")

"""Synthetic trace generator: structure of the traces, the locality knobs, the calibration."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from offload_passes.trace import sim, synth

SMALL = synth.SynthParams(context=2000, steps=20, B=1, S=2, K=64, P=160, sinks=3, seed=1)


def test_rows_are_ranked_causal_unique_and_keep_the_sinks():
    tr = synth.generate(SMALL)
    assert tr.topk.shape == (20, 1, 1, 2, 160) and tr.K == 64 and tr.ranked
    for t in range(tr.steps):
        L = tr.lengths[t, 0]
        assert L == 2000 + (t + 1) * 2
        for s in range(2):
            row = tr.topk[t, 0, 0, s]
            assert (row >= 0).all() and len(set(row.tolist())) == 160
            assert row.max() <= L - 1 - (1 - s)          # causal limit of query token s
            assert set(range(3)) <= set(row[:64].tolist())  # sinks always selected


def test_drift_and_skew_raise_reuse():
    def adj(**kw):
        return sim.simulate(synth.generate(replace(SMALL, S=1, **kw)), "adjacent", 64, warmup=2).hit_rate

    assert adj(drift=0.2) < adj(drift=0.6) < adj(drift=0.95)
    assert adj(skew=0.2, drift=0.3) < adj(skew=3.0, drift=0.3)


def test_parse_spec():
    p = synth.parse_spec("synth:calibrated,steps=5,S=2")
    assert (p.steps, p.S, p.skew, p.drift) == (5, 2, synth.CALIBRATED.skew, synth.CALIBRATED.drift)
    assert synth.parse_spec("synth") == synth.SynthParams()
    with pytest.raises(ValueError, match="must be key=value"):
        synth.parse_spec("synth:steps")
    with pytest.raises(ValueError, match=r"P must be >= K=64 \(the ranked columns hold the top-k\), got P=32"):
        synth.generate(replace(SMALL, P=32))
    with pytest.raises(ValueError, match=r"drift must be a finite number in \[0, 1\], got 1.5"):
        synth.generate(replace(SMALL, drift=1.5))


def test_both_separators_read_alike_and_calibrated_comes_first():
    assert synth.parse_spec("synth,steps=10") == synth.parse_spec("synth:steps=10") == replace(synth.SynthParams(),
                                                                                               steps=10)
    assert synth.parse_spec("synth,calibrated,steps=7") == replace(synth.CALIBRATED, steps=7)
    assert synth.parse_spec("synth:skew=0.5,tau=1e2").tau == 100.0
    assert not synth.is_spec("synthetic") and not synth.is_spec("synth_run.npz") and synth.is_spec("synth")


SPEC_ERRORS = [
    ("synth:skew=nan", "skew must be a finite number in [0, 100], got 'nan'"),
    ("synth:skew=-5", "skew must be a finite number in [0, 100], got '-5'"),
    ("synth:skew=inf", "skew must be a finite number in [0, 100], got 'inf'"),
    ("synth:recency=1e9", "recency must be a finite number in [0, 100], got '1e9'"),
    ("synth:tau=0", "tau must be a finite number in (0, 4194304], got '0'"),
    ("synth:drift=1.5", "drift must be a finite number in [0, 1], got '1.5'"),
    ("synth:pop_drift=-0.1", "pop_drift must be a finite number in [0, 1], got '-0.1'"),
    ("synth:steps=0", "steps must be an integer in [1, 1048576], got '0'"),
    ("synth:steps=1.5", "steps must be an integer in [1, 1048576], got '1.5'"),
    ("synth:steps=ten", "steps must be an integer in [1, 1048576], got 'ten'"),
    ("synth:S=5", "S must be an integer in [1, 4], got '5'"),
    ("synth:B=-1", "B must be an integer in [1, 1024], got '-1'"),
    ("synth:seed=-1", "seed must be an integer in [0, 9223372036854775807], got '-1'"),
    ("synth:context=99999999999999999999999", "context must be an integer in [2, 4194304], got "
                                               "'99999999999999999999999'"),
    ("synth:sinks=-1", "sinks must be an integer in [0, 4194304], got '-1'"),
    ("synth:K=4096", "P must be >= K=4096 (the ranked columns hold the top-k), got P=2048"),
    ("synth:context=3000,sinks=4000", "sinks must be <= context=3000, got 4000"),
    ("synth:steps=1048576,B=1024", "steps*B*S*P must be <= 2147483648 (the trace's int32 ids, 8 GiB), got "
                                   "1048576*1024*1*2048 = 2199023255552"),
    ("synth,bogus=1", "unknown synthetic parameter 'bogus'; known: context, steps, B, S, K, P, sinks, skew, drift, "
                      "recency, tau, seed, pop_drift"),
    ("synth:steps=4,steps=5", "steps is given twice"),
    ("synth:steps=4,", "item '' must be key=value (synth[:calibrated][,key=value...])"),
    ("synth:", "item '' must be key=value (synth[:calibrated][,key=value...])"),
    ("synth:steps=4,calibrated", "item 'calibrated' must be key=value (synth[:calibrated][,key=value...])"),
]


@pytest.mark.parametrize("spec,msg", SPEC_ERRORS, ids=[s for s, _ in SPEC_ERRORS])
def test_every_parameter_is_checked_naming_the_key_and_its_limit(spec, msg):
    with pytest.raises(ValueError) as e:
        synth.parse_spec(spec)
    assert str(e.value) == f"synthetic spec {spec!r}: {msg}"


def test_library_params_of_the_wrong_kind_are_refused():
    with pytest.raises(ValueError, match=r"^steps must be an integer in \[1, 1048576\], got 2.0$"):
        synth.generate(replace(SMALL, steps=2.0))
    with pytest.raises(ValueError, match=r"^skew must be a finite number in \[0, 100\], got True$"):
        synth.generate(replace(SMALL, skew=True))
    assert synth.generate(replace(SMALL, steps=np.int64(2), skew=np.float32(0.5))).steps == 2


def test_calibrated_parameters_reproduce_the_references_lru_side_numbers():
    """Regression of the fit (the calibration table of docs/trace-science.md): seed 0, 64K context, K = 2048."""
    loc = synth.locality(synth.CALIBRATED)
    assert abs(loc["adjacent"] - synth.REF_ADJACENT_K2048) < 0.005, loc
    assert abs(loc["lru_8k"] - synth.REF_LRU_8K) < 0.005, loc
    assert np.isfinite(list(loc.values())).all()

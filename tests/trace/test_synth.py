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
    with pytest.raises(ValueError, match=r"need 0 < K <= P, got K=64, P=32"):
        synth.generate(replace(SMALL, P=32))
    with pytest.raises(ValueError, match=r"drift must be in \[0, 1\], got 1.5"):
        synth.generate(replace(SMALL, drift=1.5))


def test_calibrated_parameters_reproduce_the_references_lru_side_numbers():
    """Regression of the fit (the calibration table of docs/trace-science.md): seed 0, 64K context, K = 2048."""
    loc = synth.locality(synth.CALIBRATED)
    assert abs(loc["adjacent"] - synth.REF_ADJACENT_K2048) < 0.005, loc
    assert abs(loc["lru_8k"] - synth.REF_LRU_8K) < 0.005, loc
    assert np.isfinite(list(loc.values())).all()

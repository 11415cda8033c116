"""Trace recording: file format, the dsa_plan recorder behind OffloadState.record_trace, the model recorder."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from offload_passes.state import GroupLayout, OffloadState
from offload_passes.trace import sim, synth
from offload_passes.trace.format import Trace, load_trace, save_trace
from offload_passes.trace.record import PlanRecorder, record_model


def test_npz_round_trip_and_header(tmp_path):
    tr = synth.generate(synth.SynthParams(context=300, steps=3, B=2, S=2, K=64, P=96, seed=2))
    path = save_trace(tr, tmp_path / "t.npz")
    z = np.load(path)
    assert set(z.files) == {"header", "topk", "lengths"}
    h = json.loads(str(z["header"]))
    assert (h["format"], h["version"], h["K"], h["P"], h["S"], h["B"], h["steps"]) == (
        "offload_passes.trace", 1, 64, 96, 2, 2, 3)
    back = load_trace(path)
    np.testing.assert_array_equal(back.topk, tr.topk)
    np.testing.assert_array_equal(back.lengths, tr.lengths)
    assert back.groups == [[0]] and back.source == "synthetic" and back.ranked


def test_load_rejects_foreign_files(tmp_path):
    bad = tmp_path / "x.npz"
    np.savez(bad, header=np.array(json.dumps({"format": "other"})), topk=np.zeros((1, 1, 1, 1, 1)),
             lengths=np.zeros((1, 1)))
    with pytest.raises(ValueError, match="header format is 'other'"):
        load_trace(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_trace(tmp_path / "missing.npz")
    with pytest.raises(ValueError, match=r"lengths must be \[steps=2, B=1\]"):
        Trace(np.zeros((2, 1, 1, 1, 4), np.int32), np.zeros((3, 1), np.int32), 4)
    with pytest.raises(ValueError, match=r"K must be in \(0, P=4\]"):
        Trace(np.zeros((2, 1, 1, 1, 4), np.int32), np.zeros((2, 1), np.int32), 8)


def _state(B, PS, IR, groups):
    lays = [GroupLayout(g, layers[0], layers, B, PS, IR, [(4, 2, torch.bfloat16)] * len(layers))
            for g, layers in enumerate(groups)]
    return OffloadState.allocate("g0", lays)


def test_state_record_trace_captures_every_plan_of_its_groups():
    """OffloadState.record_trace(): the dsa_plan inputs per group and step, replayable exactly."""
    tr_in = synth.generate(synth.SynthParams(context=400, steps=5, B=2, S=1, K=64, P=64, seed=7, drift=0.7))
    st = _state(2, 32, 512, [[0, 1], [2]])
    other = _state(2, 32, 512, [[0]])  # a second state's plans must not leak into the first trace
    st.record_trace()
    ops = torch.ops.custom
    for t in range(tr_in.steps):
        for g in st.groups + other.groups[:1]:
            tk = torch.from_numpy(tr_in.topk[t, 0]).reshape(2, 1, 1, 64).contiguous()
            ops.dsa_plan(tk, torch.from_numpy(tr_in.lengths[t]), g.pool_ids, g.id_to_slot, g.lru_counter)
    st.record_trace(False)
    tk = torch.from_numpy(tr_in.topk[0, 0]).reshape(2, 1, 1, 64).contiguous()
    ops.dsa_plan(tk, torch.from_numpy(tr_in.lengths[0]), st.groups[0].pool_ids, st.groups[0].id_to_slot,
                 st.groups[0].lru_counter)  # after stop: not recorded
    tr = st.trace("unit")
    assert tr.topk.shape == (5, 2, 2, 1, 64) and tr.source == "compiled" and tr.groups == [[0, 1], [2]]
    for g in range(2):
        np.testing.assert_array_equal(tr.topk[:, g], tr_in.topk[:, 0])
    np.testing.assert_array_equal(tr.lengths, tr_in.lengths)


def test_state_trace_without_recording_is_an_error():
    st = _state(1, 16, 64, [[0]])
    with pytest.raises(RuntimeError, match="call record_trace\\(\\) before"):
        st.trace()
    rec = PlanRecorder()
    with pytest.raises(RuntimeError, match="no dsa_plan call of this state"):
        rec.trace_for(st)


def test_model_recorder_top_p_extends_the_models_top_k():
    """record_model: columns :K are the unmodified model's top-k; K..P-1 further ranks, disjoint, causal."""
    tr = record_model("tiny", steps=2, P=96)
    T, G, B, S, P = tr.topk.shape
    assert (T, P, tr.K, tr.source) == (2, 96, 64, "model")
    assert tr.groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for t in range(T):
        for g in range(G):
            for b in range(B):
                row = tr.topk[t, g, b, 0]
                top, rest = row[:64], row[64:]
                assert (top >= 0).all()
                rest = rest[rest >= 0]
                assert len(rest) == 32                        # 257+ visible keys: P ranks available
                assert not set(rest.tolist()) & set(top.tolist())
                assert rest.max() < tr.lengths[t, b]          # causal
    # replayable; the score-informed policies see the extra ranks
    r = sim.simulate(tr, "rank_keep", 64)
    assert r.hits + r.misses + r.window == T * G * B * 64


def test_demo_record_trace_replays_to_the_compiled_runs_counters(tmp_path):
    """offload-demo --record-trace: the trace of a compiled run, replayed through the simulator's SA-FIFO,
    gives exactly the hits / misses / window / host rows the compiled graph counted in OffloadState."""
    from offload_passes.apps import demo

    out = demo.run("tiny", steps=3, pool_size=32, record_trace=str(tmp_path / "c.npz"))
    tr = load_trace(out["trace"])
    assert (tr.source, tr.steps, tr.K, tr.groups) == ("compiled", 3, 64, out["groups"])
    r = sim.simulate(tr, "sa_fifo", out["pool_size"])
    assert out["misses"] > 0 and out["hits"] > 0
    assert (r.hits, r.misses, r.window) == (out["hits"], out["misses"], out["window"])
    assert r.host_rows_total == out["host_rows_read"]


def test_demo_rejects_an_unwritable_trace_path_before_running(capsys):
    from offload_passes.apps import demo

    assert demo.main(["--record-trace", "/nonexistent-dir/sub/t.npz"]) == 2
    assert "--record-trace" in capsys.readouterr().err

"""The per-set MIN bound (NumPy), the NumPy re-computation of the set-associative policies, the prefetch
host-rows bound, the trace-model ensemble. The exact search behind the per-set optimum is in
``test_exact_min.py``."""
from __future__ import annotations

import numpy as np
import pytest

from offload_passes.trace import models, setsim, sim, study, synth
from offload_passes.trace.format import Trace

DEMAND_SA = ("sa_fifo", "sa_lru", "sa_clock", "srrip", "brrip")


def random_trace(seed: int, steps: int = 40, K: int = 64, span: int = 400, B: int = 1, S: int = 1) -> Trace:
    """Ids drawn from a skewed random distribution over ``span`` positions (reuse at every distance)."""
    rng = np.random.default_rng(seed)
    topk = np.full((steps, 1, B, S, K), -1, dtype=np.int32)
    w = rng.pareto(1.2, span) + 1e-3
    for t in range(steps):
        for b in range(B):
            for s in range(S):
                n = rng.integers(K // 2, K + 1)
                topk[t, 0, b, s, :n] = rng.choice(span, size=n, replace=False, p=w / w.sum())
    lengths = np.full((steps, B), span + 8, dtype=np.int32)
    return Trace(topk, lengths, K)


@pytest.mark.parametrize("seed", range(6))
def test_per_set_min_bounds_every_demand_policy_and_is_below_fully_associative_min(seed):
    # the no-bypass greedy is a feasible always-install schedule, not a bound: it is only checked against
    # the bypass optimum here; the demand policies are checked against the optimum itself
    tr = random_trace(seed, B=2 if seed % 2 else 1, S=2 if seed % 3 == 0 else 1)
    for ps, ways in ((64, 16), (128, 16), (64, 4)):
        nob = setsim.per_set_min(tr, ps, ways, bypass=False)
        byp = setsim.per_set_min(tr, ps, ways, bypass=True)
        full = sim.simulate(tr, "belady", ps)
        assert nob.hits + nob.misses == byp.hits + byp.misses == full.hits + full.misses or tr.S > 1
        assert nob.hits <= byp.hits
        assert byp.hit_rate <= full.hit_rate + 1e-12
        for pol in DEMAND_SA:
            r = sim.simulate(tr, pol, ps, ways)
            assert r.hit_rate <= byp.hit_rate, (pol, ps, ways, r.hit_rate, byp.hit_rate)
        for ins in (0, 1):
            assert setsim.simulate_sa(tr, "sa_clock", ps, ways, insert_bit=ins).hit_rate <= byp.hit_rate
        assert setsim.simulate_sa(tr, "sa_rank", ps, ways).hit_rate <= byp.hit_rate
    # on these traces the bounds are strict somewhere (the test would notice a bound equal to FIFO)
    assert setsim.per_set_min(tr, 64, 16).hits > sim.simulate(tr, "sa_fifo", 64).hits


@pytest.mark.parametrize("seed", range(3))
def test_one_set_min_with_bypass_equals_the_cpp_fully_associative_min(seed):
    tr = random_trace(seed + 10)
    for ps in (32, 96, 200):
        assert setsim.per_set_min(tr, ps, ways=ps).hits == sim.simulate(tr, "belady", ps).hits


def test_per_set_min_by_hand():
    # one set of 2 ways; ids 0, 2, 4 all map to set 0 of a 2-set pool? use 1 set: pool 2 = 1 x 2 ways
    steps = [[1], [2], [3], [1], [2]]
    topk = np.full((5, 1, 1, 1, 1), -1, dtype=np.int32)
    for t, ids in enumerate(steps):
        topk[t, 0, 0, 0, : len(ids)] = ids
    tr = Trace(topk, np.full((5, 1), 50, dtype=np.int32), 1)
    # bypass: keep 1, 2 and skip 3 -> hits at steps 3 and 4
    assert setsim.per_set_min(tr, 2, 2, bypass=True).hits == 2
    # no bypass: 3 must be installed, evicting 2 (used later than 1) -> only 1 hits
    assert setsim.per_set_min(tr, 2, 2, bypass=False).hits == 1


@pytest.mark.parametrize("ps,ways", [(32, 16), (64, 16), (64, 8)])
def test_numpy_set_associative_policies_equal_the_cpp_core(ps, ways):
    tr = synth.generate(synth.SynthParams(context=900, steps=24, B=2, S=2, K=64, P=64, drift=0.7, skew=0.8,
                                          tau=8.0, seed=ps + ways))
    for pol in ("sa_fifo", "sa_clock"):
        a = setsim.simulate_sa(tr, pol, ps, ways, warmup=3)
        c = sim.simulate(tr, pol, ps, ways, warmup=3)
        assert a.hit_rate == c.hit_rate
        assert a.probes == round(c.scans_per_step * a.steps)
        if pol == "sa_clock":
            assert a.hit_writes == round(c.writes_per_step * a.steps)
            # every probe either clears a bit or takes the way: clears = probes - installs
            assert a.clear_writes == a.probes - a.installs
            assert a.max_probes <= ways + 1
            # offload-sim reports the same clears (counted here one by one, derived there)
            assert a.clear_writes == round(c.clears_per_step * a.steps) > 0


def test_insert_convention_changes_second_chance_and_ranks_beyond_k_are_counted():
    tr = models.generate("score", steps=60, seed=1, P=2560, context=8192)
    r0 = setsim.simulate_sa(tr, "sa_clock", 1024, warmup=20, insert_bit=0)
    r1 = setsim.simulate_sa(tr, "sa_clock", 1024, warmup=20, insert_bit=1)
    assert r0.hit_rate != r1.hit_rate and r0.clear_writes != r1.clear_writes
    rk = setsim.simulate_sa(tr, "sa_rank", 1024, warmup=20, rank_columns=2560)
    assert rk.rank_writes > 0 and rk.max_probes == 16
    assert setsim.simulate_sa(tr, "sa_rank", 1024, warmup=20).rank_writes == 0


def test_prefetching_host_rows_are_bounded_by_min_misses():
    tr = synth.generate(synth.SynthParams(context=3000, steps=30, K=128, P=512, drift=0.6, skew=1.5, seed=2))
    for ps in (256, 512):
        rows, lo = setsim.host_rows_bound_holds(tr, ps, warmup=5)
        assert rows >= lo > 0
        # while its demand hit rate may exceed the demand MIN's
        assert sim.simulate(tr, "rank_prefetch", ps, warmup=5).prefetch > 0


@pytest.mark.parametrize("model", models.MODELS)
def test_every_model_generates_valid_warm_traces(model):
    tr = models.generate(model, steps=30, seed=3, context=20000)
    assert tr.topk.shape == (30, 1, 1, 1, 2048)
    row = tr.topk[5, 0, 0, 0]
    assert (row >= 0).all() and np.unique(row).size == row.size  # K distinct ids, no padding
    assert (row < tr.lengths[5, 0]).all() and set(range(4)) <= set(row.tolist())  # causal, sinks kept
    assert 0.2 < sim.simulate(tr, "adjacent", tr.K, warmup=5).hit_rate < 0.95


def test_model_and_params_are_checked():
    with pytest.raises(ValueError, match="model must be one of"):
        models.generate("zipf")
    with pytest.raises(ValueError, match="has no score"):
        models.generate("churn", P=4096)
    with pytest.raises(ValueError, match="multiple of ways=16"):
        setsim.per_set_min(random_trace(0), 40)
    with pytest.raises(ValueError, match="insert_bit must be 0 or 1"):
        setsim.simulate_sa(random_trace(0), "sa_clock", 64, insert_bit=2)


def test_study_section_runs_and_reports_ranges():
    o = study.study(seeds=1, steps=12, warmup=8, sections=("locality",), which=("segments",))
    rows = {r["row"]: r for r in o["locality"]["rows"]}
    assert o["locality"]["sa_fifo_cpp_vs_numpy_max_abs_diff"] == 0.0
    f8 = rows["MIN fully associative, 8K"]["ensemble"]["mean"]
    p8 = rows["MIN per 16-way set, bypass, 8K"]["ensemble"]["mean"]
    n8 = rows["MIN per 16-way set, no bypass, 8K"]["ensemble"]["mean"]
    fifo = rows["16-way SA-FIFO, 8K (C++ core)"]["ensemble"]["mean"]
    assert f8 >= p8 >= n8 >= fifo
    assert "✓" in study.render(o) or "✗" in study.render(o)


def test_study_results_of_disjoint_model_sets_merge():
    a = study.study(seeds=1, steps=10, warmup=6, sections=("locality", "policies"), which=("segments",))
    b = study.study(seeds=1, steps=10, warmup=6, sections=("locality", "policies"), which=("churn",))
    m = study.merge(a, b)
    assert m["models"] == ["segments", "churn"]
    row = m["locality"]["rows"][1]
    assert set(row["per_model"]) == {"segments", "churn"} and row["ensemble"]["n"] == 2
    assert row["ensemble"]["min"] == min(r["mean"] for r in row["per_model"].values())
    fifo = [r for r in m["policies"] if r["policy"] == "sa_fifo" and r["pool"] == 8192][0]
    assert fifo["hit"]["n"] == 2 and fifo["models"] == ["segments", "churn"]
    with pytest.raises(ValueError, match="overlap"):
        study.merge(a, a)
    assert "sa_rank_P" not in study.render(m)  # needs scores: absent for these models, not a zero row


def test_sa_fifo_8k_agrees_with_the_reference_and_the_independent_recomputation():
    # a fitted ensemble model on a warm trace (the segments model generates fastest)
    tr = models.generate("segments", steps=640, seed=5)
    cpp = sim.simulate(tr, "sa_fifo", 8192, warmup=384).hit_rate
    npy = setsim.simulate_sa(tr, "sa_fifo", 8192, warmup=384).hit_rate
    assert cpp == npy
    assert abs(cpp - synth.REF_SA_FIFO_8K) <= 0.01, cpp


def test_op_limits_count_state_not_writes():
    # SA-LRU: 4 bits of age per way, within one extra byte per slot, whatever its writes per hit
    assert study.bits_per_slot("sa_lru") == 4 and study.within_limits("sa_lru")
    # SRRIP is within the state limit; its multi-pass search is only a probe count, reported beside it
    assert study.within_limits("srrip") and study.BUDGET["srrip"]["probes"] == 64
    assert study.BUDGET["srrip_1p"]["probes"] == 16 and study.within_limits("srrip_1p")
    # over a byte per slot (S3-FIFO's ghost tags and sequence numbers, LRFU's values), fully associative
    # policies (state shared by all sets) and the offline bounds are not
    assert study.bits_per_slot("sa_s3fifo") > 8 and not study.within_limits("sa_s3fifo")
    assert not study.within_limits("sa_lrfu")
    for p in ("lru", "clock", "s3fifo", "min_per_set", "belady"):
        assert not study.within_limits(p), p
    # every policy the study runs states its budget or is an offline bound
    for p in study.POLICY_STUDY:
        assert p in study.BUDGET or p in study.OFFLINE, p
    # per-set bits beyond the op's int32 word count against the slots: 79 bits per set = 47 / 16 per slot
    assert study.bits_per_slot("sa_s3fifo") == 11 + (79 - 32) / 16


def test_policy_study_reports_mtp_members_and_the_churn_flag():
    o = study.study(seeds=1, steps=12, warmup=8, sections=("policies",), which=("segments", "churn"), mtp_seeds=1)
    rows = {(r["policy"], r["pool"]): r for r in o["policies"]}
    r = rows[("sa_fifo", 8192)]
    assert r["models"] == ["segments", "churn"] and r["models_mtp"] == ["segments+mtp4", "churn+mtp4"]
    assert r["hit"]["n"] == 2 and r["hit_mtp"]["n"] == 2 and r["hit_without_churn"]["n"] == 1
    # per-set MIN bounds every set-associative policy on every member, S = 4 included
    for p in ("sa_fifo", "sa_clock", "gclock", "srrip_1p", "drrip", "sa_s3fifo", "sa_lrfu"):
        assert rows[(p, 8192)]["gap_to_min_per_set"]["min"] >= 0 and rows[(p, 8192)]["gap_to_min_per_set_mtp"]["min"] >= 0
    text = "\n".join(study.policy_table(o))
    assert "| gclock | 8K |" in text and "srrip_rank" not in text  # needs scores: absent, not a zero row

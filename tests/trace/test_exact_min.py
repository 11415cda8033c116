"""The per-set optimum (``offload-sim``'s ``min_per_set``) against an exact search on tiny geometries, against
every demand policy of the geometry (>=) and against the fully associative MIN (<=); the greedy
always-install schedule (``setsim.per_set_min(bypass=False)``) is a feasible schedule, not a bound."""
from __future__ import annotations

import json
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from offload_passes.trace import cli, setsim, sim
from offload_passes.trace.format import Trace
from test_bounds import random_trace  # skewed random ids over a span (tests/trace/test_bounds.py)

SET_ASSOC_DEMAND = ("sa_fifo", "sa_lru", "sa_clock", "srrip", "brrip") + sim.STUDY
FULLY_ASSOC_DEMAND = ("lru", "clock", "s3fifo")


def trace_of(steps: list[list[int]], B: int = 1) -> Trace:
    """S = 1, every id eligible (the cache is far longer than the largest id)."""
    K = max(1, max(len(s) for s in steps))
    topk = np.full((len(steps), 1, B, 1, K), -1, dtype=np.int32)
    for t, ids in enumerate(steps):
        for b in range(B):
            topk[t, 0, b, 0, : len(ids)] = ids
    return Trace(topk, np.full((len(steps), B), 1000, dtype=np.int32), K)


def exact_set(steps: list[tuple[int, ...]], ways: int, bypass: bool) -> int:
    """Most distinct-id hits of one set over every schedule, by exhaustive search over the set's contents.

    ``bypass``: after a step the set may hold any ``ways`` ids of (old contents + the step's ids).
    Otherwise every miss is installed, in record order, each into any way (an empty one or over any
    resident id, an earlier install of the same step included) — what an always-install policy can do."""

    def installs(state: frozenset, misses: tuple[int, ...]) -> set[frozenset]:
        out = {state}
        for m in misses:
            nxt = set()
            for s in out:
                if len(s) < ways:
                    nxt.add(s | {m})
                nxt.update((s - {v}) | {m} for v in s)
            out = nxt
        return out

    def subsets(cands: list[int]) -> set[frozenset]:
        out = {frozenset()}
        for c in cands:
            out |= {s | {c} for s in out if len(s) < ways}
        return out

    @lru_cache(maxsize=None)
    def best(t: int, state: frozenset) -> int:
        if t == len(steps):
            return 0
        d = steps[t]
        h = sum(1 for x in d if x in state)
        nexts = subsets(sorted(state | set(d))) if bypass else \
            installs(state, tuple(x for x in d if x not in state))
        return h + max(best(t + 1, n) for n in nexts)

    return best(0, frozenset())


def exact(steps: list[list[int]], pool: int, ways: int, bypass: bool = True) -> int:
    ns = pool // ways
    total = 0
    for s in range(ns):
        per = [tuple(dict.fromkeys(x for x in ids if x & (ns - 1) == s)) for ids in steps]
        total += exact_set(per, ways, bypass)
    return total


COUNTEREXAMPLE = [[0], [2], [1], [0, 2], [2, 1]]


def test_counterexample_greedy_always_install_is_not_a_bound():
    # one set of 2 ways. At step 2 the pool holds {0, 2}, both next used at step 3: the greedy may evict 0;
    # at step 3 the forced install of 0 (never used again) then displaces 1 or 2, and step 4 hits once (2
    # hits in all). Evicting 2 at step 2 instead keeps {0, 1}, installs 2 over 0 at step 3, and step 4 hits
    # twice (3 hits): always-install optimum 3 > the tie-broken greedy's 2.
    tr = trace_of(COUNTEREXAMPLE)
    assert exact(COUNTEREXAMPLE, 2, 2, bypass=False) == 3
    assert exact(COUNTEREXAMPLE, 2, 2, bypass=True) == 3
    assert sim.simulate(tr, "min_per_set", 2, ways=2).hits == 3
    assert setsim.per_set_min(tr, 2, 2, bypass=True).hits == 3
    # the greedy always-install schedule (victim: farthest next use, ties broken arbitrarily) gets 2
    assert setsim.per_set_min(tr, 2, 2, bypass=False).hits == 2


geom = st.sampled_from([(2, 2), (3, 3), (4, 2), (6, 3), (4, 1), (8, 2)])   # (pool, ways): 1, 2 or 4 sets
steps_st = st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True), min_size=1, max_size=7)


@given(g=geom, steps=steps_st)
def test_per_set_optimum_equals_the_exact_search(g, steps):
    pool, ways = g
    tr = trace_of(steps)
    best = exact(steps, pool, ways, bypass=True)
    assert sim.simulate(tr, "min_per_set", pool, ways=ways).hits == best
    assert setsim.per_set_min(tr, pool, ways, bypass=True).hits == best
    # the greedy always-install schedule is feasible: never above either optimum
    greedy = setsim.per_set_min(tr, pool, ways, bypass=False).hits
    assert greedy <= exact(steps, pool, ways, bypass=False) <= best
    # one set: the fully associative MIN is the same problem
    if pool == ways:
        assert sim.simulate(tr, "belady", pool).hits == best


@given(g=geom, steps=steps_st)
def test_per_set_optimum_bounds_every_demand_policy_of_the_geometry(g, steps):
    pool, ways = g
    tr = trace_of(steps)
    best = sim.simulate(tr, "min_per_set", pool, ways=ways).hits
    for pol in SET_ASSOC_DEMAND:
        assert sim.simulate(tr, pol, pool, ways=ways).hits <= best, pol
    assert best <= sim.simulate(tr, "belady", pool).hits


@pytest.mark.parametrize("seed", range(3))
def test_bounds_on_longer_random_traces(seed):
    tr = random_trace(seed + 20, B=2, S=2 if seed == 1 else 1)
    for ps, ways in ((64, 16), (128, 16), (64, 4)):
        ps_min = sim.simulate(tr, "min_per_set", ps, ways=ways)
        full = sim.simulate(tr, "belady", ps)
        # the C++ core and the independent NumPy re-computation agree on the optimum
        assert ps_min.hit_rate == setsim.per_set_min(tr, ps, ways, bypass=True).hit_rate
        assert ps_min.hit_rate <= full.hit_rate
        for pol in SET_ASSOC_DEMAND:
            assert sim.simulate(tr, pol, ps, ways).hit_rate <= ps_min.hit_rate, (pol, ps, ways)
        for pol in FULLY_ASSOC_DEMAND:   # not bounded by the per-set optimum, only by the fully associative one
            assert sim.simulate(tr, pol, ps, ways).hit_rate <= full.hit_rate, pol
    # strict somewhere: a bound equal to FIFO would be noticed
    assert sim.simulate(tr, "min_per_set", 64).hits > sim.simulate(tr, "sa_fifo", 64).hits


def test_offload_sim_json_names_both_bounds_on_any_policy_subset(capsys):
    spec = "synth:context=600,steps=10,B=1,S=2,K=64,P=64,seed=3"
    assert cli.main([spec, "--pool-sizes", "64", "--policies", "sa_fifo,lru", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    by = {(r["policy"], r["pool_size"]): r for r in out["results"]}
    assert list(by) == [("sa_fifo", 64), ("lru", 64), ("min_per_set", 64), ("belady", 64)]
    assert "16-way set" in by[("min_per_set", 64)]["bounds"] and "any placement" in by[("belady", 64)]["bounds"]
    assert by[("sa_fifo", 64)]["bounds"] == "" and set(out["bounds"]) == {"min_per_set", "belady"}
    assert by[("sa_fifo", 64)]["hit_rate"] <= by[("min_per_set", 64)]["hit_rate"] <= by[("belady", 64)]["hit_rate"]
    assert by[("lru", 64)]["hit_rate"] <= by[("belady", 64)]["hit_rate"] and out["bounds_skipped"] == []
    # a pool that is no 16-way geometry: the fully associative bound only, the per-set one named as skipped
    assert cli.main([spec, "--pool-sizes", "96", "--policies", "lru", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in out["results"]] == ["lru", "belady"]
    assert [(s["policy"], s["pool_size"]) for s in out["bounds_skipped"]] == [("min_per_set", 96)]
    assert cli.main([spec, "--pool-sizes", "96", "--policies", "lru"]) == 0
    assert "min_per_set at pool 96: not computed" in capsys.readouterr().out


def test_offload_sim_rejects_the_bound_for_a_bad_geometry():
    with pytest.raises(ValueError, match="16 x a power of two"):
        sim.simulate(trace_of([[1]]), "min_per_set", 48)


def test_single_pass_srrip_takes_the_multi_pass_decisions_with_at_most_w_probes():
    tr = random_trace(7, B=2)
    for ps, ways in ((64, 16), (64, 4)):
        a, b = sim.simulate(tr, "srrip", ps, ways), sim.simulate(tr, "srrip_1p", ps, ways)
        assert a.hits == b.hits and a.distinct_misses == b.distinct_misses
        assert b.scans_per_step <= ways * b.distinct_misses / (tr.steps * tr.B)


def test_rank_aware_insertion_reads_the_column_order():
    tr = random_trace(8)
    rev = Trace(tr.topk.copy(), tr.lengths, tr.K)
    for t in range(tr.steps):   # the same ids per row, in reverse column order
        row = rev.topk[t, 0, 0, 0]
        n = int((row >= 0).sum())
        row[:n] = row[:n][::-1].copy()
    a, b = sim.simulate(tr, "srrip_rank", 64), sim.simulate(rev, "srrip_rank", 64)
    assert a.hits != b.hits


def test_mtp_regrouping():
    from offload_passes.trace import models

    src = models.generate("segments", steps=20, seed=1, context=5000)
    m = models.mtp(src, 4)
    assert m.S == 4 and m.steps == 5
    # step t, row s is the source's token step 4t + s with that token's causal limit
    for t in range(5):
        for s in range(4):
            assert (m.topk[t, 0, 0, s] == src.topk[4 * t + s, 0, 0, 0]).all()
            L = int(m.lengths[t, 0])
            assert L - (4 - 1 - s) == int(src.lengths[4 * t + s, 0])
    m3 = models.mtp(src, 4, advance=3)
    assert m3.steps == 6 and (m3.topk[1, 0, 0, 0] == src.topk[3, 0, 0, 0]).all()
    with pytest.raises(ValueError, match="advance"):
        models.mtp(src, 4, advance=5)
    with pytest.raises(ValueError, match="S = 1 trace"):
        models.mtp(m, 4)

"""Speed of offload-sim's C++ core and of the NumPy set-associative simulator / per-set MIN bound
(``offload_passes.trace.setsim``): id lookups per second per policy on a GLM-5.2-sized synthetic trace
(context 64K, K = 2048, S = 1, calibrated locality), best of ``--repeat`` runs, with each policy's speed
as a ratio to the C++ sa_fifo measured in the same run.

A "lookup" is one top-k entry classified against the pool (hits + misses + decode window); the
score-informed policies also walk ranks K..P-1, which are not counted as lookups.

Usage: ``python benchmarks/bench_trace_sim.py [--steps N] [--pool PS] [--repeat R] [--top-p P]``

The spread between policies is large (the fully associative LRU walks a linked list, Belady and the
score-informed ones maintain heaps): quote the range this prints, not one number.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from offload_passes.trace import setsim, sim, synth  # noqa: E402
from offload_passes.trace._native import module  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1280)
    ap.add_argument("--pool", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--top-p", type=int, default=4096)
    a = ap.parse_args()
    module()
    t0 = time.perf_counter()
    tr = synth.generate(replace(synth.CALIBRATED, steps=a.steps, P=a.top_p))
    print(f"trace: {a.steps} steps x K={tr.K} (P={tr.P}) generated in {time.perf_counter() - t0:.2f} s; "
          f"pool {a.pool}")
    print(f"{'policy':<22}{'lookups':>10}{'best s':>10}{'M lookups/s':>13}{'x sa_fifo':>11}")
    runs = [(pol, lambda pol=pol: sim.simulate(tr, pol, a.pool)) for pol in sim.POLICIES]
    runs += [("numpy sa_fifo", lambda: setsim.simulate_sa(tr, "sa_fifo", a.pool)),
             ("numpy sa_clock", lambda: setsim.simulate_sa(tr, "sa_clock", a.pool)),
             ("numpy sa_rank(P)", lambda: setsim.simulate_sa(tr, "sa_rank", a.pool, rank_columns=tr.P)),
             ("numpy min_per_set", lambda: setsim.per_set_min(tr, a.pool)),
             ("numpy min_per_set_nb", lambda: setsim.per_set_min(tr, a.pool, bypass=False))]
    n = sim.simulate(tr, "sa_fifo", a.pool).lookups  # S = 1: every policy classifies the same entries
    rates = []
    for name, fn in runs:
        best = float("inf")
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        rates.append((name, best, n / best))
    ref = dict((nm, r) for nm, _, r in rates)["sa_fifo"]
    for name, best, rate in rates:
        print(f"{name:<22}{n:>10}{best:>10.4f}{rate / 1e6:>13.2f}{rate / ref:>11.2f}")
    rates = [r for _, _, r in rates]
    print(f"range: {min(rates) / 1e6:.2f} - {max(rates) / 1e6:.2f} M lookups/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

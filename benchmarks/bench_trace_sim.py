"""Speed of offload-sim's C++ core: id lookups per second per policy on a GLM-5.2-sized synthetic trace
(context 64K, K = 2048, S = 1, calibrated locality), best of ``--repeat`` runs.

A "lookup" is one top-k entry classified against the pool (hits + misses + decode window); the
score-informed policies also walk ranks K..P-1, which are not counted as lookups.

Usage: ``python benchmarks/bench_trace_sim.py [--steps N] [--pool PS] [--repeat R] [--top-p P]``
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from offload_passes.trace import sim, synth  # noqa: E402
from offload_passes.trace._native import module  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--pool", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--top-p", type=int, default=4096)
    a = ap.parse_args()
    module()
    t0 = time.perf_counter()
    tr = synth.generate(replace(synth.CALIBRATED, steps=a.steps, P=a.top_p))
    print(f"trace: {a.steps} steps x K={tr.K} (P={tr.P}) generated in {time.perf_counter() - t0:.2f} s; "
          f"pool {a.pool}")
    print(f"{'policy':<14}{'lookups':>10}{'best s':>10}{'M lookups/s':>13}")
    for pol in sim.POLICIES:
        best = min(sim.simulate(tr, pol, a.pool).seconds for _ in range(a.repeat))
        n = sim.simulate(tr, pol, a.pool).lookups
        print(f"{pol:<14}{n:>10}{best:>10.4f}{n / best / 1e6:>13.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Synthetic top-k traces with interpretable locality, and their calibration to the reference's numbers.

Each batch row carries a context that grows by S tokens per step. The indexer score of position ``j``
at step ``t`` is modelled as

    score_j(t) = skew * w_j  +  sqrt(1 - drift^2)-AR(1) noise z_j(t)  +  recency * exp(-(L_t - 1 - j) / tau)

and the trace stores the ids of the P largest scores in descending order (top-k = the first K), with
``sinks`` leading positions always selected. The parameters:

* ``sinks``      persistent "sink" tokens (ids 0..sinks-1, selected every step);
* ``skew``       popularity skew: weight of a static per-token importance ``w_j`` (standard normal);
                 large = the same tokens win step after step;
* ``drift``      per-step correlation ``rho`` of the dynamic part (1 = frozen, 0 = fresh every step);
                 the rate at which the selection drifts;
* ``recency``/``tau`` new-token arrivals: bonus of recently written tokens (scale ``tau`` positions), so
                 every step's new tokens enter the top-k and push older ones out.

``calibrate`` fits (skew, drift) to the reference's adjacent-step reuse (58.85 % at K = 2048) and LRU
hit rate (90.50 % with an 8K pool), other parameters fixed.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from typing import Optional

import numpy as np

from .format import Trace

log = logging.getLogger("offload_passes.trace.synth")

#: The reference's published locality numbers (cann-recipes-infer GLM-5.2 shared-indexer offload notes).
REF_ADJACENT_K2048 = 0.5885
REF_LRU_8K = 0.9050
REF_SA_FIFO_8K = 0.85     # "about 85 %"
REF_SA_FIFO_16K = 0.90    # "above 90 %"


@dataclass(frozen=True)
class SynthParams:
    context: int = 65536      # cache length at the first decode step
    steps: int = 96
    B: int = 1
    S: int = 1
    K: int = 2048
    P: int = 2048             # ranked columns stored (>= K)
    sinks: int = 4
    skew: float = 1.0
    drift: float = 0.95
    recency: float = 2.0
    tau: float = 64.0
    seed: int = 0
    pop_drift: float = 1.0    # per-step correlation of the popularity w (1 = static; models.py "twoscale")

    def validate(self) -> None:
        if self.K <= 0 or self.P < self.K:
            raise ValueError(f"need 0 < K <= P, got K={self.K}, P={self.P}")
        if self.context <= self.S:
            raise ValueError(f"context must exceed S={self.S}, got {self.context}")
        if not 0.0 <= self.drift <= 1.0:
            raise ValueError(f"drift must be in [0, 1], got {self.drift}")
        if self.steps < 1 or self.B < 1 or not 1 <= self.S <= 4:
            raise ValueError(f"need steps >= 1, B >= 1, 1 <= S <= 4; got {self.steps}, {self.B}, {self.S}")
        if not 0.0 <= self.pop_drift <= 1.0:
            raise ValueError(f"pop_drift must be in [0, 1], got {self.pop_drift}")
        if self.sinks < 0 or self.tau <= 0:
            raise ValueError(f"need sinks >= 0 and tau > 0, got {self.sinks}, {self.tau}")


def generate(p: SynthParams) -> Trace:
    """A one-group trace ``[steps, 1, B, S, P]`` following the model in the module docstring."""
    p.validate()
    rng = np.random.default_rng(p.seed)
    Lmax = p.context + p.steps * p.S
    topk = np.full((p.steps, 1, p.B, p.S, p.P), -1, dtype=np.int32)
    lengths = np.zeros((p.steps, p.B), dtype=np.int32)
    innov = float(np.sqrt(max(1.0 - p.drift * p.drift, 0.0)))
    for b in range(p.B):
        w = rng.standard_normal(Lmax).astype(np.float32) * np.float32(p.skew)
        z = rng.standard_normal(Lmax).astype(np.float32)
        pinnov = float(np.sqrt(max(1.0 - p.pop_drift * p.pop_drift, 0.0)))
        for t in range(p.steps):
            if t and p.pop_drift < 1.0:  # a drifting popularity keeps its variance skew^2
                w *= np.float32(p.pop_drift)
                w += np.float32(pinnov * p.skew) * rng.standard_normal(Lmax).astype(np.float32)
            if t:
                z *= np.float32(p.drift)
                z += np.float32(innov) * rng.standard_normal(Lmax).astype(np.float32)
            L = p.context + (t + 1) * p.S
            lengths[t, b] = L
            for s in range(p.S):
                n = L - (p.S - 1 - s)  # visible positions of query token s (causal)
                pos = np.arange(n, dtype=np.float32)
                sc = w[:n] + z[:n] + np.float32(p.recency) * np.exp((pos - (n - 1)) / np.float32(p.tau))
                sc[: min(p.sinks, n)] = np.inf
                c = min(p.P, n)
                part = np.argpartition(-sc, c - 1)[:c] if c < n else np.arange(n)
                order = part[np.argsort(-sc[part], kind="stable")]
                topk[t, 0, b, s, :c] = order
    model = "synthetic(" + ",".join(f"{k}={v}" for k, v in asdict(p).items()) + ")"
    return Trace(topk, lengths, p.K, [[0]], model, "synthetic", True, {"synth": asdict(p)})


def parse_spec(spec: str) -> SynthParams:
    """``synth[:key=value,...]`` (keys of :class:`SynthParams`) -> params; ``synth:calibrated`` = fit below."""
    body = spec.split(":", 1)[1] if ":" in spec else ""
    p = SynthParams()
    if body.startswith("calibrated"):
        p = CALIBRATED
        body = body[len("calibrated"):].lstrip(",")
    kw = {}
    fields = SynthParams.__dataclass_fields__
    for item in filter(None, body.split(",")):
        if "=" not in item:
            raise ValueError(f"synthetic spec item {item!r} must be key=value")
        k, v = item.split("=", 1)
        if k not in fields:
            raise ValueError(f"unknown synthetic parameter {k!r}; known: {', '.join(fields)}")
        kw[k] = type(getattr(p, k))(v)
    return replace(p, **kw)


def locality(p: SynthParams, warmup: int = 16) -> dict:
    """Adjacent-step reuse at K and fully associative LRU hit rate with an 8K pool."""
    from .sim import simulate

    tr = generate(p)
    adj = simulate(tr, "adjacent", p.K, warmup=warmup).hit_rate
    lru = simulate(tr, "lru", 8192, warmup=warmup).hit_rate
    return {"adjacent": adj, "lru_8k": lru}


def _bisect(p: SynthParams, knob: str, lo: float, hi: float, metric: str, target: float, warmup: int) -> float:
    """Midpoint of ``[lo, hi]`` after 12 halvings towards ``locality(p with knob)[metric] == target``
    (the metric rises with the knob)."""
    for _ in range(12):
        mid = (lo + hi) / 2
        below = locality(replace(p, **{knob: mid}), warmup)[metric] < target
        lo, hi = (mid, hi) if below else (lo, mid)
    return (lo + hi) / 2


def calibrate(base: Optional[SynthParams] = None, iters: int = 10, warmup: int = 16) -> tuple[SynthParams, dict]:
    """Fit ``drift`` (adjacent reuse) and ``skew`` (LRU 8K) by alternating bisection.

    Adjacent reuse rises with drift; the LRU hit rate at fixed adjacent reuse rises with skew (a stable
    popular core recurs after short absences). Returns the params and the achieved locality.
    """
    p = base or SynthParams()
    for _ in range(iters):
        p = replace(p, drift=round(_bisect(p, "drift", 0.0, 0.9999, "adjacent", REF_ADJACENT_K2048, warmup), 5))
        loc = locality(p, warmup)
        if abs(loc["lru_8k"] - REF_LRU_8K) < 0.002 and abs(loc["adjacent"] - REF_ADJACENT_K2048) < 0.002:
            return p, loc
        p = replace(p, skew=round(_bisect(p, "skew", 0.0, 8.0, "lru_8k", REF_LRU_8K, warmup), 4))
        log.info("calibrate: %s -> %s", p, locality(p, warmup))
    return p, locality(p, warmup)


#: Result of ``calibrate(iters=6)`` from the defaults (182 s on 2 cores): adjacent 58.85 %, LRU 8K 90.46 %
#: with ``warmup=16`` (``python -m offload_passes.trace.synth --calibrate`` re-runs it).
CALIBRATED = SynthParams(skew=1.7881, drift=0.53889)


def main(argv=None) -> int:
    """``python -m offload_passes.trace.synth [--calibrate]``: print the calibration table."""
    import argparse
    import json

    from .sim import simulate

    ap = argparse.ArgumentParser(prog="python -m offload_passes.trace.synth", description=main.__doc__)
    ap.add_argument("--calibrate", action="store_true", help="re-fit (skew, drift) instead of using CALIBRATED")
    ap.add_argument("--seeds", type=int, default=3, help="traces (seeds) averaged for the predictions")
    ap.add_argument("--warmup", type=int, default=16)
    a = ap.parse_args(argv)
    p = calibrate(warmup=a.warmup, iters=6)[0] if a.calibrate else CALIBRATED
    rows = []
    cases = [("adjacent-step reuse, K=2048", "adjacent", 2048, REF_ADJACENT_K2048, "fitted"),
             ("LRU, 8K pool", "lru", 8192, REF_LRU_8K, "fitted"),
             ("16-way SA-FIFO, 8K pool", "sa_fifo", 8192, REF_SA_FIFO_8K, "predicted (ref: about 85 %)"),
             ("16-way SA-FIFO, 16K pool", "sa_fifo", 16384, REF_SA_FIFO_16K, "predicted (ref: above 90 %)"),
             ("LRU, 16K pool", "lru", 16384, None, "predicted"),
             ("Belady MIN, 8K pool", "belady", 8192, None, "bound"),
             ("Belady MIN, 16K pool", "belady", 16384, None, "bound")]
    traces = [generate(replace(p, seed=s)) for s in range(a.seeds)]
    for name, pol, ps, ref, kind in cases:
        vals = [simulate(tr, pol, ps, warmup=a.warmup).hit_rate for tr in traces]
        rows.append({"case": name, "policy": pol, "pool": ps, "reference": ref, "ours": float(np.mean(vals)),
                     "min": float(np.min(vals)), "max": float(np.max(vals)), "kind": kind})
    print(json.dumps({"params": asdict(p), "seeds": a.seeds, "warmup": a.warmup, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

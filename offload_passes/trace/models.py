"""An ensemble of structurally different synthetic trace models, each fitted to the reference's two
published locality numbers (adjacent-step reuse 58.85 % at K = 2048, LRU 90.50 % with an 8K pool).

One model fitted to two numbers predicts with its structure as much as with its parameters, so every
prediction of ``offload_passes.trace.study`` is a range over these models (and seeds). All produce
one group, S = 1, one new token per step, ``sinks`` always selected:

* ``score``     — ``synth.generate``: indexer score = static popularity (``skew``) + AR(1) noise with
                  per-step correlation ``drift`` + a recency bonus; top-k of the score (ranked columns).
* ``twoscale``  — the same, but the popularity itself drifts (AR(1), correlation 0.995 per step, a
                  ~140-step half-life): no token is important forever.
* ``churn``     — no score, no popularity: each selected id survives a step with probability ``keep``
                  (memoryless lifetimes); a freed place is refilled, with probability ``ret``, by an id
                  dropped in the last 4 steps (short-term return), else by a uniformly random position;
                  the newest ``recent`` positions are always selected.
* ``segments``  — phase-like locality: the context is cut into 64-token segments, each with a fixed set
                  of 16 "salient" tokens; the top-k is the salient tokens of the active segments; each
                  active segment is replaced with probability ``1 - stay`` per step by a segment drawn
                  from a Zipf(``alpha``) segment popularity (topics come back).

``fit(model)`` finds the two knobs (first: adjacent reuse, second: LRU 8K) by alternating bisection on
warm traces (``steps`` after ``warmup``), the fitted values being in :data:`FITTED`.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from . import synth
from .format import Trace

log = logging.getLogger("offload_passes.trace.models")

MODELS = ("score", "twoscale", "churn", "segments")
#: (knob fitted to adjacent reuse, knob fitted to LRU-8K, their search ranges)
KNOBS = {
    "score": (("drift", 0.0, 0.9999), ("skew", 0.0, 8.0)),
    "twoscale": (("drift", 0.0, 0.9999), ("skew", 0.0, 8.0)),
    "churn": (("keep", 0.0, 1.0), ("ret", 0.0, 1.0)),
    "segments": (("stay", 0.0, 1.0), ("alpha", 0.0, 3.0)),
}
#: ``fit`` results (``python -m offload_passes.trace.study --fit`` re-runs them: 384 steps after a 128-step
#: warm-up per evaluation; the achieved values on long warm traces are in ``docs/trace-science.md`` §2).
FITTED: dict[str, dict[str, float]] = {
    "score": {"drift": 0.5371, "skew": 1.7969},
    "twoscale": {"drift": 0.455, "skew": 2.0469},
    "churn": {"keep": 0.3457, "ret": 0.8379},
    "segments": {"stay": 0.166, "alpha": 1.6348},
}


def generate(model: str, steps: int = 1280, seed: int = 0, context: int = 65536, K: int = 2048,
             P: Optional[int] = None, B: int = 1, params: Optional[dict] = None) -> Trace:
    """A ``[steps, 1, B, 1, P]`` trace of ``model`` (module docstring) with ``params`` (default: FITTED)."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    if steps < 1 or B < 1 or K < 64 or context <= K:
        raise ValueError(f"need steps >= 1, B >= 1, K >= 64, context > K; got {steps}, {B}, {K}, {context}")
    kw = dict(FITTED[model], **(params or {}))
    if model in ("score", "twoscale"):
        p = synth.SynthParams(context=context, steps=steps, B=B, S=1, K=K, P=P or K, seed=seed,
                              pop_drift=0.995 if model == "twoscale" else 1.0,
                              **{k: float(v) for k, v in kw.items()})
        tr = synth.generate(p)
        tr.model = f"{model}({', '.join(f'{k}={v:g}' for k, v in kw.items())})"
        return tr
    if P not in (None, K):
        raise ValueError(f"model {model} has no score: it stores only the top-k (P = K), got P={P}")
    rng = np.random.default_rng(seed)
    gen = _churn if model == "churn" else _segments
    topk = np.full((steps, 1, B, 1, K), -1, dtype=np.int32)
    for b in range(B):
        gen(topk[:, 0, b, 0], context, K, rng, **kw)
    lengths = np.repeat((context + 1 + np.arange(steps, dtype=np.int32))[:, None], B, 1)
    desc = f"{model}({', '.join(f'{k}={v:g}' for k, v in kw.items())})"
    return Trace(topk, lengths, K, [[0]], desc, "synthetic", False, {"synth_model": model, **kw})


def mtp(tr: Trace, S: int = 4, advance: Optional[int] = None) -> Trace:
    """Regroup a one-row-per-step trace into ``S`` query rows per step, as MTP decode runs them (1 + S - 1
    draft tokens share one plan): step ``t``'s row ``s`` is the source's token step ``advance * t + s``
    (``advance`` = tokens accepted per step, default ``S``: every draft accepted, no row repeated), its
    causal limit that token's. Needs ``advance * (steps - 1) + S`` source steps."""
    if tr.S != 1 or len(tr.groups) != 1:
        raise ValueError(f"mtp: needs a one-group S = 1 trace, got S={tr.S}, {len(tr.groups)} groups")
    adv = S if advance is None else advance
    if S < 1 or not 1 <= adv <= S:
        raise ValueError(f"mtp: need S >= 1 and 1 <= advance <= S, got S={S}, advance={adv}")
    T = (tr.steps - S) // adv + 1
    if T < 1:
        raise ValueError(f"mtp: a {tr.steps}-step source is too short for S={S}")
    pos = adv * np.arange(T)[:, None] + np.arange(S)[None, :]               # [T, S] source steps
    topk = np.ascontiguousarray(tr.topk[pos, 0, :, 0].transpose(0, 2, 1, 3)[:, None])  # [T, 1, B, S, P]
    lengths = np.ascontiguousarray(tr.lengths[pos[:, -1]])                  # the last row's cache length
    out = Trace(topk, lengths, tr.K, [[0]], f"{tr.model} mtp(S={S}, advance={adv})", tr.source, tr.ranked,
                {**tr.extra, "mtp_S": S, "mtp_advance": adv})
    return out


def _zipf_cdf(n: int, alpha: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(cdf over popularity ranks, rank -> item permutation): item ``perm[r]`` has weight (r+1)^-alpha."""
    w = (np.arange(1, n + 1, dtype=np.float64)) ** (-alpha)
    return np.cumsum(w) / w.sum(), rng.permutation(n)


def _draw(cdf: np.ndarray, perm: np.ndarray, n: int, taken: np.ndarray, limit: int,
          rng: np.random.Generator) -> np.ndarray:
    """``n`` distinct items ``< limit`` not yet ``taken`` (bool mask), by popularity (rejection)."""
    out: list = []
    need = n
    for _ in range(200):
        if need <= 0:
            break
        cand = perm[np.minimum(np.searchsorted(cdf, rng.random(4 * need + 16)), cdf.size - 1)]
        cand = cand[cand < limit]
        cand = cand[~taken[cand]]
        cand = cand[np.sort(np.unique(cand, return_index=True)[1])][:need]
        taken[cand] = True
        out.append(cand)
        need -= cand.size
    if need > 0:  # a tiny or exhausted range: fill uniformly from what is left
        free = np.flatnonzero(~taken[:limit])
        cand = rng.choice(free, size=min(need, free.size), replace=False)
        taken[cand] = True
        out.append(cand)
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def _churn(out: np.ndarray, context: int, K: int, rng: np.random.Generator, keep: float, ret: float,
           sinks: int = 4, recent: int = 16, span: int = 4) -> None:
    T = out.shape[0]
    Lmax = context + T + 1
    taken = np.zeros(Lmax, dtype=bool)
    core = np.zeros(0, np.int64)
    dropped: list = []   # ids dropped in each of the last ``span`` steps
    n_core = K - sinks - recent
    for t in range(T):
        L = context + t + 1
        lo = L - 1 - recent  # the newest positions are selected anyway
        alive = (rng.random(core.size) < keep) & (core < lo)
        dropped = (dropped + [core[~alive]])[-span:]
        core = core[alive]
        taken[:] = False
        taken[core] = True
        taken[:sinks] = True
        taken[lo:] = True
        need = n_core - core.size
        back = np.concatenate(dropped) if dropped else np.zeros(0, np.int64)
        back = np.unique(back[(back < lo) & ~taken[back]])
        n_back = min(int(rng.binomial(need, ret)), back.size)
        got = rng.choice(back, size=n_back, replace=False) if n_back else np.zeros(0, np.int64)
        taken[got] = True
        fresh = np.flatnonzero(~taken[:lo])
        fresh = rng.choice(fresh, size=min(need - n_back, fresh.size), replace=False)
        core = np.concatenate([core, got, fresh])
        row = np.concatenate([np.arange(sinks), np.arange(lo, L), core])[:K]
        out[t, : row.size] = row


def _segments(out: np.ndarray, context: int, K: int, rng: np.random.Generator, stay: float, alpha: float,
              sinks: int = 4, recent: int = 16, seg: int = 64, salient: int = 16) -> None:
    T = out.shape[0]
    Lmax = context + T + 1
    nseg = Lmax // seg
    cdf, perm = _zipf_cdf(nseg, alpha, rng)
    # fixed salient offsets per segment
    offs = np.argsort(rng.random((nseg, seg)), axis=1)[:, :salient]
    n_act = -(-(K - sinks - recent) // salient)  # enough segments to fill K (the last one truncated)
    taken = np.zeros(nseg, dtype=bool)
    act = np.zeros(0, np.int64)
    for t in range(T):
        L = context + t + 1
        lo = L - 1 - recent
        limit = lo // seg  # whole segments before the recent window
        act = act[(rng.random(act.size) < stay) & (act < limit)]
        taken[:] = False
        taken[act] = True
        taken[0] = True  # segment 0 holds the sinks
        act = np.concatenate([act, _draw(cdf, perm, n_act - act.size, taken, limit, rng)])
        toks = (act[:, None] * seg + offs[act]).ravel()
        row = np.concatenate([np.arange(sinks), np.arange(lo, L), toks])[:K]
        out[t, : row.size] = row


def locality(model: str, params: dict, steps: int = 384, warmup: int = 128, seed: int = 0) -> dict:
    """Adjacent-step reuse at K and LRU hit rate with an 8K pool on a warm trace."""
    from .sim import simulate

    tr = generate(model, steps=steps + warmup, seed=seed, params=params)
    return {"adjacent": simulate(tr, "adjacent", tr.K, warmup=warmup).hit_rate,
            "lru_8k": simulate(tr, "lru", 8192, warmup=warmup).hit_rate}


def fit(model: str, rounds: int = 3, halvings: int = 8, steps: int = 384, warmup: int = 128,
        start: Optional[dict] = None) -> tuple[dict, dict]:
    """Alternating bisection of the two knobs of ``model`` (both metrics rise with their knob)."""
    (ka, alo, ahi), (kb, blo, bhi) = KNOBS[model]
    p = dict(start or FITTED[model])
    for _ in range(rounds):
        for knob, lo, hi, metric, target in ((ka, alo, ahi, "adjacent", synth.REF_ADJACENT_K2048),
                                             (kb, blo, bhi, "lru_8k", synth.REF_LRU_8K)):
            for _ in range(halvings):
                mid = (lo + hi) / 2
                below = locality(model, {**p, knob: mid}, steps, warmup)[metric] < target
                lo, hi = (mid, hi) if below else (lo, mid)
            p[knob] = round((lo + hi) / 2, 4)
        loc = locality(model, p, steps, warmup)
        log.info("fit %s: %s -> %s", model, p, loc)
        if abs(loc["adjacent"] - synth.REF_ADJACENT_K2048) < 0.003 and abs(loc["lru_8k"] - synth.REF_LRU_8K) < 0.003:
            break
    return p, locality(model, p, steps, warmup)


__all__ = ["MODELS", "FITTED", "KNOBS", "generate", "fit", "locality", "mtp"]

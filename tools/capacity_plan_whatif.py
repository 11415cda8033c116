"""``offload-capacity --what-if``: a per-step latency model of GLM-5.2 decode on Atlas A3, fitted to the
reference's latency table, then used to predict other pool sizes, policies, batches and contexts.

Model (one rank = one 910C die; attention data-parallel, so every rank runs ``b = batch / ranks`` rows):

    T_no_offload = A_m + b * t_row
    T_offload    = A_m + b * t_row + b * t_serve(h) + O_m + H(b, h) * row_bytes / BW_h2d

* ``t_row``: HBM time one decode row adds per step: sparse attention reading its ``S*K`` selected latent
  rows in every layer plus the lightning indexer reading ``context`` keys in every full layer (the
  production int8 key cache and its fp16 per-token scale), at the die's HBM bandwidth. Public constants
  only (not fitted).
* ``t_serve(h)``: the extra HBM traffic of the offload path per row: ``dsa_serve`` writes the selection
  buffer (``S*K`` rows per layer) and reads the pool for hits; ``dsa_install`` copies the misses into the
  pool (read + write). Public constants only.
* ``H(b, h) = b * S * K * (1 - h) * layers``: rows read from host per step (every layer serves the same
  plan from its own host cache), ``row_bytes = (kv_lora_rank + rope) * 2``.
* Fitted: ``A_m`` (everything batch-independent: weights, MoE, communication, per exec mode ``m``) from the
  no-offload latency; ``O_m`` (plan / install launch + synchronisation per step, per mode) and one
  effective host-to-device rate ``BW_h2d`` shared by both modes, by least squares on the four offload
  latencies, *physically constrained*: ``O_m >= 0`` and ``BW_h2d <=`` the PCIe 5.0 x16 ceiling (bounded
  least squares when the free optimum leaves that region); a fit whose host time would be negative, or
  that misses a reference latency by more than ``tol_pct`` inside the region, is refused.
* One set of hit rates for fit and prediction: each member of the trace ensemble
  (``offload_passes.trace.study.ensemble_hits``: every trace model x seed, long warm traces) gives its
  own SA-FIFO 8K / 16K rates to the fit and its own policy rates to the predictions; every prediction is
  the range over members. Validation is computed per member: leave-one-out over the four offload
  latencies and cross-mode (fit on one exec mode, predict the other's offload latencies).

Every hardware constant is a :data:`CONSTANTS` entry with its public source.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Sequence

from offload_passes.custom_ops._pool import pool_size_problem

try:  # package import (console script) or flat import (python tools/capacity_plan.py)
    from .capacity_plan_budget import MAX_BATCH
except ImportError:  # pragma: no cover - only when run as a loose script
    from capacity_plan_budget import MAX_BATCH  # type: ignore

log = logging.getLogger("offload_passes.tools.capacity_plan_whatif")

#: name -> (value, unit, public source)
CONSTANTS: dict[str, tuple[float, str, str]] = {
    "hbm_bw_chip": (3.2e12, "B/s", "Ascend 910C: 8 HBM2E stacks, 3,200 GB/s per chip (TechPowerUp, "
                    "'Huawei Prepares 6 nm Ascend 920C', 2025-04-21, quoting DigiTimes)"),
    "dies_per_chip": (2, "", "Ascend 910C is a dual-die package; recipe yaml: world_size = 2 * chip_num on A3 "
                      "(hicann/cann-recipes-infer glm_5_2_rank_32_32ep_w8a8_offload_mtp.yaml)"),
    "pcie5_x16": (64e9, "B/s", "PCIe 5.0 x16 per direction, 32 GT/s x 16 lanes, 128b/130b (PCI-SIG PCIe 5.0 "
                  "base specification); for comparison with the fitted effective host rate only"),
}

#: The reference's latency table (hicann/cann-recipes-infer docs/models/glm_5_2/glm_5_2_offload_guide.md):
#: GLM-5.2 W8A8, 2 x Atlas A3 (16 chips, 32 ranks), 64K context, MTP3, ms per decode step.
REFERENCE = [
    # (mode, offload, pool, global batch, ms)
    ("ge_graph", False, 0, 64, 71.21),
    ("ge_graph", True, 8192, 128, 100.55),
    ("ge_graph", True, 16384, 128, 92.03),
    ("npugraph_ex", False, 0, 64, 71.59),
    ("npugraph_ex", True, 8192, 128, 105.04),
    ("npugraph_ex", True, 16384, 128, 95.67),
]
#: Hit rates the reference states for its 16-way SA-FIFO pool (same guide): about 85 % (8K), above 90 % (16K).
REFERENCE_HIT = {8192: 0.85, 16384: 0.90}


@dataclass(frozen=True)
class Shape:
    layers: int = 78
    full_layers: int = 21         # IndexShare groups (one indexer each)
    kv_row: int = 512 + 64        # latent + rope elements per token
    kv_bytes: int = 2             # 16-bit KV cache (W8A8C16)
    index_dim: int = 128
    index_bytes: int = 1          # int8 indexer key cache (li_cache_quant_mode: int8, docs/models.md)
    index_scale_bytes: int = 2    # + one fp16 dequant scale per token
    K: int = 2048
    S: int = 4                    # 1 + next_n (MTP3)
    ranks: int = 32
    context: int = 65536

    @property
    def row_bytes(self) -> int:
        return self.kv_row * self.kv_bytes


#: The reference's measured 8K-minus-16K latency per exec mode (batch 128, 64K; from :data:`REFERENCE`).
REFERENCE_DELTA_MS = {m: round(next(ms for mm, off, ps, _, ms in REFERENCE if mm == m and off and ps == 8192)
                               - next(ms for mm, off, ps, _, ms in REFERENCE if mm == m and off and ps == 16384), 2)
                      for m in ("ge_graph", "npugraph_ex")}


def anchored_ms(h: float, h16: float, h8: float = REFERENCE_HIT[8192], mode: str = "ge_graph") -> float:
    """Latency of a pool with hit rate ``h`` minus the reference's SA-FIFO 16K latency, ms per step at the
    reference's batch 128, 64K, anchored on the measured difference (:data:`REFERENCE_DELTA_MS`).

    At fixed mode and batch the model's latency is affine in the hit rate with a slope that does not
    depend on the pool (``t_serve`` and ``host_rows`` are linear in ``h``; ``A_m``, ``O_m`` are shared), so
    ``T(h) - T(h16) = delta * (h16 - h) / (h16 - h8)`` whatever the fitted constants: the only unknowns are
    the real SA-FIFO rates ``h8`` (stated ≈ 85 %) and ``h16`` (stated > 90 %), and the answer "does a
    policy at 8K reach the 16K-FIFO latency" is ``h >= h16``. Raises ``ValueError`` unless
    ``0 <= h8 < h16 <= 1``."""
    if mode not in REFERENCE_DELTA_MS:
        raise ValueError(f"mode must be one of {', '.join(REFERENCE_DELTA_MS)}, got {mode!r}")
    if not 0.0 <= h8 < h16 <= 1.0:
        raise ValueError(f"need 0 <= h8 < h16 <= 1 (SA-FIFO 8K / 16K hit rates), got h8={h8}, h16={h16}")
    if not 0.0 <= h <= 1.0:
        raise ValueError(f"hit rate must be in [0, 1], got {h}")
    return REFERENCE_DELTA_MS[mode] * (h16 - h) / (h16 - h8)


def hbm_bw_rank() -> float:
    return CONSTANTS["hbm_bw_chip"][0] / CONSTANTS["dies_per_chip"][0]


def t_row(s: Shape) -> float:
    """Seconds of HBM traffic one decode row adds per step without offload."""
    attn = s.layers * s.S * s.K * s.row_bytes
    indexer = s.full_layers * s.context * (s.index_dim * s.index_bytes + s.index_scale_bytes)
    return (attn + indexer) / hbm_bw_rank()


def t_serve(s: Shape, h: float) -> float:
    """Extra HBM seconds per row per step of the offload path (serve write + pool read + install)."""
    rows = s.layers * s.S * s.K
    serve = rows * s.row_bytes * (1 + h)           # write selection; read pool for hits
    install = rows * (1 - h) * s.row_bytes * 2     # copy misses selection -> pool
    return (serve + install) / hbm_bw_rank()


def host_rows(s: Shape, b: float, h: float) -> float:
    return b * s.S * s.K * (1 - h) * s.layers


class NonPhysicalFit(RuntimeError):
    """The reference latencies cannot be fitted with physical parameters for the given hit rates."""


@dataclass
class Fit:
    A: dict
    O: dict
    bw_h2d: float
    residuals: list
    constrained: list = field(default_factory=list)   # bounds active in the fit ("O[ge_graph] = 0", ...)
    free: dict = field(default_factory=dict)           # the unconstrained optimum, for the record

    def latency(self, mode: str, shape: Shape, batch: int, offload: bool, h: float = 0.0) -> float:
        b = batch / shape.ranks
        t = self.A[mode] + b * t_row(shape)
        if offload:
            t += b * t_serve(shape, h) + self.O[mode] + host_rows(shape, b, h) * shape.row_bytes / self.bw_h2d
        return t


def _ceiling() -> float:
    return CONSTANTS["pcie5_x16"][0]


def fit(shape: Optional[Shape] = None, hits: Optional[dict] = None, points: Optional[Sequence[tuple]] = None,
        tol_pct: float = 5.0, o_modes: Optional[dict] = None) -> Fit:
    """Physically constrained fit of ``A_m``, ``O_m`` (per mode) and ``BW_h2d`` (shared) to ``points``
    (default :data:`REFERENCE`) with SA-FIFO hit rates ``hits`` ``{pool: h}`` (default: the reference's
    stated 85 % / 90 %). ``o_modes`` maps a mode without offload points to the mode whose ``O`` it borrows
    (cross-mode validation). Raises :class:`NonPhysicalFit` (module docstring)."""
    import numpy as np
    from scipy.optimize import lsq_linear

    s = shape or Shape()
    hits = hits or REFERENCE_HIT
    pts = list(points or REFERENCE)
    A = {m: ms * 1e-3 - batch / s.ranks * t_row(s) for m, off, _, batch, ms in pts if not off}
    off_pts = [p for p in pts if p[1]]
    modes = sorted({m for m, *_ in off_pts})
    for m, *_ in off_pts:
        if m not in A:
            raise ValueError(f"what-if fit: mode {m} has offload points but no no-offload point")
    rows, rhs = [], []
    for m, _, ps, batch, ms in off_pts:
        if ps not in hits:
            raise ValueError(f"what-if fit: no hit rate for pool {ps}")
        b, h = batch / s.ranks, hits[ps]
        rows.append([1.0 if m == mm else 0.0 for mm in modes] + [host_rows(s, b, h) * s.row_bytes])
        rhs.append(ms * 1e-3 - A[m] - b * t_row(s) - b * t_serve(s, h))
    M, y = np.array(rows), np.array(rhs)
    sol = np.linalg.lstsq(M, y, rcond=None)[0]
    free = {"O_ms": {m: float(sol[i]) * 1e3 for i, m in enumerate(modes)},
            "bw_h2d_GBps": float(1 / sol[-1] / 1e9) if sol[-1] > 0 else None}
    if sol[-1] <= 0:
        raise NonPhysicalFit(f"what-if fit: non-physical: the host transfer time per row comes out "
                             f"{sol[-1] * 1e9:.3g} ns <= 0 with hit rates {hits} (more hits would cost time)")
    lb = np.array([0.0] * len(modes) + [1.0 / _ceiling()])
    active = []
    if (sol < lb).any():
        sol = lsq_linear(M, y, bounds=(lb, np.full(lb.size, np.inf)), method="bvls").x
        active = [f"O[{m}] = 0" for i, m in enumerate(modes) if sol[i] <= 1e-12]
        if sol[-1] <= lb[-1] * (1 + 1e-9):
            active.append(f"BW_h2d = PCIe 5.0 x16 ceiling {_ceiling() / 1e9:.0f} GB/s")
    O = {m: float(sol[i]) for i, m in enumerate(modes)}
    for m, src in (o_modes or {}).items():
        O[m] = O[src]
    f = Fit(dict(A), O, float(1 / sol[-1]), [], active, free)
    for m, off, ps, batch, ms in pts:
        pred = f.latency(m, s, batch, off, hits.get(ps, 0.0)) * 1e3
        f.residuals.append({"mode": m, "offload": off, "pool": ps, "batch": batch, "reference_ms": ms,
                            "model_ms": round(pred, 2), "error_pct": round(100 * (pred - ms) / ms, 2)})
    worst = max(abs(r["error_pct"]) for r in f.residuals)
    if worst > tol_pct:
        raise NonPhysicalFit(f"what-if fit: non-physical: no physical parameters (O >= 0, BW_h2d <= "
                             f"{_ceiling() / 1e9:.0f} GB/s) fit the reference within {tol_pct:g} % with hit rates "
                             f"{hits} (worst error {worst:.1f} %; active bounds: {', '.join(active) or 'none'})")
    return f


def validate(shape: Optional[Shape] = None, hits: Optional[dict] = None) -> dict:
    """Out-of-sample errors (%), computed: leave-one-out over the offload latencies, and cross-mode (fit
    one mode's three latencies, predict the other mode's offload latencies with its own ``A``)."""
    s = shape or Shape()
    hits = hits or REFERENCE_HIT
    loo = []
    for i, (m, off, ps, batch, ms) in enumerate(REFERENCE):
        if not off:
            continue
        rest = [p for j, p in enumerate(REFERENCE) if j != i]
        try:
            f = fit(s, hits, rest, tol_pct=float("inf"))
            pred = f.latency(m, s, batch, True, hits[ps]) * 1e3
            loo.append({"mode": m, "pool": ps, "reference_ms": ms, "model_ms": round(pred, 2),
                        "error_pct": round(100 * (pred - ms) / ms, 2)})
        except NonPhysicalFit as e:
            loo.append({"mode": m, "pool": ps, "reference_ms": ms, "model_ms": None, "error_pct": None,
                        "refused": str(e)})
    cross = []
    modes = sorted({m for m, *_ in REFERENCE})
    for src in modes:
        for dst in modes:
            if dst == src:
                continue
            pts = [p for p in REFERENCE if p[0] == src or (p[0] == dst and not p[1])]
            try:
                f = fit(s, hits, pts, tol_pct=float("inf"), o_modes={dst: src})
            except NonPhysicalFit as e:
                cross.append({"fit": src, "predict": dst, "refused": str(e)})
                continue
            for m, off, ps, batch, ms in REFERENCE:
                if m == dst and off:
                    pred = f.latency(m, s, batch, True, hits[ps]) * 1e3
                    cross.append({"fit": src, "predict": dst, "pool": ps, "reference_ms": ms,
                                  "model_ms": round(pred, 2), "error_pct": round(100 * (pred - ms) / ms, 2)})
    errs = [abs(r["error_pct"]) for r in loo if r["error_pct"] is not None]
    xerrs = [abs(r["error_pct"]) for r in cross if r.get("error_pct") is not None]
    return {"leave_one_out": loo, "cross_mode": cross,
            "loo_max_abs_pct": max(errs) if errs else None, "cross_mode_max_abs_pct": max(xerrs) if xerrs else None}


def pool_bytes_per_rank(shape: Shape, pool: int, batch: int) -> float:
    """HBM the KV pools take per rank: every layer keeps a pool of ``pool`` rows per batch row."""
    return pool * batch / shape.ranks * shape.layers * shape.row_bytes


def _spread(vals: list) -> dict:
    import numpy as np

    v = np.array(vals, dtype=float)
    return {"median": round(float(np.median(v)), 2), "min": round(float(v.min()), 2), "max": round(float(v.max()), 2)}


def what_if(batches: Sequence[int], pools: Sequence[int], policies: Sequence[str], contexts: Sequence[int],
            mode: str = "ge_graph", seeds: int = 2, steps: int = 1152, warmup: int = 384,
            models: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Fit and predict per ensemble member (module docstring); ranges over members."""
    from offload_passes.trace import models as tmodels
    from offload_passes.trace import study

    which = list(models or tmodels.MODELS)
    fit_pools = sorted({r[2] for r in REFERENCE if r[1]})
    base = Shape()
    by_ctx = {}
    for ctx in contexts:
        pols = sorted(set(policies) | ({"sa_fifo"} if ctx == base.context else set()))
        pls = sorted(set(pools) | (set(fit_pools) if ctx == base.context else set()))
        by_ctx[ctx] = study.ensemble_hits(pols, pls, seeds, steps, warmup, ctx, which)
    if base.context not in by_ctx:
        by_ctx[base.context] = study.ensemble_hits(["sa_fifo"], fit_pools, seeds, steps, warmup, base.context, which)
    members = []
    for i, mem in enumerate(by_ctx[base.context]):
        fh = {ps: mem["hits"][("sa_fifo", ps)] for ps in fit_pools}
        entry = {"model": mem["model"], "seed": mem["seed"], "fit_hits": fh}
        try:
            f = fit(base, fh)
        except NonPhysicalFit as e:
            entry["refused"] = str(e)
            members.append(entry)
            continue
        v = validate(base, fh)
        entry.update(fit=f, validation=v, residuals=f.residuals, A_ms={k: round(x * 1e3, 3) for k, x in f.A.items()},
                     O_ms={k: round(x * 1e3, 3) for k, x in f.O.items()}, bw_h2d_GBps=round(f.bw_h2d / 1e9, 2),
                     constrained=f.constrained, free=f.free, idx=i)
        members.append(entry)
    ok = [m for m in members if "fit" in m]
    if not ok:
        raise NonPhysicalFit("what-if: every ensemble member's fit was refused: " + members[0]["refused"])
    loo = max(m["validation"]["loo_max_abs_pct"] or 0.0 for m in ok)
    rows = []
    for ctx in contexts:
        s = replace(base, context=ctx)
        for batch in batches:
            t0 = [m["fit"].latency(mode, s, batch, False) * 1e3 for m in ok]
            rows.append({"context": ctx, "batch": batch, "policy": "no offload", "pool": 0, "hit": None,
                         "ms": _spread(t0)})
            for pol in policies:
                for ps in pools:
                    hs, ts = [], []
                    for m in ok:
                        h = by_ctx[ctx][m["idx"]]["hits"].get((pol, ps))
                        if h is None:  # a policy that needs ranks beyond K on a model without scores
                            continue
                        hs.append(h)
                        ts.append(m["fit"].latency(mode, s, batch, True, h) * 1e3)
                    if not ts:
                        continue
                    sp = _spread(ts)
                    rows.append({"context": ctx, "batch": batch, "policy": pol, "pool": ps,
                                 "hit": {k: round(v / 100, 4) for k, v in _spread([100 * h for h in hs]).items()},
                                 "ms": sp, "ms_interval_with_loo": [round(sp["min"] * (1 - loo / 100), 2),
                                                                    round(sp["max"] * (1 + loo / 100), 2)],
                                 "members": len(ts)})
    question = _question(ok, by_ctx.get(base.context), policies, pools, mode, base)
    for m in members:
        m.pop("fit", None)
        m.pop("idx", None)
        m["fit_hits"] = {str(k): round(v, 4) for k, v in m["fit_hits"].items()}
    return {"mode": mode, "ensemble": {"models": which, "seeds": seeds, "steps": steps, "warmup": warmup},
            "members": members, "loo_max_abs_pct": loo,
            "cross_mode_max_abs_pct": max(m["validation"]["cross_mode_max_abs_pct"] or 0.0 for m in ok),
            "t_row_ms": round(t_row(base) * 1e3, 4), "t_serve_ms_at_85pct": round(t_serve(base, 0.85) * 1e3, 4),
            "constants": {k: {"value": v, "unit": u, "source": src} for k, (v, u, src) in CONSTANTS.items()},
            "shape": asdict(base), "rows": rows, "question": question,
            "note": "hit rates: one set per ensemble member (trace model x seed; S=1 traces, batch rows "
                    "independent) for both the fit (SA-FIFO 8K/16K) and the predictions; ms = median (min-max) "
                    "over members; ms_interval_with_loo widens that range by the largest leave-one-out error; "
                    "a latency model only: whether a batch fits in HBM is offload-capacity's question"}


def _question(ok: list, hits64: Optional[list], policies: Sequence[str], pools: Sequence[int], mode: str,
              s: Shape, batch: int = 128) -> Optional[dict]:
    """At ``batch``, 64K: which (pool, policy) reach the 16K SA-FIFO latency, and the pool HBM each saves."""
    if hits64 is None or s.context != 65536:
        return None
    out = []
    for pol in policies:
        for ps in pools:
            if ps >= 16384 and pol == "sa_fifo":
                continue
            reach, delta = 0, []
            for m in ok:
                hp = hits64[m["idx"]]["hits"]
                if (pol, ps) not in hp or ("sa_fifo", 16384) not in hp:
                    continue
                ref = m["fit"].latency(mode, s, batch, True, hp[("sa_fifo", 16384)])
                t = m["fit"].latency(mode, s, batch, True, hp[(pol, ps)])
                delta.append((t - ref) * 1e3)
                reach += t <= ref
            if not delta:
                continue
            saved = pool_bytes_per_rank(s, 16384, batch) - pool_bytes_per_rank(s, ps, batch)
            out.append({"policy": pol, "pool": ps, "members_reaching": reach, "members": len(delta),
                        "ms_vs_fifo16k": _spread(delta), "pool_gib_saved_per_rank": round(saved / 2**30, 3)})
    return {"batch": batch, "context": 65536, "target": "sa_fifo 16K", "pairs": out}


def render(o: dict) -> str:
    e = o["ensemble"]
    lines = [f"what-if: per-step latency model, one fit per ensemble member ({', '.join(e['models'])} x "
             f"{e['seeds']} seeds, {e['steps']} steps after {e['warmup']} warm-up)",
             f"  t_row = {o['t_row_ms']} ms/row, t_serve(h=0.85) = {o['t_serve_ms_at_85pct']} ms/row; PCIe 5.0 x16 "
             f"ceiling {CONSTANTS['pcie5_x16'][0] / 1e9:.0f} GB/s",
             f"  {'member':<14}{'h8K %':>7}{'h16K %':>8}{'O_ge ms':>9}{'O_npu ms':>9}{'H2D GB/s':>9}{'fit err %':>10}"
             f"{'LOO err %':>10}{'x-mode %':>9}  bounds"]
    for m in o["members"]:
        name = f"{m['model']}/{m['seed']}"
        h = m["fit_hits"]
        if "refused" in m:
            lines.append(f"  {name:<14}{100 * h['8192']:>7.2f}{100 * h['16384']:>8.2f}  refused: {m['refused']}")
            continue
        v = m["validation"]
        fe = max(abs(r["error_pct"]) for r in m["residuals"])
        lines.append(f"  {name:<14}{100 * h['8192']:>7.2f}{100 * h['16384']:>8.2f}{m['O_ms']['ge_graph']:>9.2f}"
                     f"{m['O_ms']['npugraph_ex']:>9.2f}{m['bw_h2d_GBps']:>9.2f}{fe:>10.2f}{v['loo_max_abs_pct']:>10.2f}"
                     f"{v['cross_mode_max_abs_pct']:>9.2f}  {', '.join(m['constrained']) or '-'}")
    lines += ["", f"  predictions ({o['mode']}; ms = median (min-max over members); LOO-widened interval):",
              f"  {'context':>8}{'batch':>7}  {'policy':<22}{'pool':>7}{'hit %':>18}{'ms/step':>22}{'interval':>18}"]
    for r in o["rows"]:
        hh = r["hit"]
        hit = "" if hh is None else f"{100 * hh['median']:.2f} ({100 * hh['min']:.1f}-{100 * hh['max']:.1f})"
        ms = r["ms"]
        iv = "" if "ms_interval_with_loo" not in r else \
            f"[{r['ms_interval_with_loo'][0]:.1f}, {r['ms_interval_with_loo'][1]:.1f}]"
        lines.append(f"  {r['context']:>8}{r['batch']:>7}  {r['policy']:<22}{r['pool']:>7}{hit:>18}"
                     f"{ms['median']:>10.2f} ({ms['min']:.2f}-{ms['max']:.2f}){iv:>18}")
    q = o.get("question")
    if q:
        lines += ["", f"  batch {q['batch']}, 64K: who reaches {q['target']}'s latency "
                      "(per member, same hit-rate set):"]
        for p in q["pairs"]:
            d = p["ms_vs_fifo16k"]
            lines.append(f"    {p['policy']:<22}{p['pool']:>7}: {p['members_reaching']}/{p['members']} members; "
                         f"{d['median']:+.2f} ms ({d['min']:+.2f} to {d['max']:+.2f}); saves "
                         f"{p['pool_gib_saved_per_rank']:.2f} GiB pool HBM per rank")
    lines.append("  constants:")
    for k, (v, u, src) in CONSTANTS.items():
        lines.append(f"    {k} = {v:g} {u}: {src}")
    lines.append("  note: " + o["note"])
    return "\n".join(lines)


def h16_consistency(h16s: Sequence[float], h8: float = REFERENCE_HIT[8192]) -> list[dict]:
    """For each candidate real SA-FIFO 16K rate: the fit's worst in-sample error and its parameters, or its
    refusal — which 16K rates the reference's latency table allows."""
    out = []
    for h16 in h16s:
        try:
            f = fit(hits={8192: h8, 16384: h16}, tol_pct=float("inf"))
        except NonPhysicalFit as e:
            out.append({"h16": h16, "refused": " ".join(str(e).split())})
            continue
        out.append({"h16": h16, "worst_error_pct": max(abs(r["error_pct"]) for r in f.residuals),
                    "O_ms": {k: round(v * 1e3, 2) for k, v in f.O.items()}, "bw_h2d_GBps": round(f.bw_h2d / 1e9, 1),
                    "constrained": f.constrained, "ms_per_point": round(REFERENCE_DELTA_MS["ge_graph"] / (100 * (h16 - h8)), 3)})
    return out


def consistency_table(h16s: Sequence[float], h8: float = REFERENCE_HIT[8192]) -> list[str]:
    """Markdown rows of :func:`h16_consistency`: how well each candidate real 16K rate fits the reference."""
    out = ["| real SA-FIFO 16K rate | worst fit error | O ge_graph / npugraph_ex ms | host GB/s | bounds active | "
           "ms per hit-rate point (ge_graph) |", "|---|---|---|---|---|---|"]
    for r in h16_consistency(h16s, h8):
        if "refused" in r:
            out.append(f"| {100 * r['h16']:.1f} % | refused: {r['refused']} | | | | |")
            continue
        out.append(f"| {100 * r['h16']:.1f} % | {r['worst_error_pct']:.2f} % | {r['O_ms']['ge_graph']:.2f} / "
                   f"{r['O_ms']['npugraph_ex']:.2f} | {r['bw_h2d_GBps']:.1f} | {', '.join(r['constrained']) or '–'} | "
                   f"{r['ms_per_point']:.3f} |")
    return out


def anchored_table(study: dict, h16s: Sequence[float], h8: float = REFERENCE_HIT[8192], pool: int = 8192,
                   mode: str = "ge_graph") -> list[str]:
    """Markdown rows: each policy of a policy-study result (``python -m offload_passes.trace.study
    --json``) at ``pool``, its hit rate on the models consistent with the reference's SA-FIFO 8K, and its
    latency minus the 16K-FIFO latency for each candidate real 16K rate (:func:`anchored_ms`; the
    consistent models' mean, with the range over their members)."""
    head = ["| policy | hit % at " + f"{pool // 1024}K (consistent models) | "
            + " | ".join(f"h16 = {100 * h:.1f} %" for h in h16s) + " |",
            "|---|---|" + "---|" * len(h16s)]
    rows = []
    for r in study.get("policies", []):
        if r["pool"] != pool or not r.get("hit_consistent"):
            continue
        hc = r["hit_consistent"]
        cells = []
        for h16 in h16s:
            lo, mid, hi = (anchored_ms(min(x, 1.0), h16, h8, mode) for x in (hc["max"], hc["mean"], hc["min"]))
            cells.append(f"{mid:+.2f} ({lo:+.2f} to {hi:+.2f})")
        rows.append(f"| {r['policy']} | {_pct_rng(hc)} | " + " | ".join(cells) + " |")
    return head + rows


def _pct_rng(r: dict) -> str:
    return f"{100 * r['mean']:.2f} ({100 * r['min']:.2f}–{100 * r['max']:.2f})"


def predict_trace(tr: Any, policy: str, pool: int, batch: int = 128, mode: str = "ge_graph", warmup: int = 0,
                  h8: Optional[float] = None, h16: Optional[float] = None) -> dict:
    """A recorded (or synthetic) trace -> the per-step latency of ``policy`` with ``pool`` slots.

    Hit rates come from the trace (``offload-sim``'s C++ core, or :mod:`offload_passes.trace.setsim` for
    the study's variants): the policy's, and SA-FIFO's at 8K and 16K, which stand in for the real FIFO
    rates unless ``h8`` / ``h16`` are given. Two predictions: ``anchored`` (batch 128, 64K — the
    difference to the reference's SA-FIFO 16K latency, :func:`anchored_ms`, no fitted constant) and
    ``model`` (``batch``: :func:`fit` on the FIFO rates, then the latency at the policy's rate; None with
    the reason when that fit is refused)."""
    from offload_passes.trace import study

    if not study.known_policy(policy):
        raise ValueError(f"--policy: unknown {policy!r}")
    hit = study.run_policy(tr, policy, pool, warmup)["hit"]
    f8 = study.run_policy(tr, "sa_fifo", 8192, warmup)["hit"] if h8 is None else h8
    f16 = study.run_policy(tr, "sa_fifo", 16384, warmup)["hit"] if h16 is None else h16
    o: dict = {"policy": policy, "pool": pool, "batch": batch, "mode": mode, "warmup": warmup, "hit": round(hit, 6),
               "fifo_hits": {"8192": round(f8, 6), "16384": round(f16, 6)},
               "fifo_hits_from": "given" if h8 is not None or h16 is not None else "trace"}
    ref16 = next(ms for m, off, ps, _, ms in REFERENCE if m == mode and off and ps == 16384)
    try:
        d = anchored_ms(hit, f16, f8, mode)
        o["anchored"] = {"batch": 128, "context": 65536, "ms_vs_fifo16k": round(d, 3), "ms": round(ref16 + d, 2),
                         "ms_vs_fifo8k": round(d - REFERENCE_DELTA_MS[mode], 3),
                         "ms_per_point": round(REFERENCE_DELTA_MS[mode] / (100 * (f16 - f8)), 4),
                         "reaches_fifo16k": hit >= f16}
    except ValueError as e:
        o["anchored"] = None
        o["anchored_refused"] = str(e)
    try:
        fm = fit(hits={8192: f8, 16384: f16})
        s = Shape()
        o["model"] = {"ms": round(fm.latency(mode, s, batch, True, hit) * 1e3, 2),
                      "fifo16k_ms": round(fm.latency(mode, s, batch, True, f16) * 1e3, 2),
                      "no_offload_ms": round(fm.latency(mode, s, batch, False) * 1e3, 2),
                      "O_ms": round(fm.O[mode] * 1e3, 2), "bw_h2d_GBps": round(fm.bw_h2d / 1e9, 1),
                      "constrained": fm.constrained}
    except NonPhysicalFit as e:
        o["model"] = None
        o["model_refused"] = " ".join(str(e).split())
    return o


def render_trace(o: dict) -> str:
    f = o["fifo_hits"]
    lines = [f"trace -> latency: {o['policy']} with a {o['pool']}-slot pool: hit rate {100 * o['hit']:.2f} %; "
             f"SA-FIFO 8K / 16K {100 * f['8192']:.2f} / {100 * f['16384']:.2f} % ({o['fifo_hits_from']})"]
    a = o["anchored"]
    if a is None:
        lines.append(f"  anchored: not computed ({o['anchored_refused']})")
    else:
        lines.append(f"  anchored on the reference's measured 8K-16K difference ({o['mode']}, batch 128, 64K): "
                     f"{a['ms']:.2f} ms/step, {a['ms_vs_fifo16k']:+.2f} ms vs SA-FIFO 16K, "
                     f"{a['ms_vs_fifo8k']:+.2f} ms vs SA-FIFO 8K ({a['ms_per_point']:.3f} ms per hit-rate point); "
                     + ("reaches" if a["reaches_fifo16k"] else "does not reach") + " the 16K-FIFO latency")
    m = o["model"]
    if m is None:
        lines.append(f"  model (batch {o['batch']}): not computed ({o['model_refused']})")
    else:
        lines.append(f"  model fitted on these FIFO rates ({o['mode']}, batch {o['batch']}, 64K): {m['ms']:.2f} ms/step "
                     f"(SA-FIFO 16K {m['fifo16k_ms']:.2f}, no offload {m['no_offload_ms']:.2f}; O = {m['O_ms']:.2f} ms, "
                     f"host {m['bw_h2d_GBps']:.1f} GB/s{'; ' + ', '.join(m['constrained']) if m['constrained'] else ''})")
    return "\n".join(lines)


#: CLI limits (the synthetic traces are generated per context: a context of 1e11 would allocate terabytes)
MAX_CONTEXT = 1 << 20
MAX_SEEDS = 16
MAX_STEPS = 100000


def _parser() -> argparse.ArgumentParser:
    from offload_passes import _cli

    ap = _cli.ArgumentParser(prog="offload-capacity --what-if", description=__doc__.split("\n\n")[0])
    ap.add_argument("--what-if", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batches", type=_cli.ints_arg("--batches", 1), default=[64, 128, 192],
                    help="global batches (32 ranks)")
    ap.add_argument("--pools", type=_cli.ints_arg("--pools", 1), default=[4096, 8192, 16384])
    ap.add_argument("--policies", default="sa_fifo,sa_clock,sa_lru,lru,min_per_set,belady")
    ap.add_argument("--contexts", type=_cli.ints_arg("--contexts", 1), default=[65536])
    ap.add_argument("--mode", choices=("ge_graph", "npugraph_ex"), default="ge_graph")
    ap.add_argument("--seeds", type=_cli.int_arg("--seeds"), default=2, help="traces per trace model")
    ap.add_argument("--steps", type=_cli.int_arg("--steps"), default=1152,
                    help="measured steps per trace (after --warmup)")
    ap.add_argument("--warmup", type=_cli.int_arg("--warmup"), default=None,
                    help="steps left out of every hit rate (default: 384 for the ensemble, 0 with --trace)")
    ap.add_argument("--models", default=None, help="trace models of the ensemble (default: all)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trace", default=None,
                    help="a recorded trace (offload-demo --record-trace, offload-trace record; an existing path is "
                         "always read) or a synthetic spec synth[:calibrated][,key=value...] (offload-sim --help): "
                         "predict the latency of --policy with --pool on it instead of the ensemble study")
    ap.add_argument("--pool", type=_cli.int_arg("--pool"), default=8192, help="with --trace: pool slots per batch row")
    ap.add_argument("--policy", default="sa_fifo", help="with --trace: replacement policy")
    ap.add_argument("--batch", type=_cli.int_arg("--batch"), default=128, help="with --trace: global batch (32 ranks)")
    ap.add_argument("--fifo8k-hit", type=float, default=None,
                    help="with --trace: the real SA-FIFO 8K hit rate (default: the trace's)")
    ap.add_argument("--anchored", default=None, metavar="STUDY_JSON",
                    help="print the 8K-vs-16K answer for each policy of a policy-study JSON "
                         "(python -m offload_passes.trace.study --json) at the real 16K rates --h16")
    ap.add_argument("--h16", default="0.905,0.92,0.94,0.96,0.97",
                    help="with --anchored: candidate real SA-FIFO 16K hit rates")
    ap.add_argument("--fifo16k-hit", type=float, default=None,
                    help="with --trace: the real SA-FIFO 16K hit rate (default: the trace's)")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    try:
        import numpy  # noqa: F401
        import scipy.optimize  # noqa: F401
    except ImportError as e:
        ap.error(f"--what-if needs numpy and scipy ({e}): pip install 'offload_passes[plan]'")
    if a.anchored is not None:
        return _main_anchored(ap, a)
    if a.trace is not None:
        a.warmup = a.warmup or 0
        return _main_trace(ap, a)
    a.warmup = 384 if a.warmup is None else a.warmup
    return _main_ensemble(ap, a)


def _main_anchored(ap: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """``--anchored STUDY_JSON``: the 8K-vs-16K answer per policy at the candidate real 16K rates."""
    try:
        h16s = [float(x) for x in a.h16.split(",") if x]
    except ValueError:
        ap.error(f"--h16 must be comma-separated hit rates, got {a.h16!r}")
    if not h16s or any(not REFERENCE_HIT[8192] < h <= 1.0 for h in h16s):
        ap.error(f"--h16 must be hit rates in ({REFERENCE_HIT[8192]}, 1], got {a.h16!r}")
    try:
        with open(a.anchored) as fh:
            st = json.load(fh)
    except (OSError, ValueError) as e:
        print(f"{ap.prog}: error: --anchored {a.anchored}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print("\n".join(consistency_table(h16s) + [""] + anchored_table(st, h16s, mode=a.mode)))
    return 0


def _main_ensemble(ap: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """The ensemble study: every trace model, seed, context, pool, policy and batch."""
    from offload_passes.trace import models as tmodels
    from offload_passes.trace import sim, study

    pols = [p for p in a.policies.split(",") if p]
    bad = [p for p in pols if not study.known_policy(p)]
    if bad or not pols:
        ap.error(f"--policies: unknown {', '.join(bad) or '(none)'}; choose from "
                 f"{', '.join(sim.POLICIES + study.EXTRA)}")
    which = [m for m in (a.models or ",".join(tmodels.MODELS)).split(",") if m]
    badm = [m for m in which if m not in tmodels.MODELS]
    if badm or not which:
        ap.error(f"--models: unknown {', '.join(badm) or '(none)'}; choose from {', '.join(tmodels.MODELS)}")
    _check_ranges(ap, a)
    try:
        o = what_if(a.batches, a.pools, pols, a.contexts, a.mode, a.seeds, a.steps, a.warmup, which)
    except NonPhysicalFit as e:
        print(f"{ap.prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(json.dumps(o, indent=1) if a.json else render(o))
    return 0


def _check_ranges(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The ensemble's numbers in range (a context of 1e11 would allocate terabytes of trace)."""
    if not 1 <= a.seeds <= MAX_SEEDS:
        ap.error(f"--seeds must be in [1, {MAX_SEEDS}], got {a.seeds}")
    for flag, v, lo in (("--steps", a.steps, 1), ("--warmup", a.warmup, 0)):
        if not lo <= v <= MAX_STEPS:
            ap.error(f"{flag} must be in [{lo}, {MAX_STEPS}], got {v}")
    shape = Shape()
    for c in a.contexts:
        if not shape.K < c <= MAX_CONTEXT:
            ap.error(f"--contexts must be in ({shape.K}, {MAX_CONTEXT}], got {c}")
    for b in a.batches:
        if b > MAX_BATCH:
            ap.error(f"--batches must be <= {MAX_BATCH}, got {b}")
    for ps in a.pools:
        # every policy runs on every pool, as the ops would hold it (custom_ops/_pool.py)
        problem = pool_size_problem(ps)
        if problem is not None:
            ap.error(f"--pools {problem[0]} (dsa_plan / dsa_install limits), got {problem[1]}")


def _main_trace(ap: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    from offload_passes.trace import cli as trace_cli
    from offload_passes.trace import sim, study

    if not study.known_policy(a.policy):
        ap.error(f"--policy: unknown {a.policy!r}; choose from {', '.join(sim.POLICIES + study.EXTRA)}")
    if a.policy in ("adjacent", "rank_prefetch"):
        ap.error(f"--policy: {a.policy} is not a pool replacement policy (no pool, or prefetches beyond demand)")
    if not 1 <= a.batch <= MAX_BATCH:
        ap.error(f"--batch must be in [1, {MAX_BATCH}], got {a.batch}")
    problem = pool_size_problem(a.pool)
    if problem is not None:
        ap.error(f"--pool {problem[0]} (dsa_plan / dsa_install limits), got {problem[1]}")
    for name, v in (("--fifo8k-hit", a.fifo8k_hit), ("--fifo16k-hit", a.fifo16k_hit)):
        if v is not None and not 0.0 <= v <= 1.0:
            ap.error(f"{name} must be a hit rate in [0, 1], got {v}")
    try:
        tr = trace_cli.open_trace(a.trace)
        if not 0 <= a.warmup < tr.steps:
            raise ValueError(f"--warmup must be in [0, steps={tr.steps}) of the trace, got {a.warmup}")
        o = predict_trace(tr, a.policy, a.pool, a.batch, a.mode, a.warmup, a.fifo8k_hit, a.fifo16k_hit)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"{ap.prog}: error: --trace {a.trace}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    o["trace"] = a.trace
    print(json.dumps(o, indent=1) if a.json else render_trace(o))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

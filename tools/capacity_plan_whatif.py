"""``offload-plan --what-if``: a per-step latency model of GLM-5.2 decode on Atlas A3, fitted to the
reference's latency table, then used to predict other pool sizes, policies, batches and contexts.

Model (one rank = one 910C die; attention data-parallel, so every rank runs ``b = batch / ranks`` rows):

    T_no_offload = A_m + b * t_row
    T_offload    = A_m + b * t_row + b * t_serve(h) + O_m + H(b, h) * row_bytes / BW_h2d

* ``t_row``: HBM time one decode row adds per step: sparse attention reading its ``S*K`` selected latent
  rows in every layer plus the lightning indexer reading ``context`` keys in every full layer, at the
  die's HBM bandwidth. Public constants only (not fitted).
* ``t_serve(h)``: the extra HBM traffic of the offload path per row: ``dsa_serve`` writes the selection
  buffer (``S*K`` rows per layer) and reads the pool for hits; ``dsa_install`` copies the misses into the
  pool (read + write). Public constants only.
* ``H(b, h) = b * S * K * (1 - h) * layers``: rows read from host per step (every layer serves the same
  plan from its own host cache), ``row_bytes = (kv_lora_rank + rope) * 2``.
* Fitted: ``A_m`` (everything batch-independent: weights, MoE, communication, per exec mode ``m``) from the
  no-offload latency; ``O_m`` (plan / install launch + synchronisation per step, per mode) and one
  effective host-to-device rate ``BW_h2d`` shared by both modes, by least squares on the four offload
  latencies. 5 parameters for 6 latencies; the fit residuals are printed.

Every hardware constant is a :data:`CONSTANTS` entry with its public source.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional, Sequence

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
    index_bytes: int = 2
    K: int = 2048
    S: int = 4                    # 1 + next_n (MTP3)
    ranks: int = 32
    context: int = 65536

    @property
    def row_bytes(self) -> int:
        return self.kv_row * self.kv_bytes


def hbm_bw_rank() -> float:
    return CONSTANTS["hbm_bw_chip"][0] / CONSTANTS["dies_per_chip"][0]


def t_row(s: Shape) -> float:
    """Seconds of HBM traffic one decode row adds per step without offload."""
    attn = s.layers * s.S * s.K * s.row_bytes
    indexer = s.full_layers * s.context * s.index_dim * s.index_bytes
    return (attn + indexer) / hbm_bw_rank()


def t_serve(s: Shape, h: float) -> float:
    """Extra HBM seconds per row per step of the offload path (serve write + pool read + install)."""
    rows = s.layers * s.S * s.K
    serve = rows * s.row_bytes * (1 + h)           # write selection; read pool for hits
    install = rows * (1 - h) * s.row_bytes * 2     # copy misses selection -> pool
    return (serve + install) / hbm_bw_rank()


def host_rows(s: Shape, b: float, h: float) -> float:
    return b * s.S * s.K * (1 - h) * s.layers


@dataclass
class Fit:
    A: dict
    O: dict
    bw_h2d: float
    residuals: list

    def latency(self, mode: str, shape: Shape, batch: int, offload: bool, h: float = 0.0) -> float:
        b = batch / shape.ranks
        t = self.A[mode] + b * t_row(shape)
        if offload:
            t += b * t_serve(shape, h) + self.O[mode] + host_rows(shape, b, h) * shape.row_bytes / self.bw_h2d
        return t


def fit(shape: Optional[Shape] = None, hits: Optional[dict] = None) -> Fit:
    """Least-squares fit of ``A_m``, ``O_m`` (per mode) and ``BW_h2d`` (shared) to :data:`REFERENCE`."""
    import numpy as np

    s = shape or Shape()
    hits = hits or REFERENCE_HIT
    modes = sorted({m for m, *_ in REFERENCE})
    A = {}
    for m, off, _, batch, ms in REFERENCE:
        if not off:
            A[m] = ms * 1e-3 - batch / s.ranks * t_row(s)
    # unknowns: O_m per mode, then x = 1 / BW_h2d
    rows, rhs = [], []
    for m, off, ps, batch, ms in REFERENCE:
        if not off:
            continue
        b, h = batch / s.ranks, hits[ps]
        row = [1.0 if m == mm else 0.0 for mm in modes] + [host_rows(s, b, h) * s.row_bytes]
        rows.append(row)
        rhs.append(ms * 1e-3 - A[m] - b * t_row(s) - b * t_serve(s, h))
    sol, *_ = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)
    if sol[-1] <= 0:
        raise RuntimeError("what-if fit: non-physical (negative) host transfer time")
    f = Fit({m: A[m] for m in modes}, {m: float(sol[i]) for i, m in enumerate(modes)}, float(1 / sol[-1]), [])
    for m, off, ps, batch, ms in REFERENCE:
        pred = f.latency(m, s, batch, off, hits.get(ps, 0.0)) * 1e3
        f.residuals.append({"mode": m, "offload": off, "pool": ps, "batch": batch, "reference_ms": ms,
                            "model_ms": round(pred, 2), "error_pct": round(100 * (pred - ms) / ms, 2)})
    return f


def sim_hits(pools: Sequence[int], policies: Sequence[str], seeds: int = 2, warmup: int = 16,
             contexts: Sequence[int] = (65536,)) -> dict:
    """Hit rates ``{(context, policy, pool): h}`` on the calibrated synthetic traces
    (``offload_passes.trace.synth.CALIBRATED`` with the context length set)."""
    from offload_passes.trace import sim, synth

    out: dict = {}
    for ctx in contexts:
        trs = [synth.generate(replace(synth.CALIBRATED, seed=k, context=ctx)) for k in range(seeds)]
        for pol in policies:
            for ps in pools:
                out[(ctx, pol, ps)] = sum(sim.simulate(tr, pol, ps, warmup=warmup).hit_rate for tr in trs) / len(trs)
    return out


def what_if(batches: Sequence[int], pools: Sequence[int], policies: Sequence[str], contexts: Sequence[int],
            mode: str = "ge_graph", seeds: int = 2) -> dict[str, Any]:
    f = fit()
    hits = sim_hits(pools, policies, seeds, contexts=contexts)
    rows = []
    base = Shape()
    for ctx in contexts:
        s = replace(base, context=ctx)
        for batch in batches:
            t0 = f.latency(mode, s, batch, False)
            rows.append({"context": ctx, "batch": batch, "policy": "no offload", "pool": 0, "hit": None,
                         "ms": round(t0 * 1e3, 2), "rows_per_s": round(batch / t0, 1)})
            for pol in policies:
                for ps in pools:
                    h = hits[(ctx, pol, ps)]
                    t = f.latency(mode, s, batch, True, h)
                    rows.append({"context": ctx, "batch": batch, "policy": pol, "pool": ps, "hit": round(h, 4),
                                 "ms": round(t * 1e3, 2), "rows_per_s": round(batch / t, 1)})
    return {"mode": mode,
            "fit": {"A_ms": {k: round(v * 1e3, 3) for k, v in f.A.items()},
                    "O_ms": {k: round(v * 1e3, 3) for k, v in f.O.items()},
                    "bw_h2d_GBps": round(f.bw_h2d / 1e9, 2),
                    "t_row_ms": round(t_row(base) * 1e3, 4),
                    "t_serve_ms_at_85pct": round(t_serve(base, 0.85) * 1e3, 4)},
            "residuals": f.residuals, "constants": {k: {"value": v, "unit": u, "source": src}
                                                    for k, (v, u, src) in CONSTANTS.items()},
            "shape": asdict(base), "rows": rows,
            "note": "hit rates from the calibrated synthetic traces (S=1) generated at each context (the "
                    "locality parameters are kept; batch rows are independent); rows_per_s = batch rows advanced per second (x accepted tokens per "
                    "step for tokens/s, which the sources do not give); a latency model only: whether a "
                    "batch fits in HBM is offload-plan's question (the reference runs no offload at 64)"}


def render(o: dict) -> str:
    lines = ["what-if: per-step latency model fitted to the reference table (ms)",
             f"  fit: A = {o['fit']['A_ms']}  O = {o['fit']['O_ms']}  effective H2D = {o['fit']['bw_h2d_GBps']} GB/s"
             f"  (PCIe 5.0 x16 peak {CONSTANTS['pcie5_x16'][0] / 1e9:.0f} GB/s)",
             f"  t_row = {o['fit']['t_row_ms']} ms/row, t_serve(h=0.85) = {o['fit']['t_serve_ms_at_85pct']} ms/row",
             "", f"  {'mode':<12}{'offload':>8}{'pool':>7}{'batch':>7}{'reference':>11}{'model':>9}{'error %':>9}"]
    for r in o["residuals"]:
        lines.append(f"  {r['mode']:<12}{str(r['offload']):>8}{r['pool']:>7}{r['batch']:>7}{r['reference_ms']:>11.2f}"
                     f"{r['model_ms']:>9.2f}{r['error_pct']:>9.2f}")
    lines += ["", f"  predictions ({o['mode']}):",
              f"  {'context':>8}{'batch':>7}  {'policy':<12}{'pool':>7}{'hit %':>8}{'ms/step':>9}{'rows/s':>9}"]
    for r in o["rows"]:
        hit = "" if r["hit"] is None else f"{100 * r['hit']:.2f}"
        lines.append(f"  {r['context']:>8}{r['batch']:>7}  {r['policy']:<12}{r['pool']:>7}{hit:>8}{r['ms']:>9.2f}"
                     f"{r['rows_per_s']:>9.1f}")
    lines.append("  constants:")
    for k, (v, u, src) in CONSTANTS.items():
        lines.append(f"    {k} = {v:g} {u}: {src}")
    lines.append("  note: " + o["note"])
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    vals = [int(v) for v in text.split(",") if v]
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive comma-separated integers, got {text!r}")
    return vals


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="offload-plan --what-if", description=__doc__.split("\n\n")[0])
    ap.add_argument("--what-if", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batches", type=_ints, default=[64, 128, 192], help="global batches (32 ranks)")
    ap.add_argument("--pools", type=_ints, default=[4096, 8192, 16384])
    ap.add_argument("--policies", default="sa_fifo,sa_clock,lru,belady")
    ap.add_argument("--contexts", type=_ints, default=[65536])
    ap.add_argument("--mode", choices=("ge_graph", "npugraph_ex"), default="ge_graph")
    ap.add_argument("--seeds", type=int, default=2, help="synthetic traces per hit rate")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from offload_passes.trace import sim

    pols = [p for p in a.policies.split(",") if p]
    bad = [p for p in pols if p not in sim.POLICIES]
    if bad:
        ap.error(f"--policies: unknown {', '.join(bad)}; choose from {', '.join(sim.POLICIES)}")
    o = what_if(a.batches, a.pools, pols, a.contexts, a.mode, a.seeds)
    print(json.dumps(o, indent=1) if a.json else render(o))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

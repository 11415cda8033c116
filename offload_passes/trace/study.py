"""Trace science on one consistent set of hit rates: ``python -m offload_passes.trace.study``.

Every figure comes from long warm traces (``--steps`` measured after ``--warmup`` steps, by default
longer than any model needs to fill a fully associative 16K pool; see ``docs/trace-science.md`` §1) of every model of
:mod:`.models` and ``--seeds`` seeds, and is reported as a range over that ensemble. Sections:

* ``locality``  — the fitted numbers, the reference's pinned SA-FIFO figures, LRU, and the bounds: MIN
  per 16-way set (the geometry's optimum) beside the fully associative MIN, and the greedy
  always-install schedule (feasible, not a bound); the independent NumPy re-computation of SA-FIFO
  (:mod:`.setsim`) beside the C++ core's.
* ``policies``  — the policy study at 8K and 16K: hit rate over the S = 1 ensemble, over the models
  consistent with the reference's SA-FIFO 8K ≈ 85 %, and over MTP traces (``--mtp-seeds``: S = 4 rows
  share a plan); distance to the per-set MIN; each policy's state budget (:data:`BUDGET`: bits per slot
  and per set, pool-wide counters, probes per victim search, what the indexer must export), every
  metadata write per step, and whether it fits the op's limits (:func:`within_limits`: set-local state
  of at most one extra byte per slot, no id table, no host sync).
* ``prefetch``  — rank_prefetch's host rows against MIN's misses (demand fetching is optimal for loads).

``ensemble_hits`` is what ``offload-capacity --what-if`` fits and predicts with.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from typing import Optional, Sequence

import numpy as np

from . import models, setsim, sim, synth
from .format import Trace

log = logging.getLogger("offload_passes.trace.study")

#: policy names the study (and the what-if) accept beyond offload-sim's: NumPy set-associative variants
EXTRA = ("min_per_set_nobypass", "sa_clock_ins1", "sa_rank", "sa_rank_P", "sa_clock_P", "sa_fifo_np")
SCORE_MODELS = ("score", "twoscale")
RANK_P = 4096   # ranks the score-informed variants read (the indexer would export ranks K..P-1)
MTP_S = 4       # MTP3: 1 + 3 draft tokens per decode step share one plan
MTP_SUFFIX = "+mtp4"


def known_policy(name: str) -> bool:
    return name in sim.POLICIES or name in EXTRA


def run_policy(tr: Trace, name: str, pool: int, warmup: int) -> dict:
    """Hit rate and per-step metadata work of one policy (C++ core or :mod:`.setsim`)."""
    if name in sim.POLICIES:
        r = sim.simulate(tr, name, pool, warmup=warmup)
        n = max((tr.steps - warmup) * len(tr.groups) * tr.B, 1)
        installs = r.distinct_misses / n  # every distinct missed id is installed (default id range)
        # a second-chance sweep's probe either clears a reference bit or takes the way: the C++ core
        # counts the clears as scans, here they are metadata writes
        clears = r.scans_per_step - installs if name in ("sa_clock", "clock") else 0.0
        return {"hit": r.hit_rate, "hit_writes": r.writes_per_step, "clear_writes": clears,
                "rank_writes": 0.0, "probes": r.scans_per_step, "installs": installs, "prefetch": r.prefetch / n}
    if name in ("min_per_set", "min_per_set_nobypass"):
        r = setsim.per_set_min(tr, pool, bypass=name == "min_per_set", warmup=warmup)
    elif name == "sa_fifo_np":
        r = setsim.simulate_sa(tr, "sa_fifo", pool, warmup=warmup)
    elif name == "sa_clock_ins1":
        r = setsim.simulate_sa(tr, "sa_clock", pool, warmup=warmup, insert_bit=1)
    elif name in ("sa_rank", "sa_rank_P", "sa_clock_P"):
        rc = min(RANK_P, tr.P) if name.endswith("_P") else None
        r = setsim.simulate_sa(tr, "sa_clock" if name == "sa_clock_P" else "sa_rank", pool, warmup=warmup,
                               rank_columns=rc)
    else:
        raise ValueError(f"unknown policy {name!r}")
    return {"hit": r.hit_rate, "hit_writes": r.per_step("hit_writes"), "clear_writes": r.per_step("clear_writes"),
            "rank_writes": r.per_step("rank_writes"), "probes": r.per_step("probes"),
            "installs": r.per_step("installs"), "max_probes": r.max_probes}


def traces(seeds: int, steps: int, warmup: int, context: int = 65536,
           which: Sequence[str] = models.MODELS, mtp_seeds: int = 0, ranks: bool = True) -> list[tuple[str, int, Trace]]:
    """``(member model, seed, trace)``: every model x ``seeds`` with one query row per step, then every
    model x ``mtp_seeds`` regrouped into MTP steps (``models.mtp``: S = 4 rows share a plan; named
    ``<model>+mtp4``), with ``steps / 4`` and ``warmup / 4`` steps — the same tokens as the S = 1 traces."""
    out = []
    for m in which:
        for s in range(seeds):
            P = RANK_P if m in SCORE_MODELS and ranks else None
            out.append((m, s, models.generate(m, steps=steps + warmup, seed=s, context=context, P=P)))
    for m in which:
        for s in range(mtp_seeds):
            P = RANK_P if m in SCORE_MODELS and ranks else None
            T, W = max(steps // MTP_S, 1), warmup // MTP_S
            src = models.generate(m, steps=MTP_S * (T + W), seed=100 + s, context=context, P=P)
            out.append((m + MTP_SUFFIX, s, models.mtp(src, MTP_S)))
    return out


def base_model(member: str) -> str:
    return member[: -len(MTP_SUFFIX)] if member.endswith(MTP_SUFFIX) else member


def ensemble_hits(policies: Sequence[str], pools: Sequence[int], seeds: int = 2, steps: int = 1152,
                  warmup: int = 384, context: int = 65536, which: Sequence[str] = models.MODELS) -> list[dict]:
    """One member per (model, seed): ``{"model", "seed", "hits": {(policy, pool): hit rate}}``."""
    out = []
    for m, s, tr in traces(seeds, steps, warmup, context, which):
        hits = {}
        for pol in policies:
            for ps in pools:
                if pol in ("sa_rank_P", "sa_clock_P", "rank_keep", "rank_prefetch") and m not in SCORE_MODELS:
                    continue
                hits[(pol, ps)] = run_policy(tr, pol, ps, warmup)["hit"]
        out.append({"model": m, "seed": s, "context": context, "hits": hits})
    return out


def _rng(vals: list) -> dict:
    v = np.array(vals, dtype=float)
    return {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max()), "n": int(v.size)}


LOCALITY = [  # (row, policy, pool, reference, kind)
    ("adjacent-step reuse, K=2048", "adjacent", 2048, synth.REF_ADJACENT_K2048, "fitted"),
    ("LRU, 8K", "lru", 8192, synth.REF_LRU_8K, "fitted"),
    ("16-way SA-FIFO, 8K (C++ core)", "sa_fifo", 8192, synth.REF_SA_FIFO_8K, "predicted; ref ≈ 85 %"),
    ("16-way SA-FIFO, 8K (NumPy re-computation)", "sa_fifo_np", 8192, synth.REF_SA_FIFO_8K, "independent"),
    ("16-way SA-FIFO, 16K", "sa_fifo", 16384, synth.REF_SA_FIFO_16K, "predicted; ref > 90 %"),
    ("LRU, 16K", "lru", 16384, None, "predicted"),
    ("MIN per 16-way set, no bypass, 8K", "min_per_set_nobypass", 8192, None, "feasible always-install schedule (greedy, not a bound)"),
    ("MIN per 16-way set, bypass, 8K", "min_per_set", 8192, None, "bound: every policy of the 16-way geometry"),
    ("MIN fully associative, 8K", "belady", 8192, None, "bound: every demand policy, any placement"),
    ("MIN per 16-way set, no bypass, 16K", "min_per_set_nobypass", 16384, None, "feasible always-install schedule (greedy, not a bound)"),
    ("MIN per 16-way set, bypass, 16K", "min_per_set", 16384, None, "bound: every policy of the 16-way geometry"),
    ("MIN fully associative, 16K", "belady", 16384, None, "bound: every demand policy, any placement"),
]

POLICY_STUDY = ["sa_fifo", "sa_clock", "sa_lru", "srrip", "srrip_1p", "brrip", "drrip", "gclock", "srrip_rank",
                "sa_s3fifo", "sa_lrfu", "min_per_set", "lru", "clock", "s3fifo", "belady"]
#: the NumPy variants of :mod:`.setsim` (insert bit 1, rank stamps, ranks beyond K; 10-30x slower), added by
#: ``--numpy-variants``; the rank-beyond-K ones read P = RANK_P ranks (score models only)
NUMPY_VARIANTS = ["sa_clock_ins1", "sa_rank", "sa_rank_P", "sa_clock_P", "min_per_set_nobypass"]
#: policies that read the indexer's ranks (columns in score order, or ranks beyond K): score models only
NEEDS_SCORE = ("sa_rank_P", "sa_clock_P", "srrip_rank")
W16 = 16
#: The state each policy needs in a 16-way pool, as the op would hold it: bits per slot, bits per set (the
#: op already keeps one int32 word per set, ``lru_counter``), pool-wide counters (one int32 each, updated
#: on device), whether it needs a table indexed by id or state shared by all sets (fully associative),
#: the most ways one victim search examines, and what the indexer would have to export.
BUDGET: dict[str, dict] = {
    "sa_fifo": dict(slot=0, set=4, pool=0, global_state=False, probes=1, export=""),
    "sa_clock": dict(slot=1, set=4, pool=0, global_state=False, probes=W16 + 1, export=""),
    "sa_clock_ins1": dict(slot=1, set=4, pool=0, global_state=False, probes=W16 + 1, export=""),
    "sa_lru": dict(slot=4, set=0, pool=0, global_state=False, probes=W16, export=""),
    "srrip": dict(slot=2, set=0, pool=0, global_state=False, probes=4 * W16, export=""),
    "srrip_1p": dict(slot=2, set=0, pool=0, global_state=False, probes=W16, export=""),
    "brrip": dict(slot=2, set=0, pool=1, global_state=False, probes=4 * W16, export=""),
    "drrip": dict(slot=2, set=0, pool=2, global_state=False, probes=W16, export=""),
    "gclock": dict(slot=2, set=4, pool=0, global_state=False, probes=3 * W16 + 1, export=""),
    "srrip_rank": dict(slot=2, set=0, pool=0, global_state=False, probes=W16,
                       export="the top-k in score order (column = rank), or its scores"),
    # per way: 2-bit frequency, small flag, 8-bit small-FIFO sequence; per set: hand, sequence counter,
    # 8 ghost tags of 8 bits, ghost pointer. Worst search: ghost (8) + free scan (16) + a small-FIFO scan
    # per promotion (up to 16 x 16) + the main sweep (3 x 16 + 1)
    "sa_s3fifo": dict(slot=11, set=4 + 8 + 64 + 3, pool=0, global_state=False, probes=8 + W16 + W16 * W16 + 3 * W16 + 1,
                      export=""),
    # per way: the combined recency-frequency value (fp16) and the step of its last reference (16 bits)
    "sa_lrfu": dict(slot=32, set=0, pool=1, global_state=False, probes=W16, export=""),
    "sa_rank": dict(slot=4, set=0, pool=0, global_state=False, probes=W16, export=""),
    "sa_rank_P": dict(slot=4, set=0, pool=0, global_state=False, probes=W16,
                      export=f"ranks K..{RANK_P - 1} per query row (2,048 more ids)"),
    "sa_clock_P": dict(slot=1, set=4, pool=0, global_state=False, probes=W16 + 1,
                       export=f"ranks K..{RANK_P - 1} per query row (2,048 more ids)"),
    "lru": dict(slot=None, set=None, pool=None, global_state=True, probes=1, export=""),
    "clock": dict(slot=None, set=None, pool=None, global_state=True, probes=None, export=""),
    "s3fifo": dict(slot=None, set=None, pool=None, global_state=True, probes=None, export=""),
}
OFFLINE = ("min_per_set", "min_per_set_nobypass", "belady")
#: the op's limit for a new policy: one extra byte per slot (per-set state beyond the int32 word amortised
#: over the 16 ways), no table indexed by id, no state shared by all sets but pool-wide counters
SLOT_BITS_LIMIT = 8


def bits_per_slot(policy: str) -> Optional[float]:
    """Extra state per slot in bits, per-set state beyond the op's int32 word amortised over 16 ways."""
    b = BUDGET.get(policy)
    if b is None or b["slot"] is None:
        return None
    return b["slot"] + max(b["set"] - 32, 0) / W16


def within_limits(policy: str) -> bool:
    """Within the NPU op's limits: set-local state of at most one extra byte per slot, no id table."""
    b = BUDGET.get(policy)
    if b is None or b["global_state"] or policy in OFFLINE:
        return False
    bits = bits_per_slot(policy)
    return bits is not None and bits <= SLOT_BITS_LIMIT and b["probes"] is not None


def study(seeds: int = 3, steps: int = 1152, warmup: int = 384, sections: Sequence[str] = ("locality", "policies",
          "prefetch"), which: Sequence[str] = models.MODELS, mtp_seeds: int = 0, numpy_variants: bool = False) -> dict:
    t0 = time.perf_counter()
    study_pols = POLICY_STUDY + (NUMPY_VARIANTS if numpy_variants else [])
    ranks = numpy_variants or "locality" in sections or "prefetch" in sections
    trs = traces(seeds, steps, warmup, which=which, mtp_seeds=mtp_seeds if "policies" in sections else 0, ranks=ranks)
    res: dict = {}   # (model, seed, policy, pool) -> run_policy dict
    need = set()
    if "locality" in sections:
        need |= {(p, ps) for _, p, ps, _, _ in LOCALITY}
    if "policies" in sections:
        need |= {(p, ps) for p in study_pols for ps in (8192, 16384)}
    for m, s, tr in trs:
        mtp_member = m not in which
        for p, ps in sorted(need):
            if p in NEEDS_SCORE and base_model(m) not in SCORE_MODELS:
                continue
            if mtp_member and (p, ps) not in {(q, qs) for q in study_pols for qs in (8192, 16384)}:
                continue
            res[(m, s, p, ps)] = run_policy(tr, p, ps if p != "adjacent" else tr.K,
                                            warmup // MTP_S if mtp_member else warmup)
        log.info("study: %s seed %d done (%.0f s)", m, s, time.perf_counter() - t0)
    out: dict = {"seeds": seeds, "steps": steps, "warmup": warmup, "models": list(which),
                 "model_params": {m: models.FITTED[m] for m in which}}
    if "locality" in sections:
        rows = []
        for name, p, ps, ref, kind in LOCALITY:
            per = {m: _rng([res[(m, s, p, ps)]["hit"] for s in range(seeds)]) for m in which}
            allv = [res[(m, s, p, ps)]["hit"] for m in which for s in range(seeds)]
            agree = None
            if ref is not None and p.startswith("sa_fifo"):
                # "≈ 85 %": within 1 point; "> 90 %": above
                agree = {m: (abs(per[m]["mean"] - ref) <= 0.01 if ps == 8192 else per[m]["min"] > ref) for m in which}
            rows.append({"row": name, "policy": p, "pool": ps, "reference": ref, "kind": kind, "per_model": per,
                         "ensemble": _rng(allv), "agrees": agree})
        diff = max(abs(res[(m, s, "sa_fifo", 8192)]["hit"] - res[(m, s, "sa_fifo_np", 8192)]["hit"])
                   for m in which for s in range(seeds))
        out["locality"] = {"rows": rows, "sa_fifo_cpp_vs_numpy_max_abs_diff": diff}
    if "policies" in sections:
        rows = []
        fifo8 = {m: np.mean([res[(m, s, "sa_fifo", 8192)]["hit"] for s in range(seeds)]) for m in which}
        consistent = [m for m in which if abs(fifo8[m] - synth.REF_SA_FIFO_8K) <= 0.01]
        for ps in (8192, 16384):
            for p in study_pols:
                row = {"policy": p, "pool": ps}
                for part, keys in (("", [(m, s) for m, s, _ in trs if m in which]),
                                   ("_mtp", [(m, s) for m, s, _ in trs if m not in which])):
                    keys = [(m, s) for m, s in keys if (m, s, p, ps) in res]
                    row["models" + part] = list(dict.fromkeys(m for m, _ in keys))
                    if not keys:
                        row["hit" + part] = {"mean": 0, "min": 0, "max": 0, "n": 0}
                        continue
                    row["hit" + part] = _rng([res[(m, s, p, ps)]["hit"] for m, s in keys])
                    row["gap_to_min_per_set" + part] = _rng(
                        [res[(m, s, "min_per_set", ps)]["hit"] - res[(m, s, p, ps)]["hit"] for m, s in keys])
                    if not part:
                        nc = [(m, s) for m, s in keys if m != "churn"]
                        row["hit_without_churn"] = _rng([res[(m, s, p, ps)]["hit"] for m, s in nc]) if nc else None
                        cs = [(m, s) for m, s in keys if m in consistent]
                        row["hit_consistent"] = _rng([res[(m, s, p, ps)]["hit"] for m, s in cs]) if cs else None
                        w = lambda k: _rng([res[(m, s, p, ps)].get(k, 0.0) for m, s in keys])["mean"]  # noqa: E731
                        inst = w("installs")
                        row.update(hit_writes=w("hit_writes"), clear_writes=w("clear_writes"),
                                   rank_writes=w("rank_writes"), probes=w("probes"), installs=inst,
                                   probes_per_victim=w("probes") / inst if inst else 0.0,
                                   max_probes_seen=max((res[(m, s, p, ps)].get("max_probes", 0) for m, s in keys),
                                                       default=0) or None)
                row["budget"] = BUDGET.get(p)
                row["bits_per_slot"] = bits_per_slot(p)
                row["within_op_limits"] = within_limits(p)
                rows.append(row)
        out["policies"] = rows
        out["consistent_models"] = consistent
        out["mtp_seeds"] = mtp_seeds
    if "prefetch" in sections:
        chk = []
        for m, s, tr in trs:
            if m not in SCORE_MODELS:
                continue
            for ps in (8192, 16384):
                rows_, lo = setsim.host_rows_bound_holds(tr, ps, warmup)
                chk.append({"model": m, "seed": s, "pool": ps, "rank_prefetch_host_rows": rows_, "min_misses": lo,
                            "holds": rows_ >= lo})
        out["prefetch"] = chk
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def writes_per_step(r: dict) -> float:
    """Every metadata write per group step and batch row: hit writes + sweep clears + rank stamps."""
    return r.get("hit_writes", 0.0) + r.get("clear_writes", 0.0) + r.get("rank_writes", 0.0)


def _merge_rng(a: dict, b: dict) -> dict:
    n = a["n"] + b["n"]
    return {"mean": (a["mean"] * a["n"] + b["mean"] * b["n"]) / n, "min": min(a["min"], b["min"]),
            "max": max(a["max"], b["max"]), "n": n}


def merge(a: dict, b: dict) -> dict:
    """One result from two ``study`` results over disjoint model sets (same seeds, steps, warm-up)."""
    for k in ("seeds", "steps", "warmup"):
        if a[k] != b[k]:
            raise ValueError(f"merge: {k} differs ({a[k]} vs {b[k]})")
    if set(a["models"]) & set(b["models"]):
        raise ValueError("merge: the model sets overlap")
    o = {k: a[k] for k in ("seeds", "steps", "warmup")}
    o["models"] = a["models"] + b["models"]
    o["model_params"] = {**a["model_params"], **b["model_params"]}
    o["seconds"] = a["seconds"] + b["seconds"]
    if "locality" in a and "locality" in b:
        rows = []
        for ra, rb in zip(a["locality"]["rows"], b["locality"]["rows"]):
            r = dict(ra)
            r["per_model"] = {**ra["per_model"], **rb["per_model"]}
            r["ensemble"] = _merge_rng(ra["ensemble"], rb["ensemble"])
            r["agrees"] = None if ra["agrees"] is None else {**ra["agrees"], **rb["agrees"]}
            rows.append(r)
        o["locality"] = {"rows": rows, "sa_fifo_cpp_vs_numpy_max_abs_diff": max(
            a["locality"]["sa_fifo_cpp_vs_numpy_max_abs_diff"], b["locality"]["sa_fifo_cpp_vs_numpy_max_abs_diff"])}
    if "policies" in a and "policies" in b:
        rows = []
        bi = {(r["policy"], r["pool"]): r for r in b["policies"]}
        for ra in a["policies"]:
            rb = bi.get((ra["policy"], ra["pool"]))
            if rb is None or not rb["models"] or rb["hit"]["n"] == 0:
                rows.append(ra)
                continue
            if not ra["models"]:
                rows.append(rb)
                continue
            na, nb = ra["hit"]["n"], rb["hit"]["n"]
            r = dict(ra, models=ra["models"] + rb["models"], hit=_merge_rng(ra["hit"], rb["hit"]),
                     gap_to_min_per_set=_merge_rng(ra["gap_to_min_per_set"], rb["gap_to_min_per_set"]))
            for k in ("hit_without_churn", "hit_consistent"):
                r[k] = _merge_rng(ra[k], rb[k]) if ra.get(k) and rb.get(k) else ra.get(k) or rb.get(k)
            for k in ("hit_mtp", "gap_to_min_per_set_mtp"):
                if ra.get(k) and rb.get(k) and ra[k]["n"] and rb[k]["n"]:
                    r[k] = _merge_rng(ra[k], rb[k])
                else:
                    r[k] = ra.get(k) if ra.get(k) and ra[k]["n"] else rb.get(k)
            r["models_mtp"] = ra.get("models_mtp", []) + rb.get("models_mtp", [])
            for k in ("hit_writes", "clear_writes", "rank_writes", "probes", "installs"):
                r[k] = (ra[k] * na + rb[k] * nb) / (na + nb)
            r["probes_per_victim"] = r["probes"] / r["installs"] if r["installs"] else 0.0
            r["max_probes_seen"] = max(ra["max_probes_seen"] or 0, rb["max_probes_seen"] or 0) or None
            rows.append(r)
        o["policies"] = rows
        o["consistent_models"] = a.get("consistent_models", []) + b.get("consistent_models", [])
        o["mtp_seeds"] = a.get("mtp_seeds", 0)
    if "prefetch" in a or "prefetch" in b:
        o["prefetch"] = a.get("prefetch", []) + b.get("prefetch", [])
    return o


def _pct(r: dict) -> str:
    return f"{100 * r['mean']:.2f} ({100 * r['min']:.2f}–{100 * r['max']:.2f})"


def render(o: dict) -> str:
    ms = o["models"]
    lines = [f"ensemble: models {', '.join(ms)}; {o['seeds']} seeds each; {o['steps']} steps measured after "
             f"{o['warmup']} warm-up steps; context 64K, K = 2048, S = 1", ""]
    if "locality" in o:
        lines += ["| quantity | reference | " + " | ".join(ms) + " | ensemble | kind |",
                  "|---|---|" + "---|" * len(ms) + "---|---|"]
        for r in o["locality"]["rows"]:
            ref = "–" if r["reference"] is None else f"{100 * r['reference']:.2f} %"
            cells = []
            for m in ms:
                c = _pct(r["per_model"][m])
                if r["agrees"] is not None:
                    c += " ✓" if r["agrees"][m] else " ✗"
                cells.append(c)
            lines.append(f"| {r['row']} | {ref} | " + " | ".join(cells) + f" | {_pct(r['ensemble'])} | {r['kind']} |")
        lines += ["", f"SA-FIFO 8K, C++ core vs NumPy re-computation: max |difference| = "
                      f"{100 * o['locality']['sa_fifo_cpp_vs_numpy_max_abs_diff']:.4f} points", ""]
    if "policies" in o:
        lines += policy_table(o)
    if "prefetch" in o and not o["prefetch"]:
        lines.append("rank_prefetch host-rows bound: no score-model trace in this run (needs ranks beyond K)")
    elif "prefetch" in o:
        ok = all(c["holds"] for c in o["prefetch"])
        lines.append("rank_prefetch host rows >= MIN misses on every score-model trace: " + ("yes" if ok else "NO"))
        for c in o["prefetch"]:
            lines.append(f"  {c['model']} seed {c['seed']} {c['pool'] // 1024}K: {c['rank_prefetch_host_rows']} "
                         f">= {c['min_misses']}")
    lines.append(f"({o['seconds']} s)")
    return "\n".join(lines)


def _gap(g: Optional[dict]) -> str:
    return "–" if not g or not g.get("n") else f"{100 * g['mean']:.2f} ({100 * g['min']:.2f}–{100 * g['max']:.2f})"


def policy_table(o: dict) -> list[str]:
    """The policy study's markdown table (docs/trace-science.md §3) and its footnotes."""
    ms = o["models"]
    cons = o.get("consistent_models", [])
    lines = [f"S = 1 members: {', '.join(ms)} x {o['seeds']} seeds; MTP members (S = 4): "
             f"{o.get('mtp_seeds', 0)} seed(s) of each model; consistent with SA-FIFO 8K ≈ 85 %: {', '.join(cons) or '–'}",
             "",
             "| policy | pool | hit % S = 1 (ensemble) | hit % consistent models | hit % MTP S = 4 | below per-set MIN, "
             "S = 1 (points) | below per-set MIN, S = 4 | bits/slot (set bits) | pool counters | writes/step | "
             "probes/victim (design max) | export | within op limits |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in o["policies"]:
        if not r["models"]:
            continue
        p = r["policy"]
        b = r.get("budget") or BUDGET.get(p)
        sub = "" if len(r["models"]) == len(ms) else f" [{', '.join(r['models'])}]"
        flag = " †" if r.get("hit_without_churn") and (
            r["hit_without_churn"]["min"] != r["hit"]["min"] or r["hit_without_churn"]["max"] != r["hit"]["max"]) else ""
        if p in OFFLINE:
            budget, pool, probes, wps = "offline", "–", "–", "–"
        elif b is None or b["global_state"]:
            budget, pool, wps = "fully associative", "–", f"{writes_per_step(r):.0f}"
            probes = f"{r['probes_per_victim']:.2f} ({b['probes'] if b and b['probes'] else 'unbounded'})"
        else:
            budget = f"{bits_per_slot(p):.3g} ({b['set']})"
            pool, wps = str(b["pool"]), f"{writes_per_step(r):.0f}"
            probes = f"{r['probes_per_victim']:.2f} ({b['probes']})"
        export = (b or {}).get("export") or "–"
        lines.append(f"| {p}{sub} | {r['pool'] // 1024}K | {_pct(r['hit'])}{flag} | "
                     f"{_pct(r['hit_consistent']) if r.get('hit_consistent') else '–'} | "
                     f"{_pct(r['hit_mtp']) if r.get('hit_mtp') and r['hit_mtp']['n'] else '–'} | "
                     f"{_gap(r.get('gap_to_min_per_set'))} | {_gap(r.get('gap_to_min_per_set_mtp'))} | {budget} | {pool} | "
                     f"{wps} | {probes} | {export} | {'yes' if within_limits(p) else 'no'} |")
    flagged = [f"{r['policy']} {r['pool'] // 1024}K" for r in o["policies"] if r["models"] and r.get("hit_without_churn")
               and (r["hit_without_churn"]["min"] != r["hit"]["min"] or r["hit_without_churn"]["max"] != r["hit"]["max"])]
    lines += ["", f"† the churn model widens this S = 1 range ({len(flagged)} rows); the range without it is "
              + ("the consistent-models column" if "churn" not in cons else "in the JSON (hit_without_churn)"), ""]
    return lines


def plot(o: dict, path: str) -> str:
    """Policy-study hit rates at 8K and 16K, bars = ensemble mean, whiskers = ensemble min-max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = o["policies"]
    pols = list(dict.fromkeys(r["policy"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    x = np.arange(len(pols))
    for j, (ps, col) in enumerate(((8192, "tab:blue"), (16384, "tab:orange"))):
        rs = {r["policy"]: r for r in rows if r["pool"] == ps}
        mean = np.array([100 * rs[p]["hit"]["mean"] for p in pols])
        lo = mean - np.array([100 * rs[p]["hit"]["min"] for p in pols])
        hi = np.array([100 * rs[p]["hit"]["max"] for p in pols]) - mean
        ax.bar(x + (j - 0.5) * 0.4, mean, 0.4, yerr=[lo, hi], capsize=2, color=col, label=f"{ps // 1024}K pool")
    ax.set_xticks(x, pols, rotation=35, ha="right", fontsize=8)
    ax.set_ylim(80, 100)
    ax.set_ylabel("hit rate (%), ensemble mean, min-max")
    ax.set_title(f"policies on {len(o['models'])} trace models x {o['seeds']} seeds, {o['steps']} warm steps "
                 "(K = 2048, context 64K)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .. import _cli

    ap = _cli.ArgumentParser(prog="python -m offload_passes.trace.study", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1152, help="measured steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=384)
    ap.add_argument("--sections", default="locality,policies,prefetch")
    ap.add_argument("--models", default=",".join(models.MODELS))
    ap.add_argument("--numpy-variants", action="store_true",
                    help="policies section: also the NumPy variants (insert bit 1, rank stamps, ranks beyond K)")
    ap.add_argument("--mtp-seeds", type=int, default=0,
                    help="policies section: also this many MTP (S = 4) traces per model")
    ap.add_argument("--fit", action="store_true", help="re-fit every model's two knobs and print them")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", default=None, help="write the policy-study bar chart to this PNG")
    ap.add_argument("--from-json", default=None,
                    help="render / plot saved --json result(s) instead of running (comma-separated: merged)")
    a = ap.parse_args(argv)
    which = [m for m in a.models.split(",") if m]
    bad = [m for m in which if m not in models.MODELS]
    if bad or not which:
        ap.error(f"--models: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(models.MODELS)}")
    if a.seeds < 1 or a.steps < 1 or a.warmup < 0 or a.mtp_seeds < 0:
        ap.error(f"need --seeds >= 1, --steps >= 1, --warmup >= 0; got {a.seeds}, {a.steps}, {a.warmup}")
    secs = [s for s in a.sections.split(",") if s]
    if any(s not in ("locality", "policies", "prefetch") for s in secs):
        ap.error(f"--sections: choose from locality, policies, prefetch; got {a.sections!r}")
    if a.fit:
        out = {m: dict(zip(("params", "locality"), models.fit(m))) for m in which}
        print(json.dumps(out, indent=1))
        return 0
    if a.plot:
        try:
            _cli.writable_file(a.plot, "--plot")
        except _cli.UsageError as e:
            ap.error(str(e))
    if a.from_json:
        parts = [json.loads(open(f).read()) for f in a.from_json.split(",") if f]
        o = parts[0]
        for q in parts[1:]:
            o = merge(o, q)
    else:
        o = study(a.seeds, a.steps, a.warmup, secs, which, a.mtp_seeds, a.numpy_variants)
    for r in o.get("policies", []):  # derived columns: recomputed, also for saved results
        if r["models"]:
            r["writes_per_step"] = writes_per_step(r)
            r["within_op_limits"] = within_limits(r["policy"])
    if a.plot and "policies" in o:
        plot(o, a.plot)
    if a.json:
        def enc(x):
            return {str(k): enc(v) for k, v in x.items()} if isinstance(x, dict) else \
                [enc(v) for v in x] if isinstance(x, list) else x
        print(json.dumps(enc(o), indent=1))
    else:
        print(render(o))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""``offload-demo --serve``: the serving loop (``models/glm/serve.py``: continuous batching on the cache
manager's block tables, a C++ KV transfer that moves no version counter, varying MTP acceptance) with the
unmodified model and the compiled one side by side, and the same requests replayed as a static batch. With
``--store`` the loop reloads stored prefixes from a KV store (``serve_store.py``), and a reference lane, the
unmodified model recomputing every reloaded prefix with the same boundary, checks the reloaded lanes.

The lanes are built by :func:`build_lanes`, the static-batch comparison is :class:`StaticReplay`, and
:func:`run_serve` runs the loop and reports (``benchmarks/soak.py --serve`` calls it too).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from .common import LOGITS_TOL, set_threads
from .serve_store import make_store, multiturn_config, reuse_report, summary_reuse


@dataclass
class ServeLanes:
    """What :func:`build_lanes` made: the lanes in serving order (unmodified, announcing, told nothing),
    the models the report reads and the two compiled lanes' backends (``backend2`` None without the third)."""

    lanes: list
    prefill_model: Any
    ref: Any
    comp: Any
    backend: Any
    backend2: Any
    small: list
    reference: bool = False  # the last lane recomputes reloaded prefixes (a store is on)


def build_lanes(config: str, over: dict, mode: str, opts: dict, buckets: Sequence[int], batch: int,
                unannounced: bool, reference: bool = False) -> ServeLanes:
    """The unmodified lane, the compiled lane told every batch change (the engine adapter,
    ``engine.EngineAdapter``: ``OffloadState.move_rows`` on every change) and, with ``unannounced``, a
    third compiled the same way and told nothing (per-row in-graph signals only). ``buckets``: batch sizes
    below ``batch`` compiled as batch buckets over the same caches (``serve.bucket_model``). ``reference``:
    a last lane, the unmodified model built and compiled like the first, that receives reloaded prefixes
    recomputed (``Lane(reference=True)``)."""
    from .. import models
    from ..backend import make_offload_backend
    from ..engine import EngineAdapter
    from ..models.glm.serve import Lane, bucket_model

    ref = models.build(config, **over)
    comp = models.build(config, **over)
    pm = models.build(config, **dict(over, batch_size=1)).model
    backend = make_offload_backend(**opts)
    ref_fn = torch.compile(ref.model, backend="inductor") if mode == "inductor" else None
    small = sorted(b for b in set(buckets) if b != batch)

    def bucket_lanes(m: Any, be: Any) -> dict:  # every smaller bucket, compiled like its lane
        out = {}
        for b in small:
            bm = bucket_model(m, b)
            out[b] = (bm, torch.compile(bm, backend=be) if be is not None else None)
        return out

    ref_buckets = bucket_lanes(ref.model, "inductor" if mode == "inductor" else None)
    lanes = [Lane(ref.model, ref_fn, None, ref_buckets),
             Lane(comp.model, torch.compile(comp.model, backend=backend), buckets=bucket_lanes(comp.model, backend),
                  engine_step=EngineAdapter(comp.model).step)]
    backend2 = None
    if unannounced:
        comp2 = models.build(config, **over)
        backend2 = make_offload_backend(**opts)
        lanes.append(Lane(comp2.model, torch.compile(comp2.model, backend=backend2), None,
                          bucket_lanes(comp2.model, backend2)))
    if reference:
        rm = models.build(config, **over).model
        lanes.append(Lane(rm, torch.compile(rm, backend="inductor") if mode == "inductor" else None, None,
                          bucket_lanes(rm, "inductor" if mode == "inductor" else None), reference=True))
    return ServeLanes(lanes, pm, ref, comp, backend, backend2, small, reference)


class StaticReplay:
    """The static-batch comparison on the same trace: every request's recorded top-k (what the announcing
    lane's ``dsa_plan`` received) replayed through the same plan / install kernels in a row of its own for
    its whole life (``trace.kernel_replay``): what a static batch, whose rows keep their request, would hit
    on exactly these requests."""

    def __init__(self, model: Any, pool_size: int, config: str, K: int, rebind_every_step: bool) -> None:
        from ..custom_ops.plan_kind import NUM_PLAN_KINDS

        self.model, self.pool_size, self.config, self.K = model, pool_size, config, K
        # a bucket's first call may grow the shared state (new tensors): look it up again every step
        self.rebind_every_step = rebind_every_step
        self.state = None
        self.ptrs: dict[int, int] = {}
        self.id_range: Optional[int] = None
        self.live: dict[int, list] = {}  # request id -> its steps: ([G, S, K] top-k, length)
        self.kinds = np.zeros(NUM_PLAN_KINDS, dtype=np.int64)  # plan-kind counts of the replay
        self.complete = True  # every step's plan calls of the announcing lane were recorded

    def _bind(self) -> None:
        from ..state import module_state

        if self.state is None or self.rebind_every_step:
            self.state = module_state(self.model)
            self.ptrs = {g.pool_ids.data_ptr(): n for n, g in enumerate(self.state.groups)}
            self.id_range = int(self.state.groups[0].id_to_slot.size(1)) if self.state.groups else None

    def observe(self, calls: list, rows: Sequence[Optional[int]]) -> None:
        """After a step: ``calls`` are the recorder's ``dsa_plan`` calls of that step (every lane), ``rows``
        the request of each batch row (None: a padding row); a request that left is replayed."""
        self._bind()
        calls = [c for c in calls if c[0] in self.ptrs]  # this step, the announcing lane only
        if len(calls) != len(self.ptrs) or not self.ptrs:
            self.complete = False
            return
        calls.sort(key=lambda c: self.ptrs[c[0]])
        for b, rid in enumerate(rows):
            if rid is None:  # a padding row
                continue
            self.live.setdefault(rid, []).append((np.stack([c[1][b].numpy() for c in calls]), int(calls[0][2][b])))
        for rid in [r for r in self.live if r not in rows]:
            self._replay(self.live.pop(rid))

    def flush(self) -> None:
        """Replay the requests still running when the loop stopped."""
        for rid in list(self.live):
            self._replay(self.live.pop(rid))

    def _replay(self, steps_of: list) -> None:
        # one request alone in a row for its whole life: the static batch, same kernels, same top-k
        from ..trace.format import Trace
        from ..trace.kernel_replay import replay_kernels

        topk = np.stack([tk for tk, _ in steps_of])[:, :, None]  # [n, G, 1, S, K]
        lens = np.array([[L] for _, L in steps_of], dtype=np.int32)
        tr = Trace(topk, lens, self.K, [list(g.layers) for g in self.state.groups], self.config, "compiled")
        for g in range(topk.shape[1]):
            self.kinds[:] += replay_kernels(tr, self.pool_size, group=g, id_range=self.id_range).sum(0)

    def totals(self) -> dict:
        from ..custom_ops.plan_kind import PlanKind

        hits, misses = int(self.kinds[PlanKind.POOL_HIT]), int(self.kinds[PlanKind.FULL_OLD_MISS])
        return {"hits": hits, "misses": misses, "window": int(self.kinds[PlanKind.DECODE_WINDOW]),
                "hit_rate": _rate(hits, misses)}


def _rate(h: int, m: int) -> float:
    return h / (h + m) if h + m else 0.0


def run_serve(config: str = "tiny", steps: int = 64, mode: str = "eager", pool_size: Optional[int] = None,
              next_n: int = 3, batch: int = 4, seed: int = 0, threads: int = 1, unannounced: bool = False,
              on_step: Optional[Callable[[int, Any], None]] = None, max_seconds: float = 0.0,
              buckets: Sequence[int] = (), arrival: float = 1.0, update_ledger: bool = True,
              workload: str = "random", store_tiers: Optional[list] = None, store_rule: Optional[str] = None) -> dict:
    """The serving loop with the unmodified model and the compiled one (:func:`build_lanes`;
    ``unannounced`` adds the lane told nothing), and the static-batch comparison (:class:`StaticReplay`).
    ``on_step(i, server)`` runs after each step (the soak samples memory there); ``max_seconds`` > 0 stops
    after that wall time (``steps`` then says how many ran). ``buckets``: batch sizes below ``batch``
    compiled as batch buckets; ``arrival`` < 1 lets the running count vary so they are used.
    ``update_ledger=False``: both compiled lanes without the ledger update (the NPU modes' default).
    ``workload="multiturn"``: conversations sharing a prefix (``serve_store.multiturn_config``);
    ``store_tiers``: the KV store's tiers (``serve_store.build_tiers``), closed at the end; ``store_rule``:
    ``"measured"`` reloads a prefix only when predicted faster than recomputing (``serve_store.make_store``)."""
    from .. import models
    from ..models.glm.serve import Server, ServeConfig
    from ..trace.record import PlanRecorder

    set_threads(threads)
    over: dict[str, Any] = {"enable_offload": True, "batch_size": batch, "next_n": next_n}
    r = models.load_config(config, **over).runner
    over.update(prefill_len=min(r.prefill_len, r.pa_max_length // 2), decode_steps=1)
    opts: dict[str, Any] = {"exe_mode": mode, "pa_block_size": r.pa_block_size, "next_n": r.next_n,
                            "update_ledger": update_ledger}
    if pool_size is not None:
        opts["pool_size"] = pool_size
    sl = build_lanes(config, over, mode, opts, buckets, batch, unannounced, reference=bool(store_tiers))
    K, cap = sl.ref.config.index_topk, r.pa_max_length
    cfg = (multiturn_config(seed, cap, K, arrival) if workload == "multiturn" else
           ServeConfig(seed=seed, prompt_len=(K, max(K, cap // 2)), output_len=(4, 64), arrival=arrival))
    store, reference = make_store(sl.prefill_model, store_tiers, store_rule) if store_tiers else (None, None)
    srv = Server(sl.lanes, sl.prefill_model, cfg, store=store, reference=reference)
    diffs = [0.0] * (len(sl.lanes) - 1)
    static = StaticReplay(sl.comp.model, sl.backend.options.resolved_pool_size, config, K, bool(sl.small))
    t0 = time.perf_counter()
    done = 0
    with PlanRecorder() as recorder:
        for i in range(steps):
            if (max_seconds > 0 and time.perf_counter() - t0 > max_seconds) or srv.done:
                break  # srv.done: the multi-turn workload's conversations all ended
            outs = srv.step()
            for j, o in enumerate(outs[1:] if outs[0].numel() else ()):  # empty: nothing ran this step
                diffs[j] = max(diffs[j], (outs[0].float() - o.float()).abs().max().item())
            calls = list(recorder.calls)
            recorder.calls.clear()
            static.observe(calls, srv.rows)
            if on_step is not None:
                on_step(i, srv)
            done = i + 1
        static.flush()
    out = _serve_result(config, mode, steps, done, batch, update_ledger, time.perf_counter() - t0, srv, sl, diffs,
                        static)
    if workload != "random":
        out["workload"] = workload
    if store is not None:
        out["reuse"] = reuse_report(srv, store, diffs[-1])
        out["within_tolerance"] = out["within_tolerance"] and diffs[-1] == 0.0  # a reload is exact or wrong
        store.store.close()
    return out


def _serve_result(config: str, mode: str, steps_requested: int, steps: int, batch: int, update_ledger: bool,
                  run_s: float, srv: Any, sl: ServeLanes, diffs: list, static: StaticReplay) -> dict:
    """The ``--serve`` JSON object (key order is part of the output)."""
    from ..state import module_state

    st = module_state(sl.comp.model)
    rep = sl.backend.reports[-1] if sl.backend.reports else {}
    tot = st.totals()
    out = {"config": config, "mode": mode, "steps": steps, "steps_requested": steps_requested, "B": batch,
           "S": srv.S, "K": static.K,
           "pool_size": sl.backend.options.resolved_pool_size, "update_ledger": update_ledger,
           "rewritten": bool(rep.get("rewritten")), "paged": [bool(g.get("paged")) for g in rep.get("groups", [])],
           "requests_finished": srv.finished, "requests_admitted": srv.next_rid, "batch_changes": srv.batch_changes,
           "hits": tot["hits"], "misses": tot["misses"], "window": tot["window"],
           "hit_rate": _rate(tot["hits"], tot["misses"]), "max_abs_diff": diffs[0],
           "tolerance": LOGITS_TOL if mode == "inductor" else 0.0, "run_s": run_s}
    if sl.small:
        out["buckets"] = {str(b): n for b, n in srv.bucket_steps.items()}  # steps per batch bucket
    if static.complete and steps:
        out["static"] = static.totals()
        hits = out["static"]["hits"]
        out["hit_ratio_vs_static"] = tot["hits"] / hits if hits else 0.0
        out["hit_rate_points_vs_static"] = 100.0 * (out["hit_rate"] - out["static"]["hit_rate"])
    if sl.backend2 is not None:
        t2 = module_state(sl.lanes[2].model).totals()
        out["unannounced"] = {"hits": t2["hits"], "misses": t2["misses"], "hit_rate": _rate(t2["hits"], t2["misses"]),
                              "max_abs_diff": diffs[1]}
    out["within_tolerance"] = max(diffs) <= out["tolerance"]
    return out


def summary_serve(o: dict) -> str:
    """The ``--serve`` summary printed without ``--json``."""
    lines = [
        f"offload demo --serve: config={o['config']} mode={o['mode']} steps={o['steps']} B={o['B']} S={o['S']} "
        f"K={o['K']} pool={o['pool_size']}",
        f"  requests: {o['requests_admitted']} admitted, {o['requests_finished']} finished; batch changed on "
        f"{o['batch_changes']} steps; rewritten: {o['rewritten']} (paged groups: {o['paged']})",
        f"  pool: hits {o['hits']}  misses {o['misses']}  window {o['window']}  hit rate {o['hit_rate']:.1%}",
    ]
    if "static" in o:
        lines.append(f"  same requests in a static batch (same kernels, same top-k): hit rate "
                     f"{o['static']['hit_rate']:.1%}; served / static hits {o['hit_ratio_vs_static']:.4f} "
                     f"({o['hit_rate_points_vs_static']:+.2f} points)")
    if "unannounced" in o:
        u = o["unannounced"]
        lines.append(f"  told nothing (in-graph per-row signals only): hit rate {u['hit_rate']:.1%}, "
                     f"max |diff| {u['max_abs_diff']:.3g}")
    lines += summary_reuse(o.get("reuse"))
    lines.append(f"  max |diff| vs the unmodified model, every step: logits {o['max_abs_diff']:.3g}  "
                 f"({'within' if o['within_tolerance'] else 'OUTSIDE'} tolerance)")
    return "\n".join(lines)

"""``offload-demo`` / ``python -m offload_passes.demo``: the unmodified GLM-5.2 decode model vs the
same model compiled with the ``dsa_offload`` backend, prefill + N decode steps, side by side.

Prints a readable summary, or with ``--json`` one JSON object, the same keys for ``--model glm`` and
``--model hf`` (``RESULT_KEYS``; ``null`` where a field does not apply to the front-end): ``groups``,
``ops`` (dsa_plan / dsa_serve / dsa_install in the final graph), ``hits``, ``misses``, ``window``,
``host_rows_read``, ``unmodified_host_rows_read`` (rows the unmodified gather path read from the host
cache, replayed from its own ledger rule; recipe model only; ``baseline_host_rows_read`` repeats it for
one release, ``demo_common.KEY_ALIASES``), ``max_abs_diff`` and ``max_rel_diff``
(each ``{"logits": x, "attn": y}``; relative = to the reference's largest magnitude; ``attn`` is null for
the HF model, whose attention outputs are not exposed), ``tolerance`` (the limits ``within_tolerance``
checks, under the measure they apply to), ``refusals``, ``compile_s``, ``pass_s``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ._cli import (EXIT_CHECK_FAILED, EXIT_OK, ArgumentParser, UsageError, int_arg, parse_ints, read_config, run_cli,
                   writable_dir, writable_file)
from .demo_common import (  # noqa: F401  (the schema and helpers are part of demo's interface)
    ATTN_TOL, DIFF_MEASURES, DIFF_OUTPUTS, LOGITS_TOL, MAX_THREADS, RESULT_KEYS, check_threads, max_diffs,
    op_counts, per_output, result, set_threads)


#: the sections a model config yaml holds (models/glm/config.py; the HF runner's yaml has the same two)
CONFIG_SECTIONS = ("model_config", "runner_config")


def unmodified_host_rows(topk_steps: list, lengths: list, groups: list, S: int) -> int:
    """Rows the unmodified gather path reads from host (docs/ops.md §1.4 ledger, bsz = 1).

    Every layer of a group receives the same top-k, so its ledger evolves identically: row ``r``
    reuses an id iff the previous step placed it there and ``id <= max(L - S - 1, 0)``.
    """
    total = 0
    for gi, layers in enumerate(groups):
        prev: Optional[list] = None
        for tk, L in zip(topk_steps, lengths):
            t = tk[gi]  # [B, S, K]
            B = t.size(0)
            cur = []
            for b in range(B):
                Lb = int(L[b])
                for s in range(S):
                    ms = Lb - (S - 1 - s) - 1
                    ids = [x for x in t[b, s].tolist() if 0 <= x <= ms]
                    reuse = max(Lb - S - 1, 0)
                    old = prev[b * S + s] if prev is not None else set()
                    kept = sum(1 for x in ids if x <= reuse and x in old)
                    total += (len(ids) - kept) * len(layers)
                    cur.append(set(ids))
            prev = cur
    return total


def run(config: str = "tiny", steps: int = 64, mode: str = "eager", pool_size: Optional[int] = None,
        next_n: Optional[int] = None, dump_dir: Optional[str] = None, threads: int = 1,
        record_trace: Optional[str] = None, replacement_policy: str = "fifo") -> dict:
    from . import models
    from .backend import make_offload_backend

    set_threads(threads)
    over: dict[str, Any] = {"enable_offload": True, "decode_steps": steps}
    if next_n is not None:
        over["next_n"] = next_n
    base = models.build(config, **over)
    comp = models.build(config, **over)
    r = comp.runner
    opts: dict[str, Any] = {"exe_mode": mode, "enlarge_pool_size": bool(getattr(r, "enlarge_pool_size", False)),
                            "pa_block_size": r.pa_block_size, "next_n": r.next_n,
                            "replacement_policy": replacement_policy}
    if pool_size is not None:
        opts["pool_size"] = pool_size
    if dump_dir:
        opts["dump_dir"] = dump_dir
    backend = make_offload_backend(**opts)
    step_fn = torch.compile(comp.model, backend=backend)

    # The reference is the unmodified model through the same inner compiler: in inductor mode that is
    # plain Inductor (its fp32 fusions round differently from eager bf16 and can flip a tied top-k),
    # so max_abs_diff measures the rewrite, not Inductor's numerics.
    base_fn = torch.compile(base.model, backend="inductor") if mode == "inductor" else None
    t0 = time.perf_counter()
    res0 = base.driver.run(steps=steps, step_fn=base_fn, collect=True)
    t_base = time.perf_counter() - t0
    t0 = time.perf_counter()
    from .trace.record import PlanRecorder

    # --record-trace: the top-k every dsa_plan of the compiled run receives (offload_passes/trace/format.py)
    with PlanRecorder() if record_trace else contextlib.nullcontext() as recorder:
        res1 = comp.driver.run(steps=steps, step_fn=step_fn, collect=True)
    t_comp = time.perf_counter() - t0
    rep = backend.reports[-1] if backend.reports else {}
    state = backend.state

    d_logits, r_logits = max_diffs(res0.logits, res1.logits)
    d_attn, r_attn = max_diffs([x for s in res0.steps for x in s.attn], [y for s in res1.steps for y in s.attn])
    groups = [g["layers"] for g in rep.get("groups", [])] or base.model.groups()
    S = base.driver.S
    lengths = [(s.positions[:, -1] + 1).tolist() for s in res0.steps]
    base_rows = unmodified_host_rows([s.topk for s in res0.steps], lengths, base.model.groups(), S)
    tot = state.totals() if state is not None else {"hits": 0, "misses": 0, "window": 0, "host_rows_read": 0}
    ops = op_counts(rep, replacement_policy)
    hits, misses = tot["hits"], tot["misses"]
    return result(
        model="glm", config=config, mode=mode, steps=steps, B=base.driver.B, S=S, K=base.driver.K,
        T=r.pa_max_length, prefill=r.prefill_len, dtype=comp.config.torch_dtype,
        pool_size=backend.options.resolved_pool_size,
        rewritten=bool(rep.get("rewritten")), sparse_layers=len(rep.get("sites", [])),
        groups=groups, offload=ops["dsa_plan"] > 0, ops=ops,
        replacement_policy=replacement_policy,
        hits=hits, misses=misses, window=tot["window"],
        hit_rate=hits / (hits + misses) if hits + misses else 0.0,
        host_rows_read=tot["host_rows_read"],
        unmodified_host_rows_read=base_rows,
        host_rows_saved=1.0 - tot["host_rows_read"] / base_rows if base_rows else 0.0,
        reference="unmodified model, " + ("inductor" if mode == "inductor" else "eager"),
        max_abs_diff=per_output(logits=d_logits, attn=d_attn),
        max_rel_diff=per_output(logits=r_logits, attn=r_attn),
        tolerance={"max_abs_diff": per_output(logits=LOGITS_TOL, attn=ATTN_TOL), "max_rel_diff": None},
        within_tolerance=d_logits <= LOGITS_TOL and d_attn <= ATTN_TOL,
        refusals=rep.get("refusals", []),
        compile_s=rep.get("timings", {}).get("total_s", 0.0),
        pass_s=rep.get("timings", {}).get("pass_s", 0.0),
        timings=rep.get("timings", {}),
        state_bytes=state.total_bytes if state is not None else 0,
        run_s={"unmodified": t_base, "compiled": t_comp},
        trace=_save_trace(recorder, backend.state, config, record_trace) if record_trace else None,
    )


def run_serve(config: str = "tiny", steps: int = 64, mode: str = "eager", pool_size: Optional[int] = None,
              next_n: int = 3, batch: int = 4, seed: int = 0, threads: int = 1, unannounced: bool = False,
              on_step: Optional[Any] = None, max_seconds: float = 0.0, buckets: Sequence[int] = (),
              arrival: float = 1.0, update_ledger: bool = True) -> dict:
    """The serving loop (``models/glm/serve.py``: continuous batching on the cache manager's block tables,
    a C++ KV transfer that moves no version counter, varying MTP acceptance) with the unmodified model and
    the compiled one (the engine adapter, ``engine.EngineAdapter``: ``OffloadState.move_rows`` on every
    batch change) side by side; ``unannounced`` adds
    a third lane compiled the same way that is told nothing (per-row in-graph signals only).

    The static-batch comparison on the same trace: every request's recorded top-k (what the compiled
    lane's ``dsa_plan`` received) replayed through the same plan / install kernels in a row of its own
    for its whole life (``trace.kernel_replay``): what a static batch, whose rows keep their request,
    would hit on exactly these requests. ``on_step(i, server)`` runs after each step (the soak samples
    memory there); ``max_seconds`` > 0 stops after that wall time (``steps`` then says how many ran).
    ``buckets``: batch sizes below ``batch`` compiled as batch buckets over the same caches
    (``serve.bucket_model``); ``arrival`` < 1 lets the running count vary so they are used.
    ``update_ledger=False``: both compiled lanes without the ledger update (the NPU modes' default)."""
    from . import models
    from .backend import make_offload_backend
    from .custom_ops.plan_kind import NUM_PLAN_KINDS, PlanKind
    from .engine import EngineAdapter
    from .models.glm.serve import Lane, Server, ServeConfig, bucket_model
    from .state import module_state
    from .trace.format import Trace
    from .trace.kernel_replay import replay_kernels
    from .trace.record import PlanRecorder

    set_threads(threads)
    over: dict[str, Any] = {"enable_offload": True, "batch_size": batch, "next_n": next_n}
    r = models.load_config(config, **over).runner
    over.update(prefill_len=min(r.prefill_len, r.pa_max_length // 2), decode_steps=1)
    ref = models.build(config, **over)
    comp = models.build(config, **over)
    pm = models.build(config, **dict(over, batch_size=1)).model
    opts: dict[str, Any] = {"exe_mode": mode, "pa_block_size": r.pa_block_size, "next_n": r.next_n,
                            "update_ledger": update_ledger}
    if pool_size is not None:
        opts["pool_size"] = pool_size
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
    K, cap = ref.config.index_topk, r.pa_max_length
    cfg = ServeConfig(seed=seed, prompt_len=(K, max(K, cap // 2)), output_len=(4, 64), arrival=arrival)
    srv = Server(lanes, pm, cfg)
    diffs = [0.0] * (len(lanes) - 1)
    IR = None
    ptrs: dict[int, int] = {}
    live: dict[int, list] = {}  # request id -> its steps: ([G, S, K] top-k, length)
    kinds = np.zeros(NUM_PLAN_KINDS, dtype=np.int64)  # plan-kind counts of the static replay
    replayed = [True]

    def replay(steps_of: list) -> None:
        # one request alone in a row for its whole life: the static batch, same kernels, same top-k
        topk = np.stack([tk for tk, _ in steps_of])[:, :, None]  # [n, G, 1, S, K]
        lens = np.array([[L] for _, L in steps_of], dtype=np.int32)
        tr = Trace(topk, lens, K, [list(g.layers) for g in st.groups], config, "compiled")
        for g in range(topk.shape[1]):
            kinds[:] += replay_kernels(tr, backend.options.resolved_pool_size, group=g, id_range=IR).sum(0)

    t0 = time.perf_counter()
    done = 0
    st = None
    with PlanRecorder() as recorder:
        for i in range(steps):
            if max_seconds > 0 and time.perf_counter() - t0 > max_seconds:
                break
            outs = srv.step()
            for j, o in enumerate(outs[1:]):
                diffs[j] = max(diffs[j], (outs[0].float() - o.float()).abs().max().item())
            if st is None or small:  # a bucket's first call may grow the shared state (new tensors)
                st = module_state(comp.model)
                ptrs = {g.pool_ids.data_ptr(): n for n, g in enumerate(st.groups)}
                IR = int(st.groups[0].id_to_slot.size(1)) if st.groups else None
            calls = [c for c in recorder.calls if c[0] in ptrs]  # this step, the announcing lane only
            recorder.calls.clear()
            if len(calls) != len(ptrs) or not ptrs:
                replayed[0] = False
            else:
                calls.sort(key=lambda c: ptrs[c[0]])
                for b, rid in enumerate(srv.rows):
                    if rid is None:  # a padding row
                        continue
                    live.setdefault(rid, []).append((np.stack([c[1][b].numpy() for c in calls]), int(calls[0][2][b])))
                for rid in [r for r in live if r not in srv.rows]:
                    replay(live.pop(rid))
            if on_step is not None:
                on_step(i, srv)
            done = i + 1
        for rid in list(live):
            replay(live.pop(rid))
    run_s = time.perf_counter() - t0
    steps_requested, steps = steps, done
    st = module_state(comp.model)
    rep = backend.reports[-1] if backend.reports else {}

    def rate(h: int, m: int) -> float:
        return h / (h + m) if h + m else 0.0

    tot = st.totals()
    out = {"config": config, "mode": mode, "steps": steps, "steps_requested": steps_requested, "B": batch,
           "S": srv.S, "K": K,
           "pool_size": backend.options.resolved_pool_size, "update_ledger": update_ledger,
           "rewritten": bool(rep.get("rewritten")), "paged": [bool(g.get("paged")) for g in rep.get("groups", [])],
           "requests_finished": srv.finished, "requests_admitted": srv.next_rid, "batch_changes": srv.batch_changes,
           "hits": tot["hits"], "misses": tot["misses"], "window": tot["window"],
           "hit_rate": rate(tot["hits"], tot["misses"]), "max_abs_diff": diffs[0],
           "tolerance": LOGITS_TOL if mode == "inductor" else 0.0, "run_s": run_s}
    if small:
        out["buckets"] = {str(b): n for b, n in srv.bucket_steps.items()}  # steps per batch bucket
    if replayed[0] and steps:
        hits, misses = int(kinds[PlanKind.POOL_HIT]), int(kinds[PlanKind.FULL_OLD_MISS])
        out["static"] = {"hits": hits, "misses": misses, "window": int(kinds[PlanKind.DECODE_WINDOW]),
                         "hit_rate": rate(hits, misses)}
        out["hit_ratio_vs_static"] = tot["hits"] / hits if hits else 0.0
        out["hit_rate_points_vs_static"] = 100.0 * (out["hit_rate"] - out["static"]["hit_rate"])
    if backend2 is not None:
        st2 = module_state(lanes[2].model)
        t2 = st2.totals()
        out["unannounced"] = {"hits": t2["hits"], "misses": t2["misses"], "hit_rate": rate(t2["hits"], t2["misses"]),
                              "max_abs_diff": diffs[1]}
    out["within_tolerance"] = max(diffs) <= out["tolerance"]
    return out


def _summary_serve(o: dict) -> str:
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
    lines.append(f"  max |diff| vs the unmodified model, every step: logits {o['max_abs_diff']:.3g}  "
                 f"({'within' if o['within_tolerance'] else 'OUTSIDE'} tolerance)")
    return "\n".join(lines)


def _save_trace(recorder, state, config: str, path: str) -> str:
    from .trace.format import save_trace

    if state is None:
        raise RuntimeError("--record-trace: the graph was not rewritten, no dsa_plan ran")
    try:
        return str(save_trace(recorder.trace_for(state, config), path))
    except OSError as e:  # the folder was checked before the run; the write itself can still fail
        raise UsageError(f"--record-trace {path!r}: {e.strerror or e}") from None


def _summary(o: dict) -> str:
    lines = [
        f"offload demo: config={o['config']} mode={o['mode']} steps={o['steps']} B={o['B']} S={o['S']} K={o['K']} "
        f"pool={o['pool_size']}",
        f"  rewritten: {o['rewritten']}   groups: {o['groups']}",
        f"  final graph: {o['ops']['dsa_plan']} dsa_plan, {o['ops']['dsa_serve']} dsa_serve, "
        + (f"{o['ops']['dsa_install_sc']} dsa_install_sc (second chance)" if o["ops"].get("dsa_install_sc")
           else f"{o['ops']['dsa_install']} dsa_install"),
        f"  pool: hits {o['hits']}  misses {o['misses']}  window {o['window']}  hit rate {o['hit_rate']:.1%}",
        f"  host rows read: {o['host_rows_read']} (unmodified gather path: {o['unmodified_host_rows_read']}, "
        f"saved {o['host_rows_saved']:.1%})",
        f"  max |diff| vs {o['reference']}: logits {o['max_abs_diff']['logits']:.3g}, attention "
        f"{o['max_abs_diff']['attn']:.3g}  ({'within' if o['within_tolerance'] else 'OUTSIDE'} tolerance)",
        f"  compile {o['compile_s']:.2f} s, of which passes {o['pass_s'] * 1e3:.1f} ms; "
        f"state {o['state_bytes'] / 2**20:.2f} MiB",
    ]
    for r in o["refusals"]:
        lines.append(f"  refused: {r['reason']}: {r['detail']}")
    if o.get("trace"):
        lines.append(f"  top-k trace written to {o['trace']} (replay: offload-sim {o['trace']})")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = ArgumentParser(prog="offload-demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("glm", "hf"), default="glm",
                   help="glm: the recipe-form GLM-5.2 model; hf: an unmodified transformers DSA model (docs/hf.md)")
    p.add_argument("--config", default=None,
                   help="model preset (tiny, small, glm-5.2-78l, tiny-w8a8, glm-5.2-78l-w8a8; with --model hf: "
                        "hf-tiny, hf-glm5-attn, hf-deepseek-v32, hf-hy-v4, hf-dots3-note, hf-glm5-next, "
                        "hf-deepseek-v4) or yaml path (an existing file or a name ending in .yaml / .yml; a preset name "
                        "wins; default tiny / hf-tiny)")
    p.add_argument("--attn", choices=("eager", "sdpa"), default=None, help="--model hf: attn_implementation")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="--model hf: model dtype (bfloat16 enables the offload ops)")
    p.add_argument("--steps", type=int_arg("--steps", 1), default=64, help="decode steps (default 64)")
    p.add_argument("--mode", choices=("eager", "inductor"), default="eager")
    p.add_argument("--pool-size", type=int_arg("--pool-size"), default=None,
                   help="pool slots per batch row (default 8192 / 16384)")
    p.add_argument("--next-n", type=int_arg("--next-n"), default=None, help="MTP tokens (S = 1 + next_n)")
    p.add_argument("--dump-dir", default=None, help="write graphs and report.json here")
    p.add_argument("--record-trace", default=None, metavar="TRACE.npz",
                   help="write the compiled run's top-k trace (replay with offload-sim)")
    p.add_argument("--replacement-policy", choices=("fifo", "second_chance"), default="fifo",
                   help="pool replacement (second_chance: the opt-in CPU kernel, not on the NPU)")
    p.add_argument("--threads", type=int_arg("--threads"), default=1,
                   help=f"torch CPU threads, at most os.cpu_count() = {MAX_THREADS} (0 = torch default)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--world", type=int_arg("--world"), default=1, metavar="N",
                   help="spawn N ranks (gloo, loopback) of the recipe's multi-rank layout and compare every rank "
                        "with its own unmodified model (offload_passes/demo_world.py; --model glm)")
    p.add_argument("--serve", action="store_true",
                   help="the serving loop (models/glm/serve.py): continuous batching on paged KV, B=4 rows, "
                        "next_n 3 unless given; --model glm")
    p.add_argument("--buckets", default="", metavar="B1,B2",
                   help="--serve: batch buckets, e.g. 2,4: one graph per batch size over the same caches, the "
                        "smallest that holds the running requests runs (sizes in [1, 4])")
    p.add_argument("--arrival", type=float, default=1.0,
                   help="--serve: probability that a request waits when a row frees (1: the batch stays full)")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, stream=sys.stderr)
    return run_cli("offload-demo", lambda: _main(a))


def _main(a: argparse.Namespace) -> int:
    from .options import OffloadOptions

    # bad input is found before anything is built or compiled (exit 2, one line)
    check_threads(a.threads)
    if a.next_n is not None and not 0 <= a.next_n <= 3:
        raise UsageError(f"--next-n must be in [0, 3] (S = 1 + next_n <= 4), got {a.next_n}")
    if a.pool_size is not None:
        OffloadOptions(pool_size=a.pool_size)  # raises "option pool_size must ..." naming the limit
    if a.dump_dir:
        writable_dir(a.dump_dir, "--dump-dir")
    if a.record_trace:
        writable_file(a.record_trace, "--record-trace")
    if a.config is not None and config_is_path(a.config, a.model):
        # a path, not a preset: a readable yaml with the model's sections, never a silent default
        read_config(a.config, "--config", CONFIG_SECTIONS)
    _check_config_fits_model(a.model, a.config)
    if a.serve and (a.world != 1 or a.model != "glm"):
        raise UsageError("--serve applies to --model glm on one process (no --world)")
    if (a.buckets or a.arrival != 1.0) and not a.serve:
        raise UsageError("--buckets / --arrival apply to --serve only")
    if a.world != 1:  # the multi-rank demo (demo_world.py)
        from .demo_world import MAX_WORLD, main_world

        if not 2 <= a.world <= MAX_WORLD:
            raise UsageError(f"--world must be in [1, {MAX_WORLD}], got {a.world}")
        if a.model != "glm" or a.next_n is not None or a.record_trace or a.replacement_policy != "fifo":
            raise UsageError("--world applies to --model glm without --next-n / --record-trace / --replacement-policy")
        return main_world(a.world, a.mode, a.steps, a.config or "tiny", a.pool_size, a.dump_dir, a.json)
    if a.model == "hf":  # the Hugging Face front-end (demo_hf.py)
        from .demo_hf import run_hf, summary_hf

        if a.next_n is not None or a.record_trace:
            raise UsageError("--next-n / --record-trace apply to --model glm only")
        out = run_hf(a.config or "hf-tiny", a.steps, a.mode, a.pool_size, a.dump_dir, a.threads, a.attn, a.dtype,
                     replacement_policy=a.replacement_policy)
        print(json.dumps(out, indent=1) if a.json else summary_hf(out))
        return EXIT_OK if out["within_tolerance"] else EXIT_CHECK_FAILED
    if a.attn or a.dtype:
        raise UsageError("--attn / --dtype apply to --model hf only")
    if a.serve:
        if a.record_trace or a.replacement_policy != "fifo" or a.dump_dir:
            raise UsageError("--serve does not take --record-trace / --replacement-policy / --dump-dir")
        buckets = parse_buckets(a.buckets, 4)
        check_arrival(a.arrival)
        out = run_serve(a.config or "tiny", a.steps, a.mode, a.pool_size, 3 if a.next_n is None else a.next_n,
                        threads=a.threads, buckets=buckets, arrival=a.arrival)
        print(json.dumps(out, indent=1) if a.json else _summary_serve(out))
        return EXIT_OK if out["within_tolerance"] else EXIT_CHECK_FAILED
    out = run(a.config or "tiny", a.steps, a.mode, a.pool_size, a.next_n, a.dump_dir, a.threads, a.record_trace,
              a.replacement_policy)
    print(json.dumps(out, indent=1) if a.json else _summary(out))
    return EXIT_OK if out["within_tolerance"] else EXIT_CHECK_FAILED


def parse_buckets(text: str, batch: int) -> list[int]:
    """``--buckets "2,4"`` (any order) -> ``[2, 4]``; every size in ``[1, batch]`` (``batch``: the serving
    loop's rows)."""
    if not text:
        return []
    return sorted(set(parse_ints(text, "--buckets", 1, batch)))


def check_arrival(arrival: float) -> None:
    """``--arrival``: the probability that a request waits at a free row, in ``(0, 1]``
    (``serve.ServeConfig.arrival``)."""
    if not 0.0 < arrival <= 1.0:
        raise UsageError(f"--arrival must be in (0, 1], got {arrival}")


def config_is_path(config: str, model: str = "glm") -> bool:
    """Whether ``--config`` names a yaml file (True) or a preset (False). A known preset name wins (a name
    such as ``glm-5.2-78l`` has a dot and may even match a file in the working folder); a path is
    something that exists or ends in ``.yaml`` / ``.yml``. Anything else is a ``UsageError`` that lists
    the presets of ``model`` (``glm`` or ``hf``)."""
    from .models import hf, list_presets

    if config in list_presets():  # one folder holds both front-ends' presets
        return False
    if config.endswith((".yaml", ".yml")) or os.path.exists(config):
        return True
    presets = hf.list_presets() if model == "hf" else [c for c in list_presets() if c not in hf.list_presets()]
    raise UsageError(f"--config {config!r}: no such preset and not a yaml path (--model {model} presets: "
                     f"{', '.join(presets)}; a path ends in .yaml or .yml)")


def _check_config_fits_model(model: str, config: Optional[str]) -> None:
    """A recipe-form preset / yaml given to ``--model hf`` (or an HF one to ``--model glm``) is a user
    mistake: name the presets that fit, before anything is built."""
    from .models import hf, list_presets

    if config is None:
        return
    hf_presets = hf.list_presets()
    glm_presets = [c for c in list_presets() if c not in hf_presets]  # one config folder holds both
    if model == "glm" and config in hf_presets:
        raise UsageError(f"--config {config!r} is a Hugging Face preset: use it with --model hf "
                         f"(--model glm takes {glm_presets} or a recipe yaml)")
    if model != "hf":
        return
    if config in glm_presets:
        raise UsageError(f"--config {config!r} is a recipe-form preset (--model glm); --model hf takes "
                         f"{hf_presets} or an HF yaml (model_config + runner_config)")
    if config_is_path(config, model) and os.path.isfile(config):
        data = read_config(config, "--config", CONFIG_SECTIONS)
        rc = data.get("runner_config", {})
        bad = sorted(set(rc) - set(hf.RUNNER_KEYS)) if isinstance(rc, dict) else []
        if bad:
            raise UsageError(f"--config {config!r} is not an HF config: runner_config keys {bad} are unknown to "
                             f"--model hf (known: {list(hf.RUNNER_KEYS)}); the HF presets are {hf_presets}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

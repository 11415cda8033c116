"""Pass time as a share of total compile time, and its growth from 39 to 78 layers.

    python benchmarks/bench_compile.py [--config glm-5.2-78l] [--layers 39 78] [--mode eager]
    python benchmarks/bench_compile.py --passes-only [--repeat 5]     # passes alone on a captured graph

Default: for each layer count, build the preset (``num_hidden_layers`` overridden), compile the decode
step with the offload backend and time the first call (Dynamo trace + our passes + AOT + lowering + one
step) against the second (one step). ``pass`` = detect + group + plan + rewrite + reinplace; state
allocation (zero-filling the pools) is reported apart, it is memory bandwidth, not pass work. ``gc`` is
the time Python's cyclic garbage collector spent during the whole first call (the passes pause it, so a
full sweep of the compiler's heap is never charged to them, see ``passes/_fx.paused_gc``).

``--passes-only`` captures the Dynamo graph once (a tiny backend that keeps the GraphModule and the
example inputs) and times ``rewrite_for_offload`` alone on fresh copies (best of ``--repeat``), no AOT
and hence no reinplace: the quickest way to profile the pre-AOT passes.

Prints a table, the per-pass growth ratios and the targets (pass < 5 % of compile, growth ~ layers).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import time
from typing import Any

import torch

PASSES = ("detect_s", "group_s", "plan_s", "rewrite_s", "reinplace_s")
EXTRA = ("alloc_s", "aot_s")


class _GcClock:
    """Wall time and generation-2 count of the cyclic GC between ``start()`` and ``stop()``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._t = 0.0

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t
            self.full += info.get("generation") == 2

    def __enter__(self) -> "_GcClock":
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._cb)


def _build(config: str, layers: int):
    from offload_passes import models

    torch._dynamo.reset()
    return models.build(config, num_hidden_layers=layers, enable_offload=True)


def measure(config: str, layers: int, mode: str) -> dict:
    from offload_passes.backend import make_offload_backend

    b = _build(config, layers)
    be = make_offload_backend(exe_mode=mode, pa_block_size=b.runner.pa_block_size, next_n=b.runner.next_n)
    step = torch.compile(b.model, backend=be)
    ids, pos = b.driver.next_inputs()
    gc.collect()
    with torch.no_grad():
        with _GcClock() as clock:
            t0 = time.perf_counter()
            step(ids, pos)
            first = time.perf_counter() - t0
        t0 = time.perf_counter()
        step(ids, pos)
        second = time.perf_counter() - t0
    # Dynamo may split the step into several graphs: add up every graph this backend compiled
    reps = be.reports
    tsum = {k: sum(r["timings"].get(k, 0.0) for r in reps) for k in ("total_s", "pass_s") + PASSES + EXTRA}
    compile_s = max(first - second, tsum["total_s"])
    return {"layers": layers, "graphs": len(reps), "groups": sum(len(r["groups"]) for r in reps),
            "sites": sum(len(r["sites"]) for r in reps), "rewritten": any(r["rewritten"] for r in reps),
            "compile_s": compile_s, "backend_s": tsum["total_s"], **{k: v for k, v in tsum.items() if k != "total_s"},
            "share": tsum["pass_s"] / compile_s, "gc_s": clock.seconds, "gc_full": clock.full,
            "refusals": [x for r in reps for x in r["refusals"]]}


def measure_passes(config: str, layers: int, repeat: int) -> dict:
    """Best-of-``repeat`` pre-AOT pass timings on copies of one captured Dynamo graph."""
    from offload_passes.backend import rewrite_for_offload
    from offload_passes.options import OffloadOptions

    b = _build(config, layers)
    got: list = []

    def grab(gm, ex):
        got.append((gm, list(ex)))
        return gm.forward

    ids, pos = b.driver.next_inputs()
    t0 = time.perf_counter()
    with torch.no_grad():
        torch.compile(b.model, backend=grab)(ids, pos)
    capture_s = time.perf_counter() - t0
    gm, ex = max(got, key=lambda t: len(t[0].graph.nodes))
    opts = OffloadOptions(pa_block_size=b.runner.pa_block_size, next_n=b.runner.next_n)
    best: dict = {}
    for _ in range(repeat):
        g2 = copy.deepcopy(gm)
        _, state, rep = rewrite_for_offload(g2, ex, opts)
        t = rep["timings"]
        t["pass_s"] = sum(t.get(k, 0.0) for k in PASSES)
        best = t if not best or t["pass_s"] < best["pass_s"] else best
        del g2, state
    return {"layers": layers, "nodes": len(gm.graph.nodes), "sites": len(rep["sites"]), "capture_s": capture_s,
            **{k: best.get(k, 0.0) for k in ("pass_s",) + PASSES + ("alloc_s",)}}


def _ms(x: float) -> str:
    return f"{x * 1e3:8.1f}"


def _ratio(a: float, b: float) -> str:
    return f"x{b / a:.2f}" if a > 0 else "   -"


def print_table(rows: list[dict], config: str) -> None:
    print(f"{config}: compile = first call - second call (Dynamo + passes + AOT + lowering); times in ms unless s")
    print(f"{'layers':>6} {'graphs':>6} {'sites':>5} {'compile s':>9} {'pass':>8} {'share':>6} "
          f"{'detect':>8} {'group':>8} {'plan':>8} {'rewrite':>8} {'reinpl.':>8} | {'alloc':>8} {'aot s':>6} "
          f"{'gc s':>6} {'gc2':>3}")
    for r in rows:
        print(f"{r['layers']:6d} {r['graphs']:6d} {r['sites']:5d} {r['compile_s']:9.2f} {_ms(r['pass_s'])} "
              f"{r['share']:6.2%} " + " ".join(_ms(r[k]) for k in PASSES)
              + f" | {_ms(r['alloc_s'])} {r['aot_s']:6.2f} {r['gc_s']:6.2f} {r['gc_full']:3d}")
        if r["refusals"]:
            print(f"       refusals: {r['refusals'][:3]}")
    if len(rows) >= 2:
        r0, r1 = rows[0], rows[-1]
        print(f"growth {r0['layers']} -> {r1['layers']} layers (x{r1['layers'] / r0['layers']:.2f}): "
              f"compile {_ratio(r0['compile_s'], r1['compile_s'])}, pass {_ratio(r0['pass_s'], r1['pass_s'])} ("
              + ", ".join(f"{k[:-2]} {_ratio(r0[k], r1[k])}" for k in PASSES) + ")")
    worst = max(r["share"] for r in rows)
    print(f"target: pass < 5% of compile -> worst share {worst:.2%} ({'ok' if worst < 0.05 else 'MISSED'})")


def print_passes_table(rows: list[dict], config: str) -> None:
    print(f"{config}: pre-AOT passes alone on a captured Dynamo graph (best of repeats), ms")
    print(f"{'layers':>6} {'nodes':>6} {'sites':>5} {'pass':>8} {'detect':>8} {'group':>8} {'plan':>8} "
          f"{'rewrite':>8} | {'alloc':>8}")
    for r in rows:
        print(f"{r['layers']:6d} {r['nodes']:6d} {r['sites']:5d} {_ms(r['pass_s'])} "
              + " ".join(_ms(r[k]) for k in PASSES[:4]) + f" | {_ms(r['alloc_s'])}")
    if len(rows) >= 2:
        r0, r1 = rows[0], rows[-1]
        print(f"growth {r0['layers']} -> {r1['layers']} layers (nodes x{r1['nodes'] / r0['nodes']:.2f}): "
              f"pass {_ratio(r0['pass_s'], r1['pass_s'])} ("
              + ", ".join(f"{k[:-2]} {_ratio(r0[k], r1[k])}" for k in PASSES[:4]) + ")")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="glm-5.2-78l")
    p.add_argument("--layers", type=int, nargs="+", default=[39, 78])
    p.add_argument("--mode", default="eager", choices=("eager", "inductor"))
    p.add_argument("--passes-only", action="store_true", help="time the pre-AOT passes alone on a captured graph")
    p.add_argument("--repeat", type=int, default=5, help="repeats for --passes-only (best is reported)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.passes_only:
        rows = [measure_passes(a.config, n, a.repeat) for n in a.layers]
    else:
        rows = [measure(a.config, n, a.mode) for n in a.layers]
    if a.json:
        print(json.dumps(rows, indent=1, default=str))
    elif a.passes_only:
        print_passes_table(rows, a.config)
    else:
        print_table(rows, a.config)


if __name__ == "__main__":
    main()

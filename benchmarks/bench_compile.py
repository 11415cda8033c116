"""Pass time as a share of total compile time, and its growth from 39 to 78 layers.

    python benchmarks/bench_compile.py [--config glm-5.2-78l] [--layers 39 78] [--mode eager]

For each layer count: build the preset (``num_hidden_layers`` overridden), compile the decode step
with the ``dsa_offload`` backend and time the first call (Dynamo trace + our passes + AOT + lowering
+ one step) against the second (one step). ``pass`` = detect + group + plan + rewrite + reinplace.
Prints one line per layer count and the ratios (target: pass < 5 % of compile, linear growth).
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def measure(config: str, layers: int, mode: str) -> dict:
    from offload_passes import models
    from offload_passes.backend import make_offload_backend

    torch._dynamo.reset()
    b = models.build(config, num_hidden_layers=layers, enable_offload=True)
    be = make_offload_backend(exe_mode=mode)
    step = torch.compile(b.model, backend=be)
    ids, pos = b.driver.next_inputs()
    with torch.no_grad():
        t0 = time.perf_counter()
        step(ids, pos)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        step(ids, pos)
        second = time.perf_counter() - t0
    # Dynamo may split the step into several graphs: add up every graph this backend compiled
    reps = be.reports
    tsum = {k: sum(r["timings"].get(k, 0.0) for r in reps)
            for k in ("total_s", "pass_s", "detect_s", "plan_s", "rewrite_s", "reinplace_s", "alloc_s", "aot_s")}
    compile_s = max(first - second, tsum["total_s"])
    return {"layers": layers, "graphs": len(reps), "groups": sum(len(r["groups"]) for r in reps),
            "sites": sum(len(r["sites"]) for r in reps), "rewritten": any(r["rewritten"] for r in reps),
            "compile_s": compile_s, "backend_s": tsum["total_s"], **{k: v for k, v in tsum.items() if k != "total_s"},
            "share": tsum["pass_s"] / compile_s, "refusals": [x for r in reps for x in r["refusals"]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="glm-5.2-78l")
    p.add_argument("--layers", type=int, nargs="+", default=[39, 78])
    p.add_argument("--mode", default="eager", choices=("eager", "inductor"))
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    rows = [measure(a.config, n, a.mode) for n in a.layers]
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        print(f"{a.config} {r['layers']:3d} layers ({r['graphs']} graph(s), {r['sites']} sites, {r['groups']} groups): "
              f"compile {r['compile_s']:.2f} s, backend {r['backend_s']:.2f} s, passes {r['pass_s'] * 1e3:.1f} ms "
              f"(detect {r['detect_s'] * 1e3:.1f}, plan {r['plan_s'] * 1e3:.1f}, rewrite {r['rewrite_s'] * 1e3:.1f}, "
              f"reinplace {r['reinplace_s'] * 1e3:.1f}) = {r['share']:.2%} of compile; "
              f"state allocation {r['alloc_s'] * 1e3:.0f} ms")
    if len(rows) >= 2:
        r0, r1 = rows[0], rows[-1]
        print(f"growth {r0['layers']} -> {r1['layers']} layers (x{r1['layers'] / r0['layers']:.2f}): "
              f"pass time x{r1['pass_s'] / r0['pass_s']:.2f}, compile time x{r1['compile_s'] / r0['compile_s']:.2f}")


if __name__ == "__main__":
    main()

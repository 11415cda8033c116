"""Hardware check for an Atlas A3 (Ascend 910_93): compile and run ``tiny`` and ``glm-5.2-78l`` with
the offload backend in ``ge_graph`` and ``npugraph_ex`` modes, print correctness and timing.

Run on a machine with CANN, torch_npu (matching torch) and this package installed::

    python -m offload_passes.tools.atlas_check                       # both presets, both modes
    python -m offload_passes.tools.atlas_check --models tiny --modes npugraph_ex --steps 16
    python -m offload_passes.tools.atlas_check --dry-run            # what would run + environment (any machine)

For every preset it builds the model on the NPU with ``enable_offload`` / ``shared_indexer_offload``,
prefills once, and runs from that same state (deep copies):

* ``eager``: the unmodified model, op by op (the reference: basic offload with the gather op);
* each mode: ``torch.compile(model, backend=NpuOffloadBackend(exe_mode=mode))`` — rewritten to
  plan / serve / side-stream install and compiled by TorchAir (GE) or npugraph_ex (ACL graph).

Printed per run: compile time, mean decode-step time (after ``--warmup`` steps, device-synchronized),
max |logits - eager| over the steps, pool hit rate, and PASS/FAIL against ``--tol``. Exit code 0 when
every run passes, 1 if any fails, 2 if the environment cannot run the check. ``--json`` writes the
results. This script is never run by the CPU test suite (it is only import- and dry-run-tested there).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

PRESETS = ("tiny", "glm-5.2-78l")
MODES = ("ge_graph", "npugraph_ex")


@dataclass
class RunResult:
    preset: str
    mode: str
    ok: bool = False
    compile_s: float = 0.0
    step_ms: float = 0.0
    eager_step_ms: float = 0.0
    max_abs_diff: float = float("nan")
    hit_rate: Optional[float] = None
    rewritten: Optional[bool] = None
    error: Optional[str] = None
    per_step_diff: List[float] = field(default_factory=list)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m offload_passes.tools.atlas_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(PRESETS), help=f"comma-separated presets (default {','.join(PRESETS)})")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated modes from {MODES}")
    ap.add_argument("--steps", type=int, default=8, help="measured decode steps per run (default 8)")
    ap.add_argument("--warmup", type=int, default=2, help="steps run before timing; the first compiles (default 2)")
    ap.add_argument("--pool-size", type=int, default=None, help="pool slots per row (default: backend default 8192)")
    ap.add_argument("--device", default="npu:0")
    ap.add_argument("--tol", type=float, default=2e-2, help="max |logits - eager| to pass (default 2e-2)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="model / runner overrides")
    ap.add_argument("--no-side-stream", action="store_true", help="keep installs on the main stream")
    ap.add_argument("--plain-config", action="store_true",
                    help="default TorchAir / npugraph_ex settings instead of the recipe's (frozen parameters ...)")
    ap.add_argument("--json", default=None, help="write the results to this file")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the environment, run nothing")
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown mode(s) {bad}; choose from {list(MODES)}")
    if args.steps < 1 or args.warmup < 1:
        ap.error(f"--steps and --warmup must be >= 1, got steps={args.steps} warmup={args.warmup}")
    args.overrides = _parse_overrides(args.set, ap)
    return args


def _parse_overrides(items: Sequence[str], ap: argparse.ArgumentParser) -> Dict[str, Any]:
    import yaml

    out = {}
    for it in items:
        if "=" not in it:
            ap.error(f"--set expects KEY=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        out[k] = yaml.safe_load(v)
    return out


def environment() -> Dict[str, Any]:
    """What this machine has, without importing torch_npu (importing it has side effects)."""
    def has(mod: str) -> bool:
        try:
            return importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            return False

    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "torch_npu": has("torch_npu"),
        "torchair": has("torchair") or has("torch_npu"),
        "ascend_home": os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME"),
    }


def plan_text(args: argparse.Namespace) -> str:
    lines = [f"atlas_check plan: device {args.device}, {args.warmup} warmup + {args.steps} measured steps, "
             f"tol {args.tol}, pool_size {args.pool_size or 'default'}, side stream {not args.no_side_stream}, "
             f"{'plain' if args.plain_config else 'recipe'} compiler config"]
    for m in args.models:
        lines.append(f"  {m}: eager (reference)" + "".join(f", {mode}" for mode in args.modes))
    if args.overrides:
        lines.append(f"  overrides: {args.overrides}")
    return "\n".join(lines)


def format_table(results: Sequence[RunResult], tol: float) -> str:
    head = f"{'preset':14s} {'mode':12s} {'compile s':>9s} {'step ms':>9s} {'eager ms':>9s} {'speedup':>8s} " \
           f"{'max|diff|':>10s} {'hit rate':>8s}  result"
    rows = [head, "-" * len(head)]
    for r in results:
        speed = f"{r.eager_step_ms / r.step_ms:.2f}x" if r.step_ms > 0 and r.eager_step_ms > 0 else "-"
        hit = f"{100 * r.hit_rate:.1f}%" if r.hit_rate is not None else "-"
        verdict = "PASS" if r.ok else ("ERROR: " + r.error if r.error else f"FAIL (> {tol})")
        rows.append(f"{r.preset:14s} {r.mode:12s} {r.compile_s:9.1f} {r.step_ms:9.2f} {r.eager_step_ms:9.2f} "
                    f"{speed:>8s} {r.max_abs_diff:10.3g} {hit:>8s}  {verdict}")
    return "\n".join(rows)


def _hit_rate(state) -> Optional[float]:
    if state is None:
        return None
    hits = misses = 0
    for c in state.counters():
        hits += c["total"]["hits"]
        misses += c["total"]["misses"]
    return hits / (hits + misses) if hits + misses else None


def _run_steps(built, step_fn, n: int, sync) -> tuple:
    logits, times = [], []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        out = built.driver.step(step_fn)
        sync()
        times.append(time.perf_counter() - t0)
        logits.append(out.logits.float().cpu())
    return logits, times


def run_check(args: argparse.Namespace) -> List[RunResult]:  # pragma: no cover - needs an Atlas A3
    import copy

    import torch
    import torch_npu  # noqa: F401  (registers the NPU device and the npu ops)

    from offload_passes import models
    from offload_passes.npu_modes import NpuOffloadBackend, recipe_compiler_config

    sync = torch.npu.synchronize
    results: List[RunResult] = []
    for preset in args.models:
        total = args.warmup + args.steps
        over = {"decode_steps": total, **args.overrides}
        base = models.build(preset, device=args.device, enable_offload=True, shared_indexer_offload=True, **over)
        base.driver.prefill()
        ref = copy.deepcopy(base)
        ref_logits, ref_times = _run_steps(ref, None, total, sync)
        eager_ms = 1e3 * sum(ref_times[args.warmup:]) / args.steps
        del ref
        for mode in args.modes:
            r = RunResult(preset, mode, eager_step_ms=eager_ms)
            try:
                torch._dynamo.reset()
                b = copy.deepcopy(base)
                kw = {"pool_size": args.pool_size} if args.pool_size else {}
                cfg = None if args.plain_config else recipe_compiler_config(mode)
                be = NpuOffloadBackend(exe_mode=mode, side_stream=not args.no_side_stream, compiler_config=cfg, **kw)
                step = torch.compile(b.model, backend=be, fullgraph=True, dynamic=False)
                t0 = time.perf_counter()
                first, _ = _run_steps(b, step, 1, sync)
                r.compile_s = time.perf_counter() - t0
                rest, times = _run_steps(b, step, total - 1, sync)
                got = first + rest
                r.per_step_diff = [float((g - w).abs().max()) for g, w in zip(got, ref_logits)]
                r.max_abs_diff = max(r.per_step_diff)
                r.step_ms = 1e3 * sum(times[args.warmup - 1:]) / args.steps
                r.rewritten = bool(be.reports and be.reports[-1]["rewritten"])
                r.hit_rate = _hit_rate(be.state)
                r.ok = r.rewritten and r.max_abs_diff <= args.tol
                if not r.rewritten:
                    r.error = "graph not rewritten: " + "; ".join(x["reason"] for x in be.reports[-1]["refusals"])
            except Exception as e:  # report and go on with the next run
                r.error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            results.append(r)
            print(format_table([r], args.tol).splitlines()[-1], flush=True)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    env = environment()
    print(plan_text(args))
    print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    if args.dry_run:
        if not env["torch_npu"]:
            print("note: torch_npu is not installed here; on an Atlas A3 run without --dry-run")
        return 0
    if not env["torch_npu"]:
        print("error: torch_npu is not importable; this check needs an Atlas A3 with CANN and torch_npu",
              file=sys.stderr)
        return 2
    results = run_check(args)
    print()
    print(format_table(results, args.tol))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "overrides"} | {"overrides": args.overrides},
                       "environment": env, "results": [asdict(r) for r in results]}, f, indent=1)
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""``offload-atlas-check``: the hardware check for an Atlas A3 (Ascend 910_93).

Order of work (each step is reported, none stops the run):

1. **CANN ops first.** ``--cann-ops PATH`` (or ``$OFFLOAD_PASSES_CANN_OPS_LIB``, or the installed
   ``custom_ops`` wheel, found by ``import offload_passes``) is loaded through
   ``offload_passes.load_cann_ops``, which is safe whatever was imported before.
2. **Preflight.** Which of the seven ``custom::`` ops have a real NPU kernel and CANN's schema
   (``cann_library_status``), and which GE op definitions the ``ge_graph`` mode needs are registered
   with CANN (``DsaPlan``, ``DsaServe``, ``DsaInstall``, ``ScatterNdUpdate``, ...). Everything missing is
   named; the cases that need it are reported as skipped with that reason.
3. **Cases**, per preset, all from the same prefilled state (deep copies) and the same token stream:
   ``unmodified`` (the unmodified model: full KV in host memory, CANN's gather op; the reference for
   logits), ``rewrite-ge_graph`` / ``rewrite-npugraph_ex`` (our backend), and with ``--recipe PATH`` the
   reference's hand-wired shared-indexer path (``run_shared_indexer_offload`` of cann-recipes-infer,
   routed into the same model in place of the gather op, eager). Each: compile time, synchronised step
   times (median of the measured steps), max |logits - unmodified| per step, final pool metadata
   compared between the offload cases, H2D bytes per step (rows read from the host cache x row bytes,
   from a separate counting run with the in-graph statistics on, so the timed run stays lean).
4. **One JSON report** (``--report``, default ``atlas_check_report.json``) with the environment, the
   preflight and every case, also when cases fail.

The full KV caches are placed in host memory the way the reference does it:
``torch_npu.empty_with_swapped_memory`` (device tensors backed by host memory), ``--kv-memory device``
keeps them in HBM for comparison. ``--dry-run`` prints the plan of cases on any machine.
Exit code: 0 every case passed, 1 a case failed or was skipped, 2 no NPU stack (report still written).
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

PRESETS = ("tiny", "glm-5.2-78l")
MODES = ("ge_graph", "npugraph_ex")
KV_MEMORY = ("swapped", "device")
#: GE op definitions (CANN IR) each mode needs from the op package / CANN itself.
GE_IR = {
    "ge_graph": ("DsaPlan", "DsaServe", "DsaInstall", "GatherSelectionKvCache", "ScatterNdUpdate",
                 "SparseFlashAttention", "LightningIndexer"),
}
#: The report's format and its version: a parser checks it before it reads the case names.
REPORT_FORMAT = "offload_passes.atlas_check/3"
#: The case every other case is compared with: the unmodified model (docs/glossary.md).
UNMODIFIED = "unmodified"


@dataclass
class CaseResult:
    preset: str
    case: str                    # unmodified | rewrite-ge_graph | rewrite-npugraph_ex | recipe
    status: str = "pending"      # passed | failed | error | skipped
    ok: bool = False
    reason: Optional[str] = None
    compile_s: float = 0.0
    step_ms_median: float = 0.0
    step_ms: List[float] = field(default_factory=list)
    max_abs_diff: float = float("nan")
    per_step_diff: List[float] = field(default_factory=list)
    hit_rate: Optional[float] = None
    h2d_bytes_per_step: Optional[float] = None
    metadata_equal: Dict[str, bool] = field(default_factory=dict)
    rewritten: Optional[bool] = None
    traceback: Optional[str] = None



def _csv(value: str, allowed: Sequence[str], flag: str, ap: argparse.ArgumentParser) -> List[str]:
    items = [v for v in value.split(",") if v]
    bad = [v for v in items if v not in allowed]
    if bad:
        ap.error(f"{flag}: unknown value(s) {bad}; choose from {list(allowed)}")
    if not items:
        ap.error(f"{flag}: give at least one of {list(allowed)}")
    return items


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    from offload_passes._cli import ArgumentParser, UsageError, int_arg, writable_file

    # one-line errors (exit 2): an Atlas owner pastes the message back, not argparse's usage block
    ap = ArgumentParser(prog="offload-atlas-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(PRESETS), help=f"comma-separated presets (default {','.join(PRESETS)})")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated NPU modes from {MODES}")
    ap.add_argument("--steps", type=int_arg("--steps", 1), default=8, help="measured decode steps per case (default 8)")
    ap.add_argument("--warmup", type=int_arg("--warmup", 1), default=2, help="steps run before timing; the first compiles (default 2)")
    ap.add_argument("--pool-size", type=int_arg("--pool-size", 16), default=None, help="pool slots per row (default: backend default 8192)")
    ap.add_argument("--device", default="npu:0")
    ap.add_argument("--tol", type=float, default=2e-2, help="max |logits - unmodified| to pass (default 2e-2)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="model / runner overrides")
    ap.add_argument("--no-side-stream", action="store_true", help="keep installs on the main stream")
    ap.add_argument("--plain-config", action="store_true",
                    help="default TorchAir / npugraph_ex settings instead of the recipe's (frozen parameters ...)")
    ap.add_argument("--bookkeeping", action="store_true",
                    help="keep the in-graph statistics / ledger update in the timed runs (npu_bookkeeping)")
    ap.add_argument("--kv-memory", default="swapped", choices=KV_MEMORY,
                    help="full KV caches in host memory (swapped, as the reference) or in HBM (device)")
    ap.add_argument("--cann-ops", default=None, metavar="PATH",
                    help="CANN's custom_ops_lib*.so (or its directory); default: $OFFLOAD_PASSES_CANN_OPS_LIB "
                         "or the installed custom_ops wheel")
    ap.add_argument("--recipe", default=None, metavar="PATH",
                    help="a cann-recipes-infer checkout: also run its shared-indexer offload path")
    ap.add_argument("--report", "--json", dest="report", default="atlas_check_report.json",
                    help="JSON report path (default atlas_check_report.json)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan of cases and the environment, run nothing")
    args = ap.parse_args(argv)
    args.models = _csv(args.models, _known_presets(), "--models", ap)
    args.modes = _csv(args.modes, MODES, "--modes", ap)
    if args.pool_size is not None:
        from offload_passes.options import OffloadOptions

        try:  # the backend's own check (a multiple of 16, the limit)
            OffloadOptions(pool_size=args.pool_size)
        except ValueError as e:
            ap.error(f"--pool-size: {e}")
    if not math.isfinite(args.tol):  # nan passes `tol <= 0` and then fails every case after the whole run
        ap.error(f"--tol must be a finite number > 0, got {args.tol}")
    if args.tol <= 0:
        ap.error(f"--tol must be > 0, got {args.tol}")
    try:  # before any case runs: a long check must not end in an unwritable report path
        writable_file(args.report, "--report")
    except UsageError as e:
        ap.error(str(e))
    if args.recipe is not None and not os.path.isdir(args.recipe):
        ap.error(f"--recipe: {args.recipe!r} is not a directory (a cann-recipes-infer checkout)")
    if args.cann_ops is not None and not os.path.exists(args.cann_ops):
        ap.error(f"--cann-ops: {args.cann_ops!r} does not exist")
    if args.cann_ops is not None and not (os.path.isdir(args.cann_ops) or os.path.isfile(args.cann_ops)):
        ap.error(f"--cann-ops: {args.cann_ops!r} is neither a file nor a directory (a FIFO, a socket or a device)")
    args.overrides = _parse_overrides(args.set, args.models, ap)
    return args


def _known_presets() -> List[str]:
    try:
        from offload_passes import models

        return sorted(set(models.list_presets()) | set(PRESETS))
    except Exception:  # the model package is optional for argument handling
        return list(PRESETS)


def _parse_overrides(items: Sequence[str], presets: Sequence[str], ap: argparse.ArgumentParser) -> Dict[str, Any]:
    """``--set KEY=VALUE`` pairs (values read as yaml scalars), each key a model or runner key and each value
    one it accepts, checked on every preset's config before anything runs (``--dry-run`` too): the
    config's own errors name the key and the limit."""
    import yaml

    out = {}
    for it in items:
        k, eq, v = it.partition("=")
        if not eq or not k.strip():
            ap.error(f"--set expects KEY=VALUE, got {it!r}")
        try:
            out[k.strip()] = yaml.safe_load(v)
        except yaml.YAMLError as e:
            ap.error(f"--set {it!r}: the value is not a yaml scalar ({' '.join(str(e).split())})")
    if out:
        from offload_passes import models

        for preset in presets:
            if preset not in models.list_presets():
                continue  # a preset of this tool's own (PRESETS) that the model package does not ship
            try:
                models.load_config(preset, **out)
            except (ValueError, TypeError) as e:
                ap.error(f"--set: {' '.join(str(e).split())} (preset {preset!r}; --set takes model / runner keys, "
                         f"the pool size is --pool-size)")
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
        "custom_ops_wheel": has("custom_ops"),
        "ascend_home": os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME"),
        "cann_ops_lib_env": os.environ.get("OFFLOAD_PASSES_CANN_OPS_LIB"),
    }


def case_names(args: argparse.Namespace) -> List[str]:
    names = [UNMODIFIED] + [f"rewrite-{m}" for m in args.modes]
    if args.recipe:
        names.append("recipe")
    return names


def plan_text(args: argparse.Namespace) -> str:
    lines = [f"offload-atlas-check plan: device {args.device}, {args.warmup} warmup + {args.steps} measured steps "
             f"(median), tol {args.tol}, pool_size {args.pool_size or 'default'}, side stream "
             f"{not args.no_side_stream}, {'plain' if args.plain_config else 'recipe'} compiler config, "
             f"full KV in {'host memory (swapped)' if args.kv_memory == 'swapped' else 'HBM'}, "
             f"bookkeeping {'on' if args.bookkeeping else 'off'}"]
    lines.append(f"  CANN ops: {args.cann_ops or 'OFFLOAD_PASSES_CANN_OPS_LIB / custom_ops wheel'}; "
                 f"preflight: torch kernels of the 7 custom:: ops"
                 + (f", GE IR {', '.join(GE_IR['ge_graph'])}" if "ge_graph" in args.modes else ""))
    for m in args.models:
        lines.append(f"  {m}: " + ", ".join(case_names(args)))
    if args.recipe:
        lines.append(f"  recipe: {args.recipe}")
    if args.overrides:
        lines.append(f"  overrides: {args.overrides}")
    lines.append(f"  report: {args.report}")
    return "\n".join(lines)


def format_table(results: Sequence[CaseResult], tol: float) -> str:
    head = f"{'preset':14s} {'case':20s} {'compile s':>9s} {'step ms':>9s} {'max|diff|':>10s} {'hit rate':>8s} " \
           f"{'H2D KiB/step':>12s}  result"
    rows = [head, "-" * len(head)]
    for r in results:
        hit = f"{100 * r.hit_rate:.1f}%" if r.hit_rate is not None else "-"
        h2d = f"{r.h2d_bytes_per_step / 1024:.1f}" if r.h2d_bytes_per_step is not None else "-"
        if r.status == "passed":
            verdict = "PASS"
        elif r.status == "failed":
            verdict = f"FAIL ({r.reason})" if r.reason else f"FAIL (> {tol})"
        else:
            verdict = f"{r.status.upper()}: {r.reason}"
        rows.append(f"{r.preset:14s} {r.case:20s} {r.compile_s:9.1f} {r.step_ms_median:9.2f} {r.max_abs_diff:10.3g} "
                    f"{hit:>8s} {h2d:>12s}  {verdict}")
    return "\n".join(rows)


def _hit_rate(state) -> Optional[float]:
    if state is None:
        return None
    hits = misses = 0
    for c in state.counters():
        hits += c["total"]["hits"]
        misses += c["total"]["misses"]
    return hits / (hits + misses) if hits + misses else None


def write_report(path: str, args: argparse.Namespace, env: Dict[str, Any], preflight: Dict[str, Any],
                 results: Sequence[CaseResult]) -> Dict[str, Any]:
    """The one JSON an Atlas owner sends back (written also when cases failed)."""
    statuses = [r.status for r in results]
    doc = {
        "format": REPORT_FORMAT,
        "args": {k: v for k, v in vars(args).items() if k != "overrides"} | {"overrides": args.overrides},
        "environment": env,
        "preflight": preflight,
        "cases": [asdict(r) for r in results],
        "summary": {s: statuses.count(s) for s in ("passed", "failed", "error", "skipped")},
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str, allow_nan=True)
    os.replace(tmp, path)  # never a half-written report
    return doc


# -------------------------------------------------------------------------------- on the device


def load_cann(args: argparse.Namespace) -> Dict[str, Any]:
    """Load CANN's op library (first thing on the device) and return its status as a dict."""
    import offload_passes

    out: Dict[str, Any] = {}
    try:
        if args.cann_ops:
            status = offload_passes.load_cann_ops(args.cann_ops)
        else:
            from offload_passes.custom_ops import cann_library_status

            status = cann_library_status()
        out = status.as_dict()
    except Exception as e:  # reported in the preflight, the cases say what they miss
        out = {"loaded": False, "error": f"{type(e).__name__}: {e}"}
    return out


def ge_ir_status(names: Sequence[str]) -> Dict[str, str]:
    """``op type -> "SUCCESS" or the reason``, from CANN's IR registry through TorchAir."""
    try:
        from offload_passes import _compat

        _torchair = _compat.torchair_core_extension()
    except Exception as e:
        return {n: f"torchair not importable: {e}" for n in names}
    out = {}
    for n in names:
        try:
            res = _torchair.get_registered_ir_def(n)
            out[n] = res[0] if isinstance(res, (tuple, list)) else str(res)
        except Exception as e:
            out[n] = f"{type(e).__name__}: {e}"
    return out


def preflight(args: argparse.Namespace, cann: Dict[str, Any], ge_ir: Optional[Dict[str, str]]) -> Dict[str, Any]:
    """What is missing, per case: ``{"cann": ..., "ge_ir": ..., "missing": {case: [messages]}}``."""
    missing: Dict[str, List[str]] = {}
    kernels = list(cann.get("missing_npu_kernels", [])) if cann.get("ops") else ["(status unavailable)"]
    schema = list(cann.get("schema_mismatches", []))
    common = []
    if cann.get("error"):
        common.append(f"CANN op library: {cann['error']}")
    if kernels:
        common.append("no NPU kernel for custom::" + ", custom::".join(kernels)
                      + " (load CANN's custom_ops_lib: --cann-ops PATH or OFFLOAD_PASSES_CANN_OPS_LIB)")
    if schema:
        common.append("schema differs from CANN's for custom::" + ", custom::".join(schema))
    for case in case_names(args):
        msgs = list(common)
        if case == "rewrite-ge_graph" and ge_ir is not None:
            bad = [f"{k} ({v})" for k, v in ge_ir.items() if v != "SUCCESS"]
            if bad:
                msgs.append("GE op definitions not registered with CANN: " + ", ".join(bad)
                            + " (install the DSA op package; see docs/atlas.md, 'On an Atlas A3')")
        if msgs:
            missing[case] = msgs
    return {"cann": cann, "ge_ir": ge_ir, "missing": missing}


def _full_caches(built) -> List[tuple]:
    """``(module, buffer name, tensor)`` of every full KV cache of the model (per layer kv and rope)."""
    out = []
    for mod in built.model.modules():
        for name in ("kv_cache", "k_rope_cache"):
            t = getattr(mod, "_buffers", {}).get(name)
            if t is not None:
                out.append((mod, name, t))
    return out


def _place_kv(built, mode: str) -> int:
    """Full KV caches into host memory the way the reference allocates them
    (``torch_npu.empty_with_swapped_memory``: device tensors backed by host memory), contents kept.
    Called after every deep copy: a copy of a swapped tensor is an ordinary HBM tensor. Returns bytes."""
    import torch
    import torch_npu

    placed = 0
    for mod, name, t in _full_caches(built):
        if mode == "swapped":
            new = torch_npu.empty_with_swapped_memory(tuple(t.shape), dtype=t.dtype, device=t.device)
            new.copy_(t)
            mod._buffers[name] = new
        placed += t.numel() * t.element_size()
    torch.npu.synchronize()
    return placed


def _fresh(base, args):
    """A deep copy of the prefilled model with its full caches placed as ``--kv-memory`` says."""
    b = copy.deepcopy(base)
    _place_kv(b, args.kv_memory)
    return b


def _row_bytes(built) -> int:
    """Bytes of one full-cache row (kv + rope) read from host memory per miss / window row."""
    per = {}
    for _, name, t in _full_caches(built):
        per.setdefault(name, t.shape[-1] * t.element_size())
    return sum(per.values())


def _timed(built, step_fn, n: int, sync: Callable[[], None]) -> tuple:
    logits, times = [], []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        out = built.driver.step(step_fn)
        sync()
        times.append(time.perf_counter() - t0)
        logits.append(out.logits.float().cpu())
    return logits, times


def _metadata(state) -> Optional[List[Any]]:
    if state is None:
        return None
    return [(g.pool_ids.cpu(), g.id_to_slot.cpu(), g.lru_counter.cpu()) for g in state.groups]


def _same_metadata(a, b) -> bool:
    import torch

    return a is not None and b is not None and len(a) == len(b) and all(
        torch.equal(x, y) for ga, gb in zip(a, b) for x, y in zip(ga, gb))


def _finish(r: CaseResult, got: list, want: list, tol: float) -> None:
    r.per_step_diff = [float((g - w).abs().max()) for g, w in zip(got, want)]
    r.max_abs_diff = max(r.per_step_diff) if r.per_step_diff else float("nan")
    good = r.per_step_diff and r.max_abs_diff <= tol
    r.ok = bool(good) and r.rewritten is not False
    r.status = "passed" if r.ok else "failed"
    if not r.ok:
        r.reason = r.reason or (f"max |diff| {r.max_abs_diff:.3g} > tol {tol}" if not good else "not rewritten")


def _backend(args, mode: str, bookkeeping: bool):
    from offload_passes.backend import NpuOffloadBackend
    from offload_passes.lowering.npu import recipe_compiler_config

    kw = {"pool_size": args.pool_size} if args.pool_size else {}
    cfg = None if args.plain_config else recipe_compiler_config(mode)
    return NpuOffloadBackend(exe_mode=mode, side_stream=not args.no_side_stream, compiler_config=cfg,
                             npu_bookkeeping=bookkeeping, **kw)


def _run_rewrite(args, base, mode: str, ref_logits: list, sync, total: int, r: CaseResult) -> Any:
    import torch

    torch.compiler.reset()
    b = _fresh(base, args)
    be = _backend(args, mode, args.bookkeeping)
    step = torch.compile(b.model, backend=be, fullgraph=True, dynamic=False)
    t0 = time.perf_counter()
    first, _ = _timed(b, step, 1, sync)
    r.compile_s = time.perf_counter() - t0
    rest, times = _timed(b, step, total - 1, sync)
    measured = times[args.warmup - 1:]
    r.step_ms = [1e3 * t for t in measured]
    r.step_ms_median = statistics.median(r.step_ms)
    r.rewritten = bool(be.reports and be.reports[-1]["rewritten"])
    if not r.rewritten and be.reports:
        r.reason = "graph not rewritten: " + "; ".join(x["reason"] for x in be.reports[-1]["refusals"])
    _finish(r, first + rest, ref_logits, args.tol)
    meta = _metadata(be.state)
    # H2D: a separate untimed run with the in-graph statistics on (rows read from the host cache)
    torch.compiler.reset()
    c = _fresh(base, args)
    bc = _backend(args, mode, True)
    cstep = torch.compile(c.model, backend=bc, fullgraph=True, dynamic=False)
    _timed(c, cstep, total, sync)
    if bc.state is not None:
        tot = bc.state.totals()
        r.hit_rate = _hit_rate(bc.state)
        r.h2d_bytes_per_step = tot["host_rows_read"] * _row_bytes(base) / total
    return meta


def _run_recipe(args, base, ref_logits: list, sync, total: int, r: CaseResult) -> Any:
    """The reference's shared-indexer path, eager, in place of the model's gather op."""
    from offload_passes.tools import atlas_recipe

    b = _fresh(base, args)
    with atlas_recipe.recipe_route(args.recipe, b, pool_size=args.pool_size) as route:
        got, times = _timed(b, None, total, sync)
        meta = route.metadata()
    r.step_ms = [1e3 * t for t in times[args.warmup:]]
    r.step_ms_median = statistics.median(r.step_ms)
    _finish(r, got, ref_logits, args.tol)
    return meta


def run_check(args: argparse.Namespace, missing: Dict[str, List[str]],
              on_result: Callable[[CaseResult], None] = lambda r: None) -> List[CaseResult]:  # pragma: no cover
    import torch

    from offload_passes import models

    sync = torch.npu.synchronize
    results: List[CaseResult] = []
    total = args.warmup + args.steps
    for preset in args.models:
        base = None
        ref_logits: list = []
        metas: Dict[str, Any] = {}
        for case in case_names(args):
            r = CaseResult(preset, case)
            results.append(r)
            try:
                if case in missing and case != UNMODIFIED:
                    r.status, r.reason = "skipped", "; ".join(missing[case])
                    continue
                if base is None:
                    over = {"decode_steps": total, **args.overrides}
                    base = models.build(preset, device=args.device, enable_offload=True,
                                        shared_indexer_offload=True, **over)
                    base.driver.prefill()  # in HBM: each case's deep copy then moves its caches to host
                    # memory (a deep copy of swapped memory is not swapped memory, see _fresh)
                if case == UNMODIFIED:
                    b = _fresh(base, args)
                    ref_logits, times = _timed(b, None, total, sync)
                    r.step_ms = [1e3 * t for t in times[args.warmup:]]
                    r.step_ms_median = statistics.median(r.step_ms)
                    r.ok, r.status = True, "passed"
                    del b
                elif case.startswith("rewrite-"):
                    metas[case] = _run_rewrite(args, base, case.split("-", 1)[1], ref_logits, sync, total, r)
                else:
                    metas[case] = _run_recipe(args, base, ref_logits, sync, total, r)
                for other, m in metas.items():
                    if other != case and case in metas:
                        same = _same_metadata(metas[case], m)
                        r.metadata_equal[other] = same
                        next(x for x in results if x.preset == preset and x.case == other).metadata_equal[case] = same
                if r.metadata_equal and not all(r.metadata_equal.values()) and r.status == "passed":
                    r.ok, r.status, r.reason = False, "failed", "pool metadata differs from " + ", ".join(
                        k for k, v in r.metadata_equal.items() if not v)
            except Exception as e:  # every case is reported; go on with the next
                r.status, r.ok = "error", False
                r.reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                r.traceback = traceback.format_exc(limit=8)
            finally:
                on_result(r)
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
        msg = "torch_npu is not importable; this check needs an Atlas A3 with CANN and torch_npu"
        print(f"error: {msg}", file=sys.stderr)
        results = [CaseResult(m, c, status="skipped", reason=msg) for m in args.models for c in case_names(args)]
        write_report(args.report, args, env, {"error": msg}, results)
        return 2
    import torch_npu  # noqa: F401  (the NPU device and the npu ops, before CANN's library)

    cann = load_cann(args)
    ge_ir = ge_ir_status(GE_IR["ge_graph"]) if "ge_graph" in args.modes else None
    pre = preflight(args, cann, ge_ir)
    for case, msgs in pre["missing"].items():
        for m in msgs:
            print(f"preflight: {case}: missing {m}")
    done: List[CaseResult] = []

    def progress(r: CaseResult) -> None:
        done.append(r)
        print(format_table([r], args.tol).splitlines()[-1], flush=True)
        write_report(args.report, args, env, pre, done)  # a crash later still leaves a report

    results = run_check(args, pre["missing"], progress)
    print()
    print(format_table(results, args.tol))
    write_report(args.report, args, env, pre, results)
    print(f"report: {args.report}")
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

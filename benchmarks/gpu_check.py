"""GPU timings of the CUDA path: one command for a lent H200, a Markdown table and a JSON file.

    python benchmarks/gpu_check.py                             # every section, table last, gpu_check.json
    python benchmarks/gpu_check.py --sections serve --merge    # partial rerun: one section, keep the others
    python benchmarks/gpu_check.py --dry-run                   # no GPU: the sections' rows, every timing "no GPU"

The correctness checks of the GPU (every kernel equal to its CPU twin with CUDA tensors, the models with host KV,
the captured decode steps, the capacity stack) are tests: ``tests/cuda/test_device_*.py`` and the tests marked
``device`` in tests/cuda, run on the GPU by ``OFFLOAD_PASSES_GPU=1 python -m pytest -m device tests/cuda`` and on
a CPU (Triton's interpreter) by the ordinary suite. ``scripts/lent_gpu.sh run`` runs both: the tests, then this.

Each section runs in **its own process** under its own wall-clock limit (:data:`SECTIONS`): a fatal CUDA error
(an illegal address loses the context) or a hang ends that process only, its row says why, and the next
section starts on a fresh context. Section data is generated on the device (``torch.Generator(device=...)``).

* ``serve`` (``gpu_ops.py``): ``dsa_serve`` hits against a device-to-device copy of the same bytes, misses
  (sequential and random rows) from pinned host memory against a host-to-device copy, at B = 1, 32, 128.
* ``kernels`` (``gpu_ops.py``): ``dsa_plan`` and each replacement policy's install (``metadata_update`` 0 and 1)
  at B = 1, 32, 128.
* ``graphs`` (``gpu_graphs.py``): one CUDA graph per decode step on both paths (the recipe ``tiny`` model and
  ``hf-glm5-attn`` at 16K, host KV, ``mode="reduce-overhead"``) against the same compile without it: ms per step.
* ``capacity`` (``gpu_capacity.py``): a GLM-5-shaped attention stack at 64K and 128K context: the largest batch
  that fits one HBM budget dense and offloaded (arithmetic), the measured peak device memory, tokens/s of each
  at its batch and the pool hit rate.

Timings (``_harness.time_cuda``): device time per call from CUDA-graph replays (the call captured ``reps`` times,
timed by CUDA events), else from launches queued behind a device sleep; the host's time per call (the op's
Python wrapper and the launch: the launch overhead) is its own column, never mixed into the device figure.

Goals (docs/cuda.md; not asserted): serve >= 0.8x the device copy for hits; misses >= 0.7x the host-link copy.
Without CUDA the script exits 2 with one line on stderr, except ``--dry-run``, which runs every section's process
on the CPU and writes "no GPU" in every timing cell (the capacity arithmetic is computed). Tested on CPU:
``tests/cuda/test_gpu_check.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any, Optional, Sequence

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
if "--dry-run" in sys.argv[1:] and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before torch: torch._inductor may import triton

import torch  # noqa: E402

import gpu_capacity  # noqa: E402
import gpu_graphs  # noqa: E402
import gpu_ops  # noqa: E402
from _harness import COLUMNS, Section, failed, format_table, run_section, summary_rows, write_section  # noqa: E402

#: the sections, in run order; limits 280 s together, estimates 190 s
SECTIONS = {s.name: s for s in (
    Section("serve", 45, 25, 60, "process start 10 s; 2.4 GB pinned host cache; 9 serve cases and their ceilings, "
            "each a captured graph of 20 calls"),
    Section("kernels", 35, 20, 60, "process start 10 s; plan and 2 policies x 2 installs at 3 batch sizes, "
            "captured"),
    Section("graphs", 60, 45, 60, "process start 10 s; 2 compiles of tiny and 2 of hf-glm5-attn at 16K (op by op, "
            "captured), 8 steps each"),
    Section("capacity", 140, 100, 60, "process start 10 s; up to 64 GiB pinned and filled from the device twice; "
            "dense and offloaded stacks at 2 contexts, 12 steps each, captured"),
)}
RUNNERS = {**gpu_ops.RUNNERS, **gpu_graphs.RUNNERS, **gpu_capacity.RUNNERS}

#: the arguments a section's process gets from the command line (``--worker`` and ``--out`` are added)
PASSED_ON = ("steps", "reps", "hbm_gib", "host_gib", "capacity_layers", "capacity_steps")


def worker_argv(name: str, args: Any) -> list:
    """The command line of section ``name``'s process (``run_section`` adds ``--out``)."""
    argv = [os.path.abspath(__file__), "--worker", name]
    for k in PASSED_ON:
        argv += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    return argv + (["--dry-run"] if args.dry_run else [])


def run_sections(sections: Sequence[str], args: Any, results: dict) -> dict:
    """Run ``sections`` in order into ``results`` (rows, or ``{"error"}``), with their seconds."""
    env = dict(os.environ, **({"TRITON_INTERPRET": "1"} if args.dry_run else {}))
    for name in SECTIONS:
        if name not in sections:
            continue
        s = SECTIONS[name]
        rows, error, secs, info = run_section(worker_argv(name, args), name,
                                              s.dry_limit_s if args.dry_run else s.limit_s, env)
        results[name] = rows if rows is not None else {"error": error}
        results.setdefault("section_s", {})[name] = secs
        for k, v in info.items():
            results.setdefault(k, v)
    return results


def worker(args: Any) -> int:
    """The body of one section's process: its rows (or its error) into ``args.out``."""
    if args.dry_run:
        dev, device = torch.device("cpu"), "cpu (dry run, Triton interpreter)"
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
        device = torch.cuda.get_device_name(dev)
    import offload_passes  # noqa: F401  (registers the ops and, with CUDA + triton, their CUDA kernels)

    return write_section(args.out, device, lambda: RUNNERS[args.worker](dev, args.dry_run, args))


def parse(argv: Optional[Sequence[str]]) -> Any:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    ap.add_argument("--steps", type=int, default=4, help="graphs: decode steps timed per compile (+2 warm-up)")
    ap.add_argument("--reps", type=int, default=20, help="calls per timing (one captured graph)")
    ap.add_argument("--hbm-gib", type=float, default=24.0,
                    help="capacity: the device memory the KV (and the step) may take, GiB")
    ap.add_argument("--host-gib", type=float, default=64.0,
                    help="capacity: the pinned host memory the offloaded caches may take, GiB")
    ap.add_argument("--capacity-layers", type=int, default=gpu_capacity.GLM5_STACK.layers,
                    help=f"capacity: layers of the attention stack (a multiple of {gpu_capacity.GLM5_STACK.group})")
    ap.add_argument("--capacity-steps", type=int, default=4, help="capacity: timed decode steps per variant")
    ap.add_argument("--json", default="gpu_check.json", help="where the results go (JSON)")
    ap.add_argument("--merge", action="store_true",
                    help="partial rerun: keep the other sections' results already in --json")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: every section's process on the CPU, timing cells 'no GPU'")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.section_list = [s for s in args.sections.split(",") if s]
    bad = [s for s in args.section_list + ([args.worker] if args.worker else []) if s not in SECTIONS]
    if bad:
        raise ValueError(f"--sections: unknown {bad}; known: {list(SECTIONS)}")
    if args.steps < 1 or args.reps < 1 or args.capacity_steps < 1:
        raise ValueError(f"--steps, --reps and --capacity-steps must be >= 1, got {args.steps}, {args.reps} and "
                         f"{args.capacity_steps}")
    if not (args.hbm_gib > 0 and args.host_gib > 0):
        raise ValueError(f"--hbm-gib and --host-gib must be > 0, got {args.hbm_gib} and {args.host_gib}")
    try:
        gpu_capacity.StackGeo(layers=args.capacity_layers)
    except ValueError as e:
        raise ValueError(f"--capacity-layers: {e}") from None
    return args


def _refusal(args: Any) -> Optional[str]:
    """Why this machine cannot run the sections asked for (None: it can)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "the Triton kernels need the `triton` package (pip install 'offload_passes[cuda]')"
    if args.dry_run:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            return "--dry-run: triton was imported before TRITON_INTERPRET=1 could be set"
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        return (f"no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False); "
                "this check needs a GPU")
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parse(argv)
    except ValueError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    why = _refusal(args)
    if why:
        print(f"gpu_check: {why}", file=sys.stderr)
        return 2
    if args.worker:
        return worker(args)
    results: dict = {"dry_run": True} if args.dry_run else {}
    results.update(steps=args.steps, date=time.strftime("%Y-%m-%d", time.gmtime()),
                   capacity={"hbm_gib": args.hbm_gib, "host_gib": args.host_gib,
                             "stack": asdict(gpu_capacity.StackGeo(layers=args.capacity_layers))})
    if args.merge and os.path.exists(args.json):  # a partial rerun: the other sections' results are kept
        with open(args.json) as f:
            results = {**json.load(f), **results}
    t0 = time.perf_counter()
    run_sections(args.section_list, args, results)
    results["wall_s"] = time.perf_counter() - t0
    rows = summary_rows(results, list(SECTIONS))
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1, default=str)
    kind = "--dry-run" if args.dry_run else f"on {results.get('device', 'CUDA')}"
    print(f"gpu_check {kind} ({results['wall_s']:.0f} s), JSON: {args.json}")
    print(format_table(rows, COLUMNS))
    return 1 if failed(rows) else 0


if __name__ == "__main__":
    sys.exit(main())

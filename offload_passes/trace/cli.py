"""``offload-sim TRACE``: replay a top-k trace through replacement policies at chosen pool sizes.

TRACE is a trace file (``offload-demo --record-trace``, ``offload-trace record``) or a synthetic spec
``synth[:calibrated][,key=value...]`` (``offload_passes.trace.synth.parse_spec``; ``synth:key=value`` reads the
same). An existing path is always a trace file, whatever its name (``synth_run.npz``). Prints a table (hit rate,
host rows, metadata work per step, simulator speed), or ``--json``; ``--plot out.png`` draws hit rate vs
pool size per policy with the bounds on top. Every run also prints the two offline bounds at each pool
size, labelled with what they bound (``offload_passes.trace.sim.BOUNDS``): ``min_per_set``, the optimum
of the pool's geometry (MIN with bypass in each ``--ways``-way set), and ``belady``, the fully
associative optimum.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import textwrap
from pathlib import Path
from typing import Optional, Sequence

from .. import _cli
from . import sim, synth
from .format import Trace, load_trace, save_trace

log = logging.getLogger("offload_passes.trace.cli")


def open_trace(source: str) -> Trace:
    """``source`` as a trace: the file when the path exists (whatever its name), else a synthetic spec
    (``synth.is_spec``) generated, else :func:`load_trace`'s error for a missing file."""
    if not Path(source).exists() and synth.is_spec(source):
        return synth.generate(synth.parse_spec(source))
    return load_trace(source)


def table(results: list[sim.SimResult]) -> str:
    head = (f"{'policy':<14}{'pool':>7}{'hit %':>8}{'entry hit %':>13}{'host rows/step':>16}"
            f"{'prefetch/step':>15}{'writes/step':>13}{'clears/step':>13}{'scans/step':>12}{'Mlookups/s':>12}")
    lines = [head, "-" * len(head)]
    notes = []
    for r in results:
        pool = "K/row" if r.policy == "adjacent" else str(r.pool_size)
        lines.append(
            f"{r.policy:<14}{pool:>7}{100 * r.hit_rate:>8.2f}{100 * r.entry_hit_rate:>13.2f}"
            f"{r.host_rows_per_step:>16.1f}{_per_step(r, 'prefetch'):>15.1f}{r.writes_per_step:>13.1f}"
            f"{r.clears_per_step:>13.1f}"
            f"{r.scans_per_step:>12.1f}{r.lookups / max(r.seconds, 1e-9) / 1e6:>12.2f}")
        if r.bounds and (r.policy, r.bounds) not in notes:
            notes.append((r.policy, r.bounds))
    lines += [f"{p}: {b}" for p, b in notes]
    return "\n".join(lines)


def _per_step(r: sim.SimResult, what: str) -> float:
    # prefetch rows per step: the same denominator as host_rows_per_step
    total = r.misses + r.window + r.prefetch
    return r.host_rows_per_step * (getattr(r, what) / total) if total else 0.0


def plot(results: list[sim.SimResult], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    by: dict[str, list] = {}
    for r in results:
        by.setdefault(r.policy, []).append(r)
    sizes = sorted({r.pool_size for r in results if r.policy != "adjacent"})
    for pol, rs in by.items():
        if pol == "adjacent":
            ax.axhline(100 * rs[0].hit_rate, color="grey", ls=":", label="adjacent (K per row)")
            continue
        rs = sorted(rs, key=lambda r: r.pool_size)
        style = dict(lw=2.5, color="black") if pol == "belady" else \
            dict(lw=2.5, color="dimgrey", ls="--") if pol == "min_per_set" else {}
        label = pol + (" (+prefetched rows)" if pol == "rank_prefetch" else "")
        ax.plot([r.pool_size for r in rs], [100 * r.hit_rate for r in rs], marker="o", label=label, **style)
    ax.set_xscale("log", base=2)
    if sizes:
        ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("pool slots per batch row")
    ax.set_ylabel("hit rate (%)")
    ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _parser() -> _cli.ArgumentParser:
    p = _cli.ArgumentParser(prog="offload-sim", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help=f"trace file (.npz; an existing path is always read), or a synthetic trace "
                                 f"{synth.SPEC_FORM}, keys: {', '.join(synth.LIMITS)} (docs/usage.md)")
    p.add_argument("--pool-sizes", default="2048,4096,8192,16384",
                   type=_cli.ints_arg("--pool-sizes", 1), help="comma-separated pool slots per row")
    p.add_argument("--policies", default=None, help=f"comma-separated subset of: {', '.join(sim.POLICIES)}")
    p.add_argument("--k", type=_cli.int_arg("--k", 1), default=None, help="replay with a smaller top-k (first K ranked columns)")
    p.add_argument("--warmup", type=_cli.int_arg("--warmup", 0), default=0, help="leave the first N steps out of the figures")
    p.add_argument("--ways", type=_cli.int_arg("--ways", 1, 1024), default=sim.WAYS, help="associativity of the set-associative policies")
    p.add_argument("--save-trace", default=None, help="also write the (e.g. synthetic) trace to this npz")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default=None, help="write hit rate vs pool size to this PNG")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    for flag, path in (("--plot", a.plot), ("--save-trace", a.save_trace)):
        if path:  # checked before the (possibly long) run, not after it
            try:
                _cli.writable_file(path, flag)
            except _cli.UsageError as e:
                p.error(str(e))
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, stream=sys.stderr)
    try:
        tr, results, skipped = _run(p, a)
    except (ValueError, OSError, RuntimeError) as e:
        msg = " ".join(str(e).split())
        print(f"offload-sim: error: {msg}", file=sys.stderr)
        return 2
    try:
        _report(a, tr, results, skipped)
    except BrokenPipeError:  # `offload-sim ... | head`: the reader left, not an error
        sys.stderr = open(os.devnull, "w")
    return 0


def _run(p: _cli.ArgumentParser, a: argparse.Namespace) -> tuple[Trace, list[sim.SimResult], list]:
    """The trace (file or synthetic), then every policy at every pool size, with the bounds."""
    tr = open_trace(a.trace)
    if a.k is not None:
        tr = tr.with_k(a.k)
    pols = a.policies.split(",") if a.policies else sim.default_policies(tr)
    bad = [x for x in pols if x not in sim.POLICIES]
    if bad:
        p.error(f"--policies: unknown {', '.join(bad)}; choose from {', '.join(sim.POLICIES)}")
    if a.save_trace:
        try:
            save_trace(tr, a.save_trace)
        except OSError as e:  # the folder was checked; the write itself can still fail
            raise _cli.UsageError(f"--save-trace {a.save_trace!r}: {e.strerror or e}") from None
    from ._native import module

    module()  # build/load the C++ core before timing
    skipped: list = []
    results = sim.sweep(tr, pols, a.pool_sizes, a.ways, a.warmup, bounds=True, skipped=skipped)
    return tr, results, skipped


def _report(a: argparse.Namespace, tr: Trace, results: list[sim.SimResult], skipped: list) -> None:
    """The table (or ``--json``) and the plot."""
    lookups = sum(r.lookups for r in results)
    secs = sum(r.seconds for r in results)
    out = {"trace": a.trace, "header": tr.header(), "warmup": a.warmup, "ways": a.ways,
           "bounds": {b: sim.bound_label(b, a.ways) for b in sim.BOUNDS},
           "bounds_skipped": [{"policy": b, "pool_size": ps, "reason": why} for b, ps, why in skipped],
           "results": [r.as_dict() for r in results],
           "lookups_per_s": lookups / secs if secs else 0.0}
    if a.plot:
        out["plot"] = str(plot(results, Path(a.plot), f"{tr.model[:90]}  K={tr.K} S={tr.S} steps={tr.steps}"))
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"trace {a.trace}: model={tr.model[:100]} K={tr.K} P={tr.P} S={tr.S} B={tr.B} steps={tr.steps} "
          f"groups={len(tr.groups)} warmup={a.warmup}")
    print(table(results))
    for b, ps, why in skipped:
        print(f"{b} at pool {ps}: not computed ({why})")
    print(f"simulator: {lookups} id lookups in {secs:.3f} s = {out['lookups_per_s'] / 1e6:.2f} M lookups/s")
    if a.plot:
        print(f"plot: {out['plot']}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

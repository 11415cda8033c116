"""CLI: build a preset, prefill, run decode steps, print timings and the memory footprint.

    python -m offload_passes.models.glm.run --preset glm-5.2-78l [--steps 1] [--set key=value ...]
        [--compile BACKEND] [--trace topk.pt] [--threads N]
"""
from __future__ import annotations

import argparse
import resource
import time
from typing import Any

import torch
import yaml


def _parse_overrides(items: list[str]) -> dict[str, Any]:
    out = {}
    for it in items:
        if "=" not in it:
            raise SystemExit(f"--set expects key=value, got {it!r}")
        k, v = it.split("=", 1)
        out[k] = yaml.safe_load(v)
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    from offload_passes import models

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="preset name or yaml path")
    ap.add_argument("--steps", type=int, default=None, help="decode steps (default: runner decode_steps)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    ap.add_argument("--compile", default=None, metavar="BACKEND", help="torch.compile the decode step")
    ap.add_argument("--trace", default=None, help="save the top-k trace to this file")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    overrides = _parse_overrides(args.set)
    if args.steps is not None:
        overrides.setdefault("decode_steps", args.steps)
    b = models.build(args.preset, **overrides)
    t_build = time.perf_counter() - t0
    m, r = b.model, b.runner
    fp = m.memory_footprint()
    print(f"preset {args.preset}: {m.config.num_hidden_layers} layers, groups {len(m.groups())}, "
          f"K={m.config.index_topk}, B={r.batch_size}, S={r.seq_per_step}, dtype={m.config.torch_dtype}, "
          f"offload={r.enable_offload}")
    for k, v in fp.items():
        print(f"  {k:18s} {_mib(v)}")
    print(f"build (alloc + seeded init): {t_build:.1f} s")

    t0 = time.perf_counter()
    b.driver.prefill()
    print(f"prefill ({r.prefill_len} tokens x {r.batch_size} rows, dense causal): {time.perf_counter() - t0:.1f} s")
    step_fn = torch.compile(m, backend=args.compile, fullgraph=True) if args.compile else None
    m.return_internals = args.trace is not None
    steps = r.decode_steps if args.steps is None else args.steps
    for i in range(steps):
        t0 = time.perf_counter()
        out = b.driver.step(step_fn)
        print(f"decode step {i}: {time.perf_counter() - t0:.2f} s  logits {tuple(out.logits.shape)}")
    if args.trace:
        print(f"trace -> {b.driver.save_trace(args.trace)}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"peak RSS: {_mib(rss)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

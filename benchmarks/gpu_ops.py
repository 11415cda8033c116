"""The op timings of the GPU benchmark (``gpu_check.py`` runs them, each section in a process of its own):

* ``serve``: ``dsa_serve`` hits against a device-to-device copy of the same bytes, misses (sequential and random
  rows) from pinned host memory against a host-to-device copy of the same bytes, at B = 1, 32, 128 (K 2048,
  pool 8192, 16384-row host caches);
* ``kernels``: ``dsa_plan`` and each replacement policy's install (``metadata_update`` 1 and 0) at B = 1, 32, 128.

Their correctness (the same plan kinds, the same kernels): ``tests/cuda/test_device_ops.py``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from _harness import NO_GPU, gen, fill_from_device, guarded, pinned_empty, randn, row, time_cuda, timing_row

BATCHES = (1, 32, 128)
GOALS = {"serve_hit_vs_d2d": 0.8, "miss_vs_h2d": 0.7}
SERVE_KINDS = ("hits", "misses sequential", "misses random")


def serve_plans(B: int, K: int, PS: int, F: int, dev: torch.device, g: torch.Generator) -> dict:
    """Plans of B x K rows, made on ``dev``: all hits (random pool slots), all misses of sequential rows (one
    contiguous run of the full cache per batch row), all misses of random rows."""
    from offload_passes.custom_ops.plan_kind import PlanKind

    ones = torch.ones(B * K, dtype=torch.int32, device=dev)
    slots = torch.cat([torch.randperm(PS, generator=g, device=dev)[:K] for _ in range(B)]).to(torch.int32)
    start = torch.randint(0, F - K, (B, 1), generator=g, device=dev)
    seq = (torch.arange(K, device=dev).view(1, K) + start).reshape(-1).to(torch.int32)
    rnd = torch.cat([torch.randperm(F, generator=g, device=dev)[:K] for _ in range(B)]).to(torch.int32)
    hit, miss = int(PlanKind.POOL_HIT) * ones, int(PlanKind.FULL_OLD_MISS) * ones
    return {"hits": torch.stack([hit, slots], 1), "misses sequential": torch.stack([miss, seq], 1),
            "misses random": torch.stack([miss, rnd], 1)}


def serve_case(dev: torch.device, B: int, K: int, PS: int, F: int, D: int, Dr: int, sbs: int, g: torch.Generator,
               full: Optional[list] = None) -> dict:
    """A serve's operands: full caches in (pinned on a GPU) host memory, pools and selection buffers on ``dev``."""
    if full is None:
        full = [pinned_empty((B, F, d), torch.bfloat16, dev) for d in (D, Dr)]
        for t in full:
            fill_from_device(t, dev, g)
    pool = [randn((B, PS, d), dev, g) for d in (D, Dr)]
    sel = [torch.empty(B * K // sbs, sbs, d, dtype=torch.bfloat16, device=dev) for d in (D, Dr)]
    return dict(full=full, pool=pool, sel=sel, nbytes=B * K * (D + Dr) * 2,
                kw=dict(raw_seq=1, topk=K, selection_block_size=sbs, compact_layout=1))


def serve_name(B: int, kind: str) -> str:
    return f"serve {kind} B={B} vs {'device copy' if kind == 'hits' else 'host link'}"


def serve_goal(kind: str) -> float:
    return GOALS["serve_hit_vs_d2d"] if kind == "hits" else GOALS["miss_vs_h2d"]


def section_serve(dev: torch.device, dry: bool, args: Any) -> list:
    from offload_passes.custom_ops.cuda import dsa_serve as CS

    if dry:
        return [timing_row("serve", serve_name(B, kind), None, goal=serve_goal(kind), dry=True)
                for B in BATCHES for kind in SERVE_KINDS]
    g = gen(dev, 0)
    K, PS, F, D, Dr, sbs = 2048, 8192, 16384, 512, 64, 128
    full = [pinned_empty((max(BATCHES), F, d), torch.bfloat16, dev) for d in (D, Dr)]  # 2.4 GB, shared by the Bs
    for t in full:
        fill_from_device(t, dev, g)
    rows = []
    for B in BATCHES:
        def one_batch(B: int = B) -> list:
            x = serve_case(dev, B, K, PS, F, D, Dr, sbs, g, [t[:B] for t in full])
            plans = serve_plans(B, K, PS, F, dev, g)
            src = torch.empty(x["nbytes"], dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            hsrc = pinned_empty((x["nbytes"],), torch.uint8, dev)
            ceil = {"hits": time_cuda(lambda: dst.copy_(src), args.reps),
                    "misses": time_cuda(lambda: dst.copy_(hsrc, non_blocking=True), args.reps)}
            out = []
            for kind in SERVE_KINDS:
                t = time_cuda(lambda: CS.run(plans[kind], *x["full"], *x["pool"], *x["sel"], **x["kw"]), args.reps)
                out.append(timing_row("serve", serve_name(B, kind), t, ceil["hits" if kind == "hits" else "misses"],
                                      serve_goal(kind), x["nbytes"]))
            return out

        rows += guarded("serve", [serve_name(B, kind) for kind in SERVE_KINDS], one_batch)
    return rows


def cuda_policies() -> tuple:
    """The replacement policies of the cuda exe_mode (``offload_passes/modes.py``)."""
    from offload_passes.modes import MODES

    return tuple(MODES["cuda"].replacement_policies)


def _kernel_state(dev: torch.device, B: int, K: int, PS: int, F: int, sbs: int) -> dict:
    """A plan's operands at B x K with half of the ids already in the pool (hits), and one plan's records."""
    from offload_passes.custom_ops.cuda import dsa_plan as CP

    g = gen(dev, B)
    L = torch.full((B,), F - 8, dtype=torch.int32, device=dev)
    tk = torch.stack([torch.randperm(F - 16, generator=g, device=dev)[:K] for _ in range(B)]).to(torch.int32)
    tk = tk.view(B, 1, 1, K)
    pid = torch.full((B, PS), -1, dtype=torch.int32, device=dev)
    i2s = torch.full((B, F), -1, dtype=torch.int32, device=dev)
    lru = torch.zeros(B, PS // 16, dtype=torch.int32, device=dev)
    half = tk[..., : K // 2].reshape(B, K // 2).long()
    i2s.scatter_(1, half, torch.arange(K // 2, dtype=torch.int32, device=dev).expand(B, -1).contiguous())
    plan, rec, _ = CP.run(tk, L, pid, i2s, lru, raw_seq=1)
    return dict(tk=tk, L=L, meta=(pid, i2s, lru), plan=plan, rec=rec,
                sel=[randn((B * K // sbs, sbs, d), dev, g) for d in (512, 64)],
                pool=[torch.zeros(B, PS, d, dtype=torch.bfloat16, device=dev) for d in (512, 64)],
                table=torch.arange(B * K // sbs, dtype=torch.int32, device=dev).view(B, K // sbs))


def section_kernels(dev: torch.device, dry: bool, args: Any) -> list:
    """Plan time and each replacement policy's install time (the owner's ``metadata_update=1`` and a shared
    layer's ``0``), half of the plan's rows hits."""
    from offload_passes.custom_ops.cuda import dsa_install as CI
    from offload_passes.custom_ops.cuda import dsa_install_sc as CSC
    from offload_passes.custom_ops.cuda import dsa_plan as CP

    installs = {"fifo": lambda plan, *a, **kw: CI.run(*a, **kw), "second_chance": CSC.run}
    K, PS, F, sbs = 2048, 8192, 16384, 128
    rows = []
    for B in BATCHES:
        names = [(f"dsa_plan B={B}", None, None)] + [(f"install {p} md={md} B={B}", p, md)
                                                     for p in cuda_policies() for md in (1, 0)]
        if dry:
            rows += [row("kernels", n, NO_GPU, None, "correctness: tests/cuda/test_device_ops.py",
                         host_us=NO_GPU) for n, _, _ in names]
            continue

        def one_batch(B: int = B, names: list = names) -> list:
            s = _kernel_state(dev, B, K, PS, F, sbs)
            kw = dict(raw_seq=1, topk=K, selection_block_size=sbs)
            out = []
            for n, policy, md in names:
                if policy is None:
                    t = time_cuda(lambda: CP.run(s["tk"], s["L"], *s["meta"], raw_seq=1), args.reps)
                else:
                    t = time_cuda(lambda: installs[policy](s["plan"], s["rec"], *s["sel"], s["table"], *s["pool"],
                                                           *s["meta"], metadata_update=md, **kw), args.reps)
                out.append(timing_row("kernels", n, t, note="one plan's records, replayed"))
            return out

        rows += guarded("kernels", [n for n, _, _ in names], one_batch)
    return rows


RUNNERS = {"serve": section_serve, "kernels": section_kernels}

"""The ``graphs`` timing of the GPU benchmark (``gpu_check.py`` runs it in a process of its own): one CUDA graph per
decode step on both paths, the recipe ``tiny`` model and ``hf-glm5-attn`` at 16K (pool 8192), host KV, compiled
with ``mode="reduce-overhead"`` (the lowering's own capture, ``offload_passes/lowering/cuda_graphs.py``) against
the same compile without it (op by op): ms per step of each and their ratio.

That the replays equal op by op, that every step after the first two is a replay and that the decode graph has
no capture problem: ``tests/cuda/test_device_models.py`` (the same runs, ``benchmarks/_gpu_models.py``).
"""
from __future__ import annotations

import statistics
from typing import Any

import torch

from _gpu_models import hf_graph_logits, max_diff, recipe_graph_logits
from _harness import NO_GPU, guarded, ratio, row, sync

#: the two paths: (row label, HF preset or None for the recipe ``tiny``, context, pool rows)
GRAPH_PATHS = (("tiny (recipe, host KV)", None, 0, 1024),
               ("hf-glm5-attn (HF, host KV, 16K)", "hf-glm5-attn", 16384, 8192))


def graph_check(label: str) -> str:
    return f"{label}: replay vs op by op (ms/step ratio)"


def time_path(dev: torch.device, preset: Any, ctx: int, pool: int, steps: int) -> dict:
    """Both compiles of one path: median ms per step (the warm-up and the capture left out), the replays counted,
    the logits' largest difference (reported, not judged: the tests judge it)."""
    from offload_passes.cuda import raise_device_errors

    out: dict = {}
    for captured in (False, True):
        times: list = []
        if preset is None:
            logits, be = recipe_graph_logits(dev, steps, captured, times)
        else:
            logits, be = hf_graph_logits(preset, ctx, pool, dev, steps, captured, times)
        sync()
        raise_device_errors()
        out[captured] = (statistics.median(times[2:]), logits, sum(r.replays for r in be.lowering.replays.values()))
    (t_eager, l_eager, _), (t_graph, l_graph, replays) = out[False], out[True]
    return {"op_by_op_s": t_eager, "replay_s": t_graph, "replays": replays, "diff": max_diff(l_eager, l_graph)}


def section_graphs(dev: torch.device, dry: bool, args: Any) -> list:
    if dry:
        return [row("graphs", graph_check(label), NO_GPU, None, "needs torch.cuda.CUDAGraph", host_us=NO_GPU)
                for label, _, _, _ in GRAPH_PATHS]
    steps = max(args.steps, 4) + 2
    rows = []
    for label, preset, ctx, pool in GRAPH_PATHS:
        def one(label: str = label, preset: Any = preset, ctx: int = ctx, pool: int = pool) -> list:
            t = time_path(dev, preset, ctx, pool, steps)
            note = (f"{steps} steps, {t['replays']} replays; op by op {t['op_by_op_s'] * 1e3:.3g} ms, replay "
                    f"{t['replay_s'] * 1e3:.3g} ms; logits max |diff| {t['diff']:.3g}")
            return [row("graphs", graph_check(label), ratio(t["op_by_op_s"], t["replay_s"]), None, note)]

        rows += guarded("graphs", [graph_check(label)], one)
    return rows


RUNNERS = {"graphs": section_graphs}

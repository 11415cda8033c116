"""``offload-demo --world N``: the recipe's multi-rank decode step (N ranks, gloo on the loopback) through
the offload backend, every rank compared with its own unmodified model.

Each rank (a spawned process, ``MASTER_ADDR=127.0.0.1``) builds its share of the model
(``models/glm/parallel.py``: attention data parallel rows, expert-parallel MoE, vocab-parallel embedding
and lm_head), runs the unmodified model, then the same model compiled with the offload backend
(``fullgraph=True``), over the same tokens. It records, per compiled graph, the ordered collective
sequence (:func:`collective_sequence`) of the Dynamo graph, of the rewritten graph and of the lowered
(final) graph, and the backend's reports. The parent prints one line per rank and a summary; exit code
1 only when a rank's difference is outside the tolerance (or a rank failed), 2 for bad input.

Used by ``tests/distributed`` too (:func:`spawn_world` returns every rank's result).
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import fx

from ..lowering.side_stream import MC2_OPS, is_collective, namespace_and_op

log = logging.getLogger("offload_passes.apps.world")

#: Most ranks ``--world`` spawns here (each is a full process on the loopback).
MAX_WORLD = 8
#: Default wall-clock limit of a whole run; a rank still running then is killed (a hang fails, never blocks).
DEFAULT_TIMEOUT_S = 600.0
#: Report fields that are rank-local or wall-clock (everything else must be equal across ranks).
RANK_LOCAL_FIELDS = ("timings",)


# ------------------------------------------------------------------------------------------ collectives in a graph


def _shape(a: Any) -> Any:
    if isinstance(a, fx.Node):
        v = a.meta.get("val", a.meta.get("example_value"))
        if isinstance(v, torch.Tensor):
            return [list(v.shape), str(v.dtype).replace("torch.", "")]
        return "node"
    if isinstance(a, (list, tuple)):
        return [_shape(x) for x in a]
    return a


def collective_sequence(graph: fx.Graph | fx.GraphModule) -> list[tuple]:
    """Ordered ``(op, args)`` of every collective in ``graph``: op without namespace / overload, args with
    tensors replaced by ``[shape, dtype]`` (group names, split sizes and reduce ops kept as they are)."""
    g = graph.graph if isinstance(graph, fx.GraphModule) else graph
    out = []
    for n in g.nodes:
        if is_collective(n):
            op = namespace_and_op(n)[1]
            args = [_shape(a) for a in n.args] + [[k, _shape(v)] for k, v in sorted(n.kwargs.items())]
            out.append((op, json.loads(json.dumps(args, default=str))))
    return out


def collective_kinds(graph: fx.Graph | fx.GraphModule) -> list[tuple]:
    """``(op, input shape)`` per collective, npugraph_ex's lowered all-to-all named as the functional op
    it replaces: comparable between a Dynamo graph and an NPU lowering whose op arguments differ."""
    from ..lowering.side_stream import NPUGRAPH_EX_COLLECTIVES

    g = graph.graph if isinstance(graph, fx.GraphModule) else graph
    out = []
    for n in g.nodes:
        if is_collective(n):
            ns, op = namespace_and_op(n)
            out.append((NPUGRAPH_EX_COLLECTIVES.get((ns, op), op), _shape(n.args[0])))
    return out


def comparable_report(rep: dict) -> dict:
    """``rep`` without its rank-local / wall-clock fields (what must be identical across ranks)."""
    return {k: v for k, v in rep.items() if k not in RANK_LOCAL_FIELDS}


# ------------------------------------------------------------------------------------------ one rank


class _Recording:
    """Wraps the offload backend: records the collective sequence of each graph before the rewrite,
    after it (the rewrite edits the graph in place) and of the lowered graph."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.graphs: list[dict] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kw: Any):
        before = collective_sequence(gm)
        fn = self.backend(gm, example_inputs, **kw)
        final = self.backend.final_graph()
        self.graphs.append({"dynamo": before, "rewrite": collective_sequence(gm),
                            "final": collective_sequence(final) if final is not None else None})
        return fn


def run_rank(rank: int, world: int, port: int, spec: dict, out_path: str) -> None:
    """Body of one spawned rank; writes its result (a ``torch.save`` dict) to ``out_path``."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    torch.set_num_threads(max(1, int(spec.get("threads", 1))))
    res: dict = {"rank": rank, "ok": False}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=float(spec.get("timeout_s", DEFAULT_TIMEOUT_S))))
        modes = spec.get("modes") or [spec.get("mode", "eager")]
        for i, mode in enumerate(modes):  # one process start, import and rendezvous for every mode
            if i:
                torch.compiler.reset()
            over = dict(spec.get("overrides", {}), **spec.get("mode_overrides", {}).get(mode, {}))
            res.setdefault("runs", {})[mode] = _run_rank(rank, world, dict(spec, mode=mode, overrides=over))
        res.update(res["runs"][modes[-1]])
        res["ok"] = True
    except BaseException as e:  # the parent reports it (one line per rank); never hang the others silently
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
    finally:
        torch.save(res, out_path)
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_rank(rank: int, world: int, spec: dict) -> dict:
    from .. import models
    from ..backend import make_offload_backend
    from .common import ATTN_TOL, LOGITS_TOL, max_diffs

    mode, steps = spec.get("mode", "eager"), int(spec.get("steps", 8))
    layout = models.ParallelLayout.current()
    over = dict(enable_offload=True, decode_steps=steps, **spec.get("overrides", {}))
    base = models.build(spec.get("config", "tiny"), parallel=layout, **over)
    comp = models.build(spec.get("config", "tiny"), parallel=layout, **over)
    r = comp.runner
    opts: dict = {"exe_mode": mode, "pa_block_size": r.pa_block_size, "next_n": r.next_n}
    if spec.get("pool_size") is not None:
        opts["pool_size"] = spec["pool_size"]
    if spec.get("dump_dir"):
        opts["dump_dir"] = spec["dump_dir"]
    backend = make_offload_backend(**opts)
    rec = _Recording(backend)
    step_fn = torch.compile(comp.model, backend=rec, fullgraph=True)
    # The reference: the unmodified model, eager, or through plain Inductor in inductor mode (its fp32
    # fusions round differently from eager bf16), so the difference measures the rewrite only.
    base_fn = torch.compile(base.model, backend="inductor", fullgraph=True) if mode == "inductor" else None
    t0 = time.perf_counter()
    res0 = base.driver.run(steps=steps, step_fn=base_fn, collect=True)
    t_base = time.perf_counter() - t0
    t0 = time.perf_counter()
    res1 = comp.driver.run(steps=steps, step_fn=step_fn, collect=True)
    t_comp = time.perf_counter() - t0
    d_logits, _ = max_diffs(res0.logits, res1.logits)
    d_attn, _ = max_diffs([x for s in res0.steps for x in s.attn], [y for s in res1.steps for y in s.attn])
    state = backend.state
    tot = state.totals() if state is not None else {}
    return {
        "world": world, "mode": mode, "steps": steps, "B": comp.model.batch_size,
        "max_abs_diff": {"logits": d_logits, "attn": d_attn},
        "within_tolerance": d_logits <= LOGITS_TOL and d_attn <= ATTN_TOL,
        "reports": [json.loads(json.dumps(x.to_dict() if hasattr(x, "to_dict") else dict(x), default=str))
                    for x in backend.reports],
        "graphs": rec.graphs,
        "totals": tot, "run_s": {"unmodified": t_base, "compiled": t_comp},
        "logits": [x.clone() for x in res1.logits] if spec.get("keep_logits") else None,
        "ref_logits": [x.clone() for x in res0.logits] if spec.get("keep_logits") else None,
    }


# ------------------------------------------------------------------------------------------ spawning


def free_port() -> int:
    """A free TCP port on the loopback (the rendezvous of one run)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(target: Callable, world: int, args: tuple = (), timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict]:
    """Run ``target(rank, world, port, *args, out_path)`` on ``world`` spawned processes (loopback
    rendezvous on a free port); each writes a ``torch.save`` dict to ``out_path``. Returns them in rank
    order. A rank still running after ``timeout_s`` is killed and reported as ``{"ok": False, "error": ...}``
    (a collective mismatch hangs; it must fail, not block)."""
    import multiprocessing as mp

    if isinstance(world, bool) or not isinstance(world, int) or not 2 <= world <= MAX_WORLD:
        raise ValueError(f"world must be an integer in [2, {MAX_WORLD}], got {world!r}")
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="offload_world_") as tmp:
        paths = [str(Path(tmp) / f"rank{r}.pt") for r in range(world)]
        procs = [ctx.Process(target=target, args=(r, world, port, *args, paths[r]), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        out = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join(10)
                out.append({"rank": r, "ok": False, "error": f"timed out after {timeout_s:.0f} s (killed)"})
            elif not Path(paths[r]).exists():
                out.append({"rank": r, "ok": False, "error": f"exited with code {p.exitcode} without a result"})
            else:
                out.append(torch.load(paths[r], weights_only=False))
        return out


def spawn_world(world: int, spec: dict, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict]:
    """:func:`run_rank` on ``world`` ranks (``spec``: ``modes`` or ``mode``, ``steps``, ``config``,
    ``pool_size``, ``dump_dir``, ``overrides`` (config keys), ``mode_overrides`` (``{mode: keys}``),
    ``keep_logits``); every rank's result, in rank order."""
    return spawn(run_rank, world, (dict(spec, timeout_s=timeout_s),), timeout_s)


# ------------------------------------------------------------------------------------------ CLI


def summary(results: list[dict]) -> tuple[str, bool]:
    """One line per rank and a summary line; ``True`` when every rank ran and is within tolerance."""
    lines = []
    ok = True
    for r in results:
        if not r.get("ok"):
            ok = False
            lines.append(f"rank {r['rank']}: FAILED: {r.get('error')}")
            continue
        rep = r["reports"][-1] if r["reports"] else {}
        d = r["max_abs_diff"]
        within = r["within_tolerance"]
        ok = ok and within
        lines.append(f"rank {r['rank']}: rewritten {bool(rep.get('rewritten'))}  groups "
                     f"{[g['layers'] for g in rep.get('groups', [])]}  hits {r['totals'].get('hits', 0)}  "
                     f"misses {r['totals'].get('misses', 0)}  max |diff| logits {d['logits']:.3g} attention "
                     f"{d['attn']:.3g} ({'within' if within else 'OUTSIDE'} tolerance)")
    good = [r for r in results if r.get("ok")]
    same_seq = len(good) == len(results) and all(r["graphs"] == good[0]["graphs"] for r in good) and all(
        g["dynamo"] == g["rewrite"] and g["final"] in (None, g["dynamo"]) for r in good for g in r["graphs"])
    same_rep = len(good) == len(results) and all(
        [comparable_report(x) for x in r["reports"]] == [comparable_report(x) for x in good[0]["reports"]]
        for r in good)
    n_coll = len(good[0]["graphs"][-1]["dynamo"]) if good and good[0]["graphs"] else 0
    mode = good[0]["mode"] if good else "?"
    lines.append(f"world {len(results)} ({mode}): {len(good)}/{len(results)} ranks ran; {n_coll} collectives per "
                 f"decode graph, same order on every rank and before/after the rewrite: {same_seq}; reports "
                 f"equal across ranks: {same_rep}; {'all within' if ok else 'NOT all within'} tolerance")
    return "\n".join(lines), ok


def main_world(world: int, mode: str, steps: int, config: str, pool_size: Optional[int], dump_dir: Optional[str],
               as_json: bool, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """The ``--world N`` path of ``offload-demo`` (its arguments already checked there)."""
    from .._cli import EXIT_CHECK_FAILED, EXIT_OK, UsageError

    if not 2 <= world <= MAX_WORLD:
        raise UsageError(f"--world must be in [2, {MAX_WORLD}] (1 is the single-process demo), got {world}")
    from .. import models

    cfg = models.load_config(config, enable_offload=True, decode_steps=steps)  # bad keys: exit 2, before spawning
    models.ParallelLayout(world, 0).check(cfg.runner.batch_size, cfg.model.vocab_size, cfg.model.n_routed_experts)
    spec = {"mode": mode, "steps": steps, "config": config, "pool_size": pool_size, "dump_dir": dump_dir}
    results = spawn_world(world, spec, timeout_s)
    text, ok = summary(results)
    if as_json:
        keep = ("rank", "ok", "error", "world", "mode", "steps", "B", "max_abs_diff", "within_tolerance", "totals",
                "run_s")
        print(json.dumps([{k: r.get(k) for k in keep} for r in results], indent=1, default=str))
    else:
        print(text)
    for r in results:
        if not r.get("ok") and r.get("traceback"):
            print(f"rank {r['rank']} traceback:\n{r['traceback']}", file=sys.stderr)
    return EXIT_OK if ok else EXIT_CHECK_FAILED

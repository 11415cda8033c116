"""``offload-demo`` / ``python -m offload_passes.apps.demo``: the unmodified GLM-5.2 decode model vs the
same model compiled with the ``dsa_offload`` backend, prefill + N decode steps, side by side.

Prints a readable summary, or with ``--json`` one JSON object, the same keys for ``--model glm`` and
``--model hf`` (``RESULT_KEYS``; ``null`` where a field does not apply to the front-end): ``groups``,
``ops`` (dsa_plan / dsa_serve / dsa_install in the final graph), ``hits``, ``misses``, ``window``,
``host_rows_read``, ``unmodified_host_rows_read`` (rows the unmodified gather path read from the host
cache, replayed from its own ledger rule; recipe model only; ``baseline_host_rows_read`` repeats it for
one release, ``common.KEY_ALIASES``), ``max_abs_diff`` and ``max_rel_diff``
(each ``{"logits": x, "attn": y}``; relative = to the reference's largest magnitude; ``attn`` is null for
the HF model, whose attention outputs are not exposed), ``tolerance`` (the limits ``within_tolerance``
checks, under the measure they apply to), ``refusals``, ``compile_s``, ``pass_s``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch

from .._cli import (EXIT_CHECK_FAILED, EXIT_OK, ArgumentParser, UsageError, int_arg, parse_ints, read_config, run_cli,
                   writable_dir, writable_file)
from .common import (  # noqa: F401  (the schema and helpers are part of demo's interface)
    ATTN_TOL, DIFF_MEASURES, DIFF_OUTPUTS, LOGITS_TOL, MAX_THREADS, RESULT_KEYS, check_threads, max_diffs,
    op_counts, per_output, result, set_threads)
from .serve import run_serve, summary_serve
from .serve_store import STORE_HELP, build_tiers, parse_store


#: the sections a model config yaml holds (models/glm/config.py; the HF runner's yaml has the same two)
CONFIG_SECTIONS = ("model_config", "runner_config")


def unmodified_host_rows(topk_steps: list, lengths: list, groups: list, S: int) -> int:
    """Rows the unmodified gather path reads from host (docs/ops.md §1.4 ledger, bsz = 1).

    Every layer of a group receives the same top-k, so its ledger evolves identically: row ``r``
    reuses an id iff the previous step placed it there and ``id <= max(L - S - 1, 0)``.
    """
    total = 0
    for gi, layers in enumerate(groups):
        prev: Optional[list] = None
        for tk, L in zip(topk_steps, lengths):
            t = tk[gi]  # [B, S, K]
            B = t.size(0)
            cur = []
            for b in range(B):
                Lb = int(L[b])
                for s in range(S):
                    ms = Lb - (S - 1 - s) - 1
                    ids = [x for x in t[b, s].tolist() if 0 <= x <= ms]
                    reuse = max(Lb - S - 1, 0)
                    old = prev[b * S + s] if prev is not None else set()
                    kept = sum(1 for x in ids if x <= reuse and x in old)
                    total += (len(ids) - kept) * len(layers)
                    cur.append(set(ids))
            prev = cur
    return total


def run(config: str = "tiny", steps: int = 64, mode: str = "eager", pool_size: Optional[int] = None,
        next_n: Optional[int] = None, dump_dir: Optional[str] = None, threads: int = 1,
        record_trace: Optional[str] = None, replacement_policy: str = "fifo") -> dict:
    from .. import models
    from ..backend import make_offload_backend

    set_threads(threads)
    over: dict[str, Any] = {"enable_offload": True, "decode_steps": steps}
    if next_n is not None:
        over["next_n"] = next_n
    base = models.build(config, **over)
    comp = models.build(config, **over)
    r = comp.runner
    opts: dict[str, Any] = {"exe_mode": mode, "enlarge_pool_size": bool(getattr(r, "enlarge_pool_size", False)),
                            "pa_block_size": r.pa_block_size, "next_n": r.next_n,
                            "replacement_policy": replacement_policy}
    if pool_size is not None:
        opts["pool_size"] = pool_size
    if dump_dir:
        opts["dump_dir"] = dump_dir
    backend = make_offload_backend(**opts)
    step_fn = torch.compile(comp.model, backend=backend)

    # The reference is the unmodified model through the same inner compiler: in inductor mode that is
    # plain Inductor (its fp32 fusions round differently from eager bf16 and can flip a tied top-k),
    # so max_abs_diff measures the rewrite, not Inductor's numerics.
    base_fn = torch.compile(base.model, backend="inductor") if mode == "inductor" else None
    t0 = time.perf_counter()
    res0 = base.driver.run(steps=steps, step_fn=base_fn, collect=True)
    t_base = time.perf_counter() - t0
    t0 = time.perf_counter()
    from ..trace.record import PlanRecorder

    # --record-trace: the top-k every dsa_plan of the compiled run receives (offload_passes/trace/format.py)
    with PlanRecorder() if record_trace else contextlib.nullcontext() as recorder:
        res1 = comp.driver.run(steps=steps, step_fn=step_fn, collect=True)
    t_comp = time.perf_counter() - t0
    rep = backend.reports[-1] if backend.reports else {}
    state = backend.state

    d_logits, r_logits = max_diffs(res0.logits, res1.logits)
    d_attn, r_attn = max_diffs([x for s in res0.steps for x in s.attn], [y for s in res1.steps for y in s.attn])
    groups = [g["layers"] for g in rep.get("groups", [])] or base.model.groups()
    S = base.driver.S
    lengths = [(s.positions[:, -1] + 1).tolist() for s in res0.steps]
    base_rows = unmodified_host_rows([s.topk for s in res0.steps], lengths, base.model.groups(), S)
    tot = state.totals() if state is not None else {"hits": 0, "misses": 0, "window": 0, "host_rows_read": 0}
    ops = op_counts(rep, replacement_policy)
    hits, misses = tot["hits"], tot["misses"]
    return result(
        model="glm", config=config, mode=mode, steps=steps, B=base.driver.B, S=S, K=base.driver.K,
        T=r.pa_max_length, prefill=r.prefill_len, dtype=comp.config.torch_dtype,
        pool_size=backend.options.resolved_pool_size,
        rewritten=bool(rep.get("rewritten")), sparse_layers=len(rep.get("sites", [])),
        groups=groups, offload=ops["dsa_plan"] > 0, ops=ops,
        replacement_policy=replacement_policy,
        hits=hits, misses=misses, window=tot["window"],
        hit_rate=hits / (hits + misses) if hits + misses else 0.0,
        host_rows_read=tot["host_rows_read"],
        unmodified_host_rows_read=base_rows,
        host_rows_saved=1.0 - tot["host_rows_read"] / base_rows if base_rows else 0.0,
        reference="unmodified model, " + ("inductor" if mode == "inductor" else "eager"),
        max_abs_diff=per_output(logits=d_logits, attn=d_attn),
        max_rel_diff=per_output(logits=r_logits, attn=r_attn),
        tolerance={"max_abs_diff": per_output(logits=LOGITS_TOL, attn=ATTN_TOL), "max_rel_diff": None},
        within_tolerance=d_logits <= LOGITS_TOL and d_attn <= ATTN_TOL,
        refusals=rep.get("refusals", []),
        compile_s=rep.get("timings", {}).get("total_s", 0.0),
        pass_s=rep.get("timings", {}).get("pass_s", 0.0),
        timings=rep.get("timings", {}),
        state_bytes=state.total_bytes if state is not None else 0,
        run_s={"unmodified": t_base, "compiled": t_comp},
        trace=_save_trace(recorder, backend.state, config, record_trace) if record_trace else None,
    )


def _save_trace(recorder, state, config: str, path: str) -> str:
    from ..trace.format import save_trace

    if state is None:
        raise RuntimeError("--record-trace: the graph was not rewritten, no dsa_plan ran")
    try:
        return str(save_trace(recorder.trace_for(state, config), path))
    except OSError as e:  # the folder was checked before the run; the write itself can still fail
        raise UsageError(f"--record-trace {path!r}: {e.strerror or e}") from None


def _summary(o: dict) -> str:
    lines = [
        f"offload demo: config={o['config']} mode={o['mode']} steps={o['steps']} B={o['B']} S={o['S']} K={o['K']} "
        f"pool={o['pool_size']}",
        f"  rewritten: {o['rewritten']}   groups: {o['groups']}",
        f"  final graph: {o['ops']['dsa_plan']} dsa_plan, {o['ops']['dsa_serve']} dsa_serve, "
        + (f"{o['ops']['dsa_install_sc']} dsa_install_sc (second chance)" if o["ops"].get("dsa_install_sc")
           else f"{o['ops']['dsa_install']} dsa_install"),
        f"  pool: hits {o['hits']}  misses {o['misses']}  window {o['window']}  hit rate {o['hit_rate']:.1%}",
        f"  host rows read: {o['host_rows_read']} (unmodified gather path: {o['unmodified_host_rows_read']}, "
        f"saved {o['host_rows_saved']:.1%})",
        f"  max |diff| vs {o['reference']}: logits {o['max_abs_diff']['logits']:.3g}, attention "
        f"{o['max_abs_diff']['attn']:.3g}  ({'within' if o['within_tolerance'] else 'OUTSIDE'} tolerance)",
        f"  compile {o['compile_s']:.2f} s, of which passes {o['pass_s'] * 1e3:.1f} ms; "
        f"state {o['state_bytes'] / 2**20:.2f} MiB",
    ]
    for r in o["refusals"]:
        lines.append(f"  refused: {r['reason']}: {r['detail']}")
    if o.get("trace"):
        lines.append(f"  top-k trace written to {o['trace']} (replay: offload-sim {o['trace']})")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = ArgumentParser(prog="offload-demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("glm", "hf"), default="glm",
                   help="glm: the recipe-form GLM-5.2 model; hf: an unmodified transformers DSA model (docs/hf.md)")
    p.add_argument("--config", default=None,
                   help="model preset (tiny, small, glm-5.2-78l, tiny-w8a8, glm-5.2-78l-w8a8; with --model hf: "
                        "hf-tiny, hf-glm5-attn, hf-deepseek-v32, hf-hy-v4, hf-dots3-note, hf-glm5-next, "
                        "hf-deepseek-v4) or yaml path (an existing file or a name ending in .yaml / .yml; a preset name "
                        "wins; default tiny / hf-tiny)")
    p.add_argument("--attn", choices=("eager", "sdpa"), default=None, help="--model hf: attn_implementation")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="--model hf: model dtype (bfloat16 enables the offload ops)")
    p.add_argument("--steps", type=int_arg("--steps", 1), default=64, help="decode steps (default 64)")
    p.add_argument("--mode", choices=("eager", "inductor"), default="eager")
    p.add_argument("--pool-size", type=int_arg("--pool-size"), default=None,
                   help="pool slots per batch row (default 8192 / 16384)")
    p.add_argument("--next-n", type=int_arg("--next-n"), default=None, help="MTP tokens (S = 1 + next_n)")
    p.add_argument("--dump-dir", default=None, help="write graphs and report.json here")
    p.add_argument("--record-trace", default=None, metavar="TRACE.npz",
                   help="write the compiled run's top-k trace (replay with offload-sim)")
    p.add_argument("--replacement-policy", choices=("fifo", "second_chance"), default="fifo",
                   help="pool replacement (second_chance: the opt-in CPU kernel, not on the NPU)")
    p.add_argument("--threads", type=int_arg("--threads"), default=1,
                   help=f"torch CPU threads, at most os.cpu_count() = {MAX_THREADS} (0 = torch default)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--world", type=int_arg("--world"), default=1, metavar="N",
                   help="spawn N ranks (gloo, loopback) of the recipe's multi-rank layout and compare every rank "
                        "with its own unmodified model (offload_passes/apps/world.py; --model glm)")
    p.add_argument("--serve", action="store_true",
                   help="the serving loop (models/glm/serve.py): continuous batching on paged KV, B=4 rows, "
                        "next_n 3 unless given; --model glm")
    p.add_argument("--buckets", default="", metavar="B1,B2",
                   help="--serve: batch buckets, e.g. 2,4: one graph per batch size over the same caches, the "
                        "smallest that holds the running requests runs (sizes in [1, 4])")
    p.add_argument("--arrival", type=float, default=1.0,
                   help="--serve: probability that a request waits when a row frees (1: the batch stays full)")
    p.add_argument("--workload", choices=("random", "multiturn"), default="random",
                   help="--serve: random prompts, or multi-turn conversations sharing a system prompt (each turn's "
                        "prompt = the conversation so far + new tokens)")
    p.add_argument("--store", default=None, metavar="SPEC", help=STORE_HELP)
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, stream=sys.stderr)
    return run_cli("offload-demo", lambda: _main(a))


def _main(a: argparse.Namespace) -> int:
    _check_input(a)
    if a.world != 1:
        return _run_world(a)
    if a.model == "hf":
        return _run_hf(a)
    if a.attn or a.dtype:
        raise UsageError("--attn / --dtype apply to --model hf only")
    if a.serve:
        return _run_serve(a)
    out = run(a.config or "tiny", a.steps, a.mode, a.pool_size, a.next_n, a.dump_dir, a.threads, a.record_trace,
              a.replacement_policy)
    return _report(out, a.json, _summary)


def _check_input(a: argparse.Namespace) -> None:
    """Bad input of every form is found before anything is built or compiled (exit 2, one line)."""
    from ..options import OffloadOptions

    check_threads(a.threads)
    if a.next_n is not None and not 0 <= a.next_n <= 3:
        raise UsageError(f"--next-n must be in [0, 3] (S = 1 + next_n <= 4), got {a.next_n}")
    if a.pool_size is not None:
        OffloadOptions(pool_size=a.pool_size)  # raises "option pool_size must ..." naming the limit
    if a.dump_dir:
        writable_dir(a.dump_dir, "--dump-dir")
    if a.record_trace:
        writable_file(a.record_trace, "--record-trace")
    if a.config is not None and config_is_path(a.config, a.model):
        # a path, not a preset: a readable yaml with the model's sections, never a silent default
        read_config(a.config, "--config", CONFIG_SECTIONS)
    _check_config_fits_model(a.model, a.config)
    if a.serve and (a.world != 1 or a.model != "glm"):
        raise UsageError("--serve applies to --model glm on one process (no --world)")
    if (a.buckets or a.arrival != 1.0 or a.workload != "random" or a.store is not None) and not a.serve:
        raise UsageError("--buckets / --arrival / --workload / --store apply to --serve only")


def _report(out: dict, as_json: bool, summary: Callable[[dict], str]) -> int:
    """Print ``out`` (one JSON object or the summary); exit 1 only when a difference is outside tolerance."""
    print(json.dumps(out, indent=1) if as_json else summary(out))
    return EXIT_OK if out["within_tolerance"] else EXIT_CHECK_FAILED


def _run_world(a: argparse.Namespace) -> int:
    """``--world N``: the recipe's multi-rank layout on N spawned ranks (``world.py``)."""
    from .world import MAX_WORLD, main_world

    if not 2 <= a.world <= MAX_WORLD:
        raise UsageError(f"--world must be in [1, {MAX_WORLD}], got {a.world}")
    if a.model != "glm" or a.next_n is not None or a.record_trace or a.replacement_policy != "fifo":
        raise UsageError("--world applies to --model glm without --next-n / --record-trace / --replacement-policy")
    return main_world(a.world, a.mode, a.steps, a.config or "tiny", a.pool_size, a.dump_dir, a.json)


def _run_hf(a: argparse.Namespace) -> int:
    """``--model hf``: an unmodified Hugging Face model (``hf.py``)."""
    from .hf import run_hf, summary_hf

    if a.next_n is not None or a.record_trace:
        raise UsageError("--next-n / --record-trace apply to --model glm only")
    out = run_hf(a.config or "hf-tiny", a.steps, a.mode, a.pool_size, a.dump_dir, a.threads, a.attn, a.dtype,
                 replacement_policy=a.replacement_policy)
    return _report(out, a.json, summary_hf)


def _run_serve(a: argparse.Namespace) -> int:
    """``--serve``: the serving loop (``serve.py``)."""
    if a.record_trace or a.replacement_policy != "fifo" or a.dump_dir:
        raise UsageError("--serve does not take --record-trace / --replacement-policy / --dump-dir")
    buckets = parse_buckets(a.buckets, 4)
    check_arrival(a.arrival)
    spec = parse_store(a.store) if a.store is not None else {}  # checked before any model
    tiers = build_tiers(spec) if spec else None
    out = run_serve(a.config or "tiny", a.steps, a.mode, a.pool_size, 3 if a.next_n is None else a.next_n,
                    threads=a.threads, buckets=buckets, arrival=a.arrival, workload=a.workload, store_tiers=tiers,
                    store_rule=spec.get("rule", (None,))[0])
    return _report(out, a.json, summary_serve)


def parse_buckets(text: str, batch: int) -> list[int]:
    """``--buckets "2,4"`` (any order) -> ``[2, 4]``; every size in ``[1, batch]`` (``batch``: the serving
    loop's rows)."""
    if not text:
        return []
    return sorted(set(parse_ints(text, "--buckets", 1, batch)))


def check_arrival(arrival: float) -> None:
    """``--arrival``: the probability that a request waits at a free row, in ``(0, 1]``
    (``serve.ServeConfig.arrival``)."""
    if not 0.0 < arrival <= 1.0:
        raise UsageError(f"--arrival must be in (0, 1], got {arrival}")


def config_is_path(config: str, model: str = "glm") -> bool:
    """Whether ``--config`` names a yaml file (True) or a preset (False). A known preset name wins (a name
    such as ``glm-5.2-78l`` has a dot and may even match a file in the working folder); a path is
    something that exists or ends in ``.yaml`` / ``.yml``. Anything else is a ``UsageError`` that lists
    the presets of ``model`` (``glm`` or ``hf``)."""
    from ..models import hf, list_presets

    if config in list_presets():  # one folder holds both front-ends' presets
        return False
    if config.endswith((".yaml", ".yml")) or os.path.exists(config):
        return True
    presets = hf.list_presets() if model == "hf" else [c for c in list_presets() if c not in hf.list_presets()]
    raise UsageError(f"--config {config!r}: no such preset and not a yaml path (--model {model} presets: "
                     f"{', '.join(presets)}; a path ends in .yaml or .yml)")


def _check_config_fits_model(model: str, config: Optional[str]) -> None:
    """A recipe-form preset / yaml given to ``--model hf`` (or an HF one to ``--model glm``) is a user
    mistake: name the presets that fit, before anything is built."""
    from ..models import hf, list_presets

    if config is None:
        return
    hf_presets = hf.list_presets()
    glm_presets = [c for c in list_presets() if c not in hf_presets]  # one config folder holds both
    if model == "glm" and config in hf_presets:
        raise UsageError(f"--config {config!r} is a Hugging Face preset: use it with --model hf "
                         f"(--model glm takes {glm_presets} or a recipe yaml)")
    if model != "hf":
        return
    if config in glm_presets:
        raise UsageError(f"--config {config!r} is a recipe-form preset (--model glm); --model hf takes "
                         f"{hf_presets} or an HF yaml (model_config + runner_config)")
    if config_is_path(config, model) and os.path.isfile(config):
        data = read_config(config, "--config", CONFIG_SECTIONS)
        rc = data.get("runner_config", {})
        bad = sorted(set(rc) - set(hf.RUNNER_KEYS)) if isinstance(rc, dict) else []
        if bad:
            raise UsageError(f"--config {config!r} is not an HF config: runner_config keys {bad} are unknown to "
                             f"--model hf (known: {list(hf.RUNNER_KEYS)}); the HF presets are {hf_presets}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""``offload-demo --model hf``: an unmodified Hugging Face ``transformers`` DSA model (random init from
a preset: ``hf-tiny`` is ``GlmMoeDsaForCausalLM``; ``hf-deepseek-v32``, ``hf-hy-v4``, ``hf-dots3-note``,
``hf-glm5-next``, ``hf-deepseek-v4`` the other families, the class chosen from the preset's model type)
vs the same model compiled with the backend: prefill, then N teacher-forced decode steps on a
``StaticCache`` (a ``DynamicCache`` where the preset says so), side by side.

fp32 presets get the sparse rewrite only (the offload ops take f16/bf16 KV; reported, not an error);
``--dtype bfloat16`` adds the shared-indexer offload. Tolerances: fp32 1e-4 relative to the largest
logit (the rewrite only reorders the softmax sum); bf16 2e-2 (one bf16 ulp of the attention output is
0.4 %, and the sparse reduction runs over K rows instead of T). The JSON object has the recipe demo's
schema (``common.RESULT_KEYS``): the check is ``max_rel_diff["logits"]``; ``max_abs_diff["logits"]`` is
reported beside it; ``attn`` is null in both (the HF model does not expose its attention outputs).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from .common import max_diffs, op_counts, per_output, result, set_threads

log = logging.getLogger("offload_passes.apps.hf")

FP32_REL_TOL = 1e-4
BF16_REL_TOL = 2e-2


def run_hf(config: str = "hf-tiny", steps: int = 64, mode: str = "eager", pool_size: Optional[int] = None,
           dump_dir: Optional[str] = None, threads: int = 1, attn: Optional[str] = None,
           dtype: Optional[str] = None, replacement_policy: str = "fifo") -> dict:
    from .. import _compat
    from .._cli import UsageError
    from ..backend import make_offload_backend
    from ..models import hf
    from ..models.hf import families

    set_threads(threads)
    over: dict[str, Any] = {"decode_steps": steps}
    if dtype is not None:
        over["dtype"] = dtype
    base = hf.build(config, attn=attn, **over)
    limit = families.dynamo_limit(base.config.model_type)
    if limit is not None:  # before the second model is built: nothing of it would run
        raise UsageError(f"--config {config!r}: {limit}")
    comp = hf.build(config, attn=attn, **over)
    # every backend option reaches the backend, as in the recipe demo (second chance included)
    opts: dict[str, Any] = {"exe_mode": mode, "replacement_policy": replacement_policy}
    if pool_size is not None:
        opts["pool_size"] = pool_size
    if dump_dir:
        opts["dump_dir"] = dump_dir
    backend = make_offload_backend(**opts)
    # a DynamicCache (deepseek_v4's compressor state) graph-breaks in transformers' own cache code
    fullgraph = comp.runner.cache == "static" and comp.runner.fullgraph
    step_fn = torch.compile(comp.model, backend=backend, fullgraph=fullgraph)
    # inductor mode: the reference goes through Inductor too (its bf16 fusions round differently from
    # eager), so the difference measures the rewrite, not Inductor's numerics
    base_fn = torch.compile(base.model, backend="inductor", fullgraph=fullgraph) if mode == "inductor" else None
    with _compat.mask_indexing_traced():  # glm5_next pools its indexer keys with a boolean mask
        t0 = time.perf_counter()
        ref = base.run(base_fn, steps=steps)
        t_base = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = comp.run(step_fn, steps=steps)
        t_comp = time.perf_counter() - t0
    rep = backend.reports[-1] if backend.reports else {}
    d_abs, rel = max_diffs(ref, out)
    tol = FP32_REL_TOL if comp.runner.torch_dtype == torch.float32 else BF16_REL_TOL
    state = backend.state
    tot = state.totals() if state is not None else {"hits": 0, "misses": 0, "window": 0, "host_rows_read": 0}
    ops = op_counts(rep, replacement_policy)
    hfr = rep.get("hf", {})
    sites = hfr.get("sites", [])
    hits, misses = tot["hits"], tot["misses"]
    log.info("hf demo: %s (%s) compiled %d graph(s)", type(comp.model).__name__,
             getattr(comp.config, "model_type", "?"), len(backend.reports))
    return result(
        model="hf", config=config, mode=mode, steps=steps,
        B=comp.runner.batch_size, S=sites[0].get("S") if sites else None, K=sites[0]["K"] if sites else None,
        T=sites[0]["T"] if sites else None, prefill=comp.runner.prefill_len,
        attn_implementation=comp.runner.attn_implementation, dtype=comp.runner.dtype,
        pool_size=backend.options.resolved_pool_size,
        rewritten=bool(rep.get("rewritten")), sparse_layers=len(rep.get("sites", [])),
        groups=[g["layers"] for g in rep.get("groups", [])],
        offload=bool(hfr.get("offload")), ops=ops, replacement_policy=replacement_policy,
        hits=hits, misses=misses, window=tot["window"],
        hit_rate=hits / (hits + misses) if hits + misses else 0.0,
        host_rows_read=tot["host_rows_read"],
        # unmodified_host_rows_read / host_rows_saved: the HF model has no gather path to compare with (null)
        reference="unmodified model, " + ("inductor" if mode == "inductor" else "eager"),
        max_abs_diff=per_output(logits=d_abs), max_rel_diff=per_output(logits=rel),
        tolerance={"max_abs_diff": None, "max_rel_diff": per_output(logits=tol)},
        within_tolerance=rel <= tol,
        refusals=rep.get("refusals", []), offload_refusals=hfr.get("offload_refusals", []),
        dense_masks_left=hfr.get("dense_masks_left"),
        compile_s=rep.get("timings", {}).get("total_s", 0.0),
        pass_s=rep.get("timings", {}).get("pass_s", 0.0),
        timings=rep.get("timings", {}),
        state_bytes=state.total_bytes if state is not None else 0,
        run_s={"unmodified": t_base, "compiled": t_comp},
    )


def summary_hf(o: dict) -> str:
    lines = [
        f"offload demo: model=hf (transformers) config={o['config']} "
        f"attn={o['attn_implementation']} "
        f"dtype={o['dtype']} mode={o['mode']} steps={o['steps']} B={o['B']} K={o['K']} T={o['T']}",
        f"  rewritten: {o['rewritten']}   sparse layers: {o['sparse_layers']}   groups: {o['groups']}   "
        f"dense masks left: {o['dense_masks_left']}",
        f"  offload: {o['offload']}   final graph: {o['ops']['dsa_plan']} dsa_plan, {o['ops']['dsa_serve']} dsa_serve, "
        f"{o['ops']['dsa_install']} dsa_install",
    ]
    if o["offload"]:
        lines.append(f"  pool: hits {o['hits']}  misses {o['misses']}  window {o['window']}  "
                     f"hit rate {o['hit_rate']:.1%}")
    seen: dict[tuple, list] = {}
    for r in o["offload_refusals"]:
        seen.setdefault((r["reason"], r["detail"]), []).append(r.get("layer"))
    for (reason, detail), layers in seen.items():
        lines.append(f"  offload not applied ({reason}, layers {layers}): {detail}")
    lines.append(f"  max relative |diff| of the logits vs {o['reference']}: {o['max_rel_diff']['logits']:.3g}  "
                 f"({'within' if o['within_tolerance'] else 'OUTSIDE'} tolerance "
                 f"{o['tolerance']['max_rel_diff']['logits']:g})")
    lines.append(f"  compile {o['compile_s']:.2f} s, of which passes {o['pass_s'] * 1e3:.1f} ms")
    for r in o["refusals"]:
        lines.append(f"  refused: {r['reason']}: {r['detail']}")
    return "\n".join(lines)

"""``offload-demo --model hf``: the unmodified Hugging Face ``transformers`` GLM-5 DSA model
(``GlmMoeDsaForCausalLM``, random init from a preset such as ``hf-tiny``) vs the same model compiled
with the backend: prefill, then N teacher-forced decode steps on a ``StaticCache``, side by side.

fp32 presets get the sparse rewrite only (the offload ops take f16/bf16 KV; reported, not an error);
``--dtype bfloat16`` adds the shared-indexer offload. Tolerances: fp32 1e-4 relative to the largest
logit (the rewrite only reorders the softmax sum); bf16 2e-2 (one bf16 ulp of the attention output is
0.4 %, and the sparse reduction runs over K rows instead of T).
"""
from __future__ import annotations

import time
from typing import Any, Optional

import torch

FP32_REL_TOL = 1e-4
BF16_REL_TOL = 2e-2


def run_hf(config: str = "hf-tiny", steps: int = 64, mode: str = "eager", pool_size: Optional[int] = None,
           dump_dir: Optional[str] = None, threads: int = 1, attn: Optional[str] = None,
           dtype: Optional[str] = None) -> dict:
    from .backend import make_offload_backend
    from .models import hf

    if threads > 0:
        torch.set_num_threads(threads)
    over: dict[str, Any] = {"decode_steps": steps}
    if dtype is not None:
        over["dtype"] = dtype
    base = hf.build(config, attn=attn, **over)
    comp = hf.build(config, attn=attn, **over)
    opts: dict[str, Any] = {"exe_mode": mode}
    if pool_size is not None:
        opts["pool_size"] = pool_size
    if dump_dir:
        opts["dump_dir"] = dump_dir
    backend = make_offload_backend(**opts)
    step_fn = torch.compile(comp.model, backend=backend, fullgraph=True)
    # inductor mode: the reference goes through Inductor too (its bf16 fusions round differently from
    # eager), so the difference measures the rewrite, not Inductor's numerics
    base_fn = torch.compile(base.model, backend="inductor", fullgraph=True) if mode == "inductor" else None
    t0 = time.perf_counter()
    ref = base.run(base_fn, steps=steps)
    t_base = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = comp.run(step_fn, steps=steps)
    t_comp = time.perf_counter() - t0
    rep = backend.reports[-1] if backend.reports else {}
    rel = max(float((o.float() - r.float()).abs().max() / r.float().abs().max()) for r, o in zip(ref, out))
    tol = FP32_REL_TOL if comp.runner.torch_dtype == torch.float32 else BF16_REL_TOL
    state = backend.state
    tot = state.totals() if state is not None else {"hits": 0, "misses": 0, "window": 0, "host_rows_read": 0}
    ops = rep.get("ops", {}).get("after", {})
    hfr = rep.get("hf", {})
    sites = hfr.get("sites", [])
    return {
        "model": "hf", "config": config, "mode": mode, "steps": steps,
        "attn": comp.runner.attn_implementation, "dtype": comp.runner.dtype,
        "B": comp.runner.batch_size, "K": sites[0]["K"] if sites else None,
        "T": sites[0]["T"] if sites else None, "prefill": comp.runner.prefill_len,
        "rewritten": bool(rep.get("rewritten")), "sparse_layers": len(rep.get("sites", [])),
        "groups": [g["layers"] for g in rep.get("groups", [])],
        "offload": bool(hfr.get("offload")), "offload_refusals": hfr.get("offload_refusals", []),
        "dense_masks_left": hfr.get("dense_masks_left"),
        "ops": {k: ops.get(k, 0) for k in ("dsa_plan", "dsa_serve", "dsa_install")},
        "hits": tot["hits"], "misses": tot["misses"], "window": tot["window"],
        "hit_rate": tot["hits"] / (tot["hits"] + tot["misses"]) if tot["hits"] + tot["misses"] else 0.0,
        "max_rel_diff_logits": rel, "tolerance": tol, "within_tolerance": rel <= tol,
        "reference": "unmodified model, " + ("inductor" if mode == "inductor" else "eager"),
        "refusals": rep.get("refusals", []),
        "compile_s": rep.get("timings", {}).get("total_s", 0.0),
        "pass_s": rep.get("timings", {}).get("pass_s", 0.0),
        "run_s": {"unmodified": t_base, "compiled": t_comp},
    }


def summary_hf(o: dict) -> str:
    lines = [
        f"offload demo: model=hf (transformers GlmMoeDsaForCausalLM) config={o['config']} attn={o['attn']} "
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
    lines.append(f"  max relative |diff| of the logits vs {o['reference']}: {o['max_rel_diff_logits']:.3g}  "
                 f"({'within' if o['within_tolerance'] else 'OUTSIDE'} tolerance {o['tolerance']:g})")
    lines.append(f"  compile {o['compile_s']:.2f} s, of which passes {o['pass_s'] * 1e3:.1f} ms")
    for r in o["refusals"]:
        lines.append(f"  refused: {r['reason']}: {r['detail']}")
    return "\n".join(lines)

"""GPU check of the CUDA lowering: one script, one run (fits 10 minutes on an H100/H200-class GPU).

    python benchmarks/gpu_check.py                      # all three sections, table last, gpu_check.json
    python benchmarks/gpu_check.py --sections ops --merge   # rerun one section, keep the others' results
    python benchmarks/gpu_check.py --dry-run            # no GPU: correctness parts under Triton's interpreter

Each section runs under its own wall-clock limit (``LIMITS``, 470 s together; a section past its limit
reports ``TimeoutError`` and the next one starts).

1. **correctness**: the Triton kernels on CUDA against their CPU twins (three chained plan / serve /
   install steps with adversarial top-k, FIFO and second chance; the host-KV write into a pinned cache);
   the recipe ``tiny`` model with its full caches pinned on the host (``place_full_caches``) against the
   unmodified model; recipe-form ``tiny`` / ``small`` and Hugging Face ``hf-tiny`` / ``hf-glm5-attn`` (caches
   on the device), unmodified vs compiled with the offload backend in ``exe_mode="cuda"`` (installs on a
   side stream), logits compared step by step (max |diff|; 0 expected where the CPU path is exact).
   Not built yet: the side-stream delay run, opcheck, the GLM-5-geometry chain.
2. **ops**: ``dsa_serve`` hits vs a device-to-device copy of the same bytes and vs ``index_select``;
   the miss path (full caches in pinned host memory, read zero-copy) vs a pinned-host -> device copy of
   the same bytes (the host-link ceiling); ``dsa_install`` vs a device copy of the same bytes.
3. **decode**: per-step latency of ``hf-glm5-attn`` at 16K / 32K / 64K context: dense HF, sparse (the
   rewrite without offload), sparse + offload (pool 8K / 16K); HBM bytes the KV holds on the device and
   host bytes read per step.

Goals (docs/cuda.md; not asserted): correctness == 0 where the CPU path is exact; serve >= 0.8x the device
copy for hits; miss path >= 0.7x the pinned-host copy; at 64K with an 8K pool the device keeps <= 0.3x
the dense model's KV bytes (latent + indexer). Ratios are measured in this one run. Without CUDA the
script exits 2 with one line on stderr. The pure parts (byte accounting, table) are tested on CPU
(``tests/cuda/test_gpu_check.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Optional, Sequence

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402

CONTEXTS = (16384, 32768, 65536)
POOLS = (8192, 16384)
SECTIONS = ("correctness", "ops", "decode")
GOALS = {"serve_hit_vs_d2d": 0.8, "miss_vs_h2d": 0.7, "kv_fraction_64k_8k": 0.3}


# ------------------------------------------------------------------------------------ pure parts

def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    """``num / den``, None when either is missing or ``den`` is 0."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def gbps(nbytes: int, seconds: Optional[float]) -> Optional[float]:
    return None if not seconds else nbytes / seconds / 1e9


def dense_kv_bytes(layers: int, context: int, latent: int, rope: int, indexer_dim: int, indexer_layers: int,
                   batch: int = 1, elem: int = 2) -> dict:
    """Device bytes of the dense model's KV: latent + rope of every layer, indexer keys of its layers."""
    kv = layers * batch * context * (latent + rope) * elem
    idx = indexer_layers * batch * context * indexer_dim * elem
    return {"latent_rope": kv, "indexer": idx, "total": kv + idx}


def offload_kv_bytes(layers: int, context: int, latent: int, rope: int, indexer_dim: int, indexer_layers: int,
                     pool: int, topk: int, batch: int = 1, elem: int = 2) -> dict:
    """Device bytes with the full latent / rope caches on the host: per layer a pool of ``pool`` rows and
    a selection buffer of ``topk`` rows; the indexer keys stay on the device (they are read in full
    every step). Host bytes: the full caches."""
    row = (latent + rope) * elem
    pools = layers * batch * pool * row
    sel = layers * batch * topk * row
    idx = indexer_layers * batch * context * indexer_dim * elem
    return {"pool": pools, "selection": sel, "indexer": idx, "total": pools + sel + idx,
            "host": layers * batch * context * row}


def host_bytes_per_step(rows_read: int, latent: int, rope: int, elem: int = 2) -> int:
    """Bytes the miss path reads over the host link for ``rows_read`` full-cache rows (all layers)."""
    return rows_read * (latent + rope) * elem


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A Markdown table of ``rows`` (missing values ``-``, floats to 3 significant digits)."""
    head = "| " + " | ".join(columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def summary_rows(results: dict) -> list:
    """The one table printed last: every measured figure with its goal where the issue sets one."""
    rows = []
    for r in results.get("correctness", []):
        rows.append({"check": f"correctness {r['model']}", "value": r.get("max_abs_diff"), "goal": 0,
                     "note": r.get("error") or f"{r.get('steps')} steps, fallback calls {r.get('fallback_calls', 0)}"})
    for r in results.get("ops", []):
        rows.append({"check": r["what"], "value": r.get("ratio"), "goal": r.get("goal"),
                     "note": r.get("error") or f"{_cell(r.get('gbps'))} GB/s vs {_cell(r.get('ref_gbps'))} GB/s"})
    for r in results.get("decode", []):
        rows.append({"check": f"decode {r['variant']} @ {r['context']}", "value": r.get("ms_per_step"),
                     "goal": r.get("goal"), "note": r.get("error") or
                     f"device KV {_cell(r.get('device_kv_mib'))} MiB, host read/step {_cell(r.get('host_mib_per_step'))} MiB"
                     + (f", KV fraction {_cell(r.get('kv_fraction'))}" if r.get("kv_fraction") is not None else "")})
    return rows


# ------------------------------------------------------------------------------------ GPU parts

def _sync() -> None:
    torch.cuda.synchronize()


def time_cuda(fn: Callable[[], Any], reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    _sync()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def cuda_backend(**opts: Any):
    """The offload backend in exe_mode "cuda" (or, before the mode is registered in modes.py, the same
    backend with its lowering replaced by CudaLowering)."""
    from offload_passes import modes
    from offload_passes.backend import OffloadBackend, make_offload_backend
    from offload_passes.lowering.cuda import CUDA_MODE, CudaLowering

    if CUDA_MODE in modes.EXE_MODES:
        return make_offload_backend(exe_mode=CUDA_MODE, **opts)
    be = OffloadBackend(exe_mode="eager", **opts)
    be.lowering = CudaLowering(CUDA_MODE)
    return be


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def check_correctness(steps: int, dev: torch.device) -> list:
    from offload_passes import models
    from offload_passes.custom_ops.cuda import fallback
    from offload_passes.models import hf

    out = []
    for preset in ("tiny", "small"):
        row: dict = {"model": preset, "steps": steps}
        try:
            torch._dynamo.reset()
            n0 = sum(fallback.CALLS.values())
            base = models.build(preset, enable_offload=True, decode_steps=steps, device=dev)
            comp = models.build(preset, enable_offload=True, decode_steps=steps, device=dev)
            fn = torch.compile(comp.model, backend=cuda_backend(pool_size=1024))
            wrap = lambda m: (lambda ids, pos: m(ids.to(dev), pos.to(dev)))  # noqa: E731 (driver tokens live on the host)
            r0 = base.driver.run(steps=steps, step_fn=wrap(base.model))
            r1 = comp.driver.run(steps=steps, step_fn=wrap(fn))
            row["max_abs_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(r0.logits, r1.logits))
            row["fallback_calls"] = sum(fallback.CALLS.values()) - n0
        except Exception as e:  # a failing model must not hide the other figures
            row["error"] = _err(e)
            traceback.print_exc()
        out.append(row)
    for preset in ("hf-tiny", "hf-glm5-attn"):
        row = {"model": preset, "steps": steps}
        try:
            torch._dynamo.reset()
            b = hf.build(preset)
            model = b.model.to(dev)
            logits = []
            for fn in (model, torch.compile(model, backend=cuda_backend(), fullgraph=True, dynamic=False)):
                logits.append(_hf_decode(b, model, fn, ctx=256, steps=steps, dev=dev)[0])
            row["max_abs_diff"] = max(float((x.float() - y.float()).abs().max()) for x, y in zip(*logits))
        except Exception as e:
            row["error"] = _err(e)
            traceback.print_exc()
        out.append(row)
    return out


def _hf_cache(b, model, max_len: int, dev: torch.device):
    import transformers as tf

    return tf.StaticCache(config=b.config, max_cache_len=max_len, max_batch_size=1)


def _hf_decode(b, model, fn, ctx: int, steps: int, dev: torch.device, timings: Optional[list] = None,
               host_kv: bool = False) -> tuple:
    """Prefill 1 token, seed a synthetic context of ``ctx`` rows, decode ``steps`` tokens with ``fn``."""
    cache = _hf_cache(b, model, ctx + steps + 2, dev)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, b.config.vocab_size, (1, ctx + steps + 2), generator=g).to(dev)
    with torch.no_grad():
        model(ids[:, :1], past_key_values=cache, use_cache=True)
        for layer in cache.layers:
            for name in ("keys", "values", "indexer_keys"):
                t = getattr(layer, name, None)
                if t is not None:
                    dim = 2 if t.dim() == 4 else 1
                    t.narrow(dim, 0, ctx).copy_(torch.randn(t.narrow(dim, 0, ctx).shape, generator=g).to(t.dtype))
            for name in ("cumulative_length", "indexer_cumulative_length"):
                c = getattr(layer, name, None)
                if isinstance(c, torch.Tensor):
                    c.fill_(ctx)
        if host_kv:
            from offload_passes.cuda import place_full_caches

            place_full_caches(cache, dev)
        out = []
        for s in range(steps):
            pos = torch.full((1, 1), ctx + s, dtype=torch.long, device=dev)
            _sync()
            t0 = time.perf_counter()
            res = fn(ids[:, ctx + s:ctx + s + 1], past_key_values=cache, use_cache=True, position_ids=pos)
            _sync()
            if timings is not None:
                timings.append(time.perf_counter() - t0)
            out.append(res.logits.detach().clone())
        return out, cache


def cache_device_bytes(cache) -> dict:
    """Bytes of a StaticCache's latent / rope / indexer tensors by where they live."""
    out = {"device": 0, "host": 0}
    for layer in cache.layers:
        for name in ("keys", "values", "indexer_keys"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                out["device" if t.is_cuda else "host"] += t.numel() * t.element_size()
    return out


def bench_ops(dev: torch.device, reps: int) -> list:
    """Serve (hits, misses from pinned host), install, against copies of the same bytes."""
    from offload_passes.custom_ops.cuda import dsa_install as CI
    from offload_passes.custom_ops.cuda import dsa_serve as CS

    B, S, K, PS, F, Dkv, Dr, sbs = 1, 1, 2048, 16384, 65536, 512, 64, 128
    bf = torch.bfloat16
    rows = B * S * K
    nbytes = rows * (Dkv + Dr) * 2
    g = torch.Generator().manual_seed(0)
    full_kv = torch.randn(B, F, Dkv, generator=g).to(bf).pin_memory()
    full_rope = torch.randn(B, F, Dr, generator=g).to(bf).pin_memory()
    pool_kv, pool_rope = torch.randn(B, PS, Dkv, device=dev).to(bf), torch.randn(B, PS, Dr, device=dev).to(bf)
    sel_kv, sel_rope = torch.empty(rows // sbs, sbs, Dkv, dtype=bf, device=dev), torch.empty(rows // sbs, sbs, Dr, dtype=bf, device=dev)
    slots = torch.randperm(PS, generator=g)[:rows].to(torch.int32)
    ids = torch.randperm(F, generator=g)[:rows].to(torch.int32)
    kw = dict(raw_seq=S, topk=K, selection_block_size=sbs)
    out = []

    def rec(what: str, t: Optional[float], ref: Optional[float], goal=None, error=None) -> None:
        out.append({"what": what, "gbps": gbps(nbytes, t), "ref_gbps": gbps(nbytes, ref), "ratio": ratio(ref, t),
                    "goal": goal, "error": error})

    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t_d2d = time_cuda(lambda: dst.copy_(src), reps)
    host_src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    t_h2d = time_cuda(lambda: dst.copy_(host_src, non_blocking=True), reps)
    flat_kv, flat_rope = pool_kv.view(-1, Dkv), pool_rope.view(-1, Dr)
    idx = slots.to(dev).long()
    t_isel = time_cuda(lambda: (torch.index_select(flat_kv, 0, idx), torch.index_select(flat_rope, 0, idx)), reps)
    try:
        plan_hit = torch.stack([torch.ones(rows, dtype=torch.int32), slots], 1).to(dev)
        t = time_cuda(lambda: CS.run(plan_hit, full_kv, full_rope, pool_kv, pool_rope, sel_kv, sel_rope, **kw), reps)
        rec("serve hits vs D2D copy", t, t_d2d, GOALS["serve_hit_vs_d2d"])
        rec("serve hits vs index_select", t, t_isel)
    except Exception as e:
        rec("serve hits vs D2D copy", None, t_d2d, GOALS["serve_hit_vs_d2d"], _err(e))
    try:
        plan_miss = torch.stack([torch.full((rows,), 2, dtype=torch.int32), ids], 1).to(dev)
        t = time_cuda(lambda: CS.run(plan_miss, full_kv, full_rope, pool_kv, pool_rope, sel_kv, sel_rope, **kw), reps)
        rec("serve misses (pinned host, zero-copy) vs H2D copy", t, t_h2d, GOALS["miss_vs_h2d"])
    except Exception as e:
        rec("serve misses (pinned host, zero-copy) vs H2D copy", None, t_h2d, GOALS["miss_vs_h2d"], _err(e))
    try:
        from offload_passes.custom_ops.cuda import dsa_plan as CP

        L = torch.tensor([F], dtype=torch.int32, device=dev)
        tk = torch.randperm(F - 8, generator=g)[:K].to(torch.int32).view(1, 1, 1, K).to(dev)
        pid = torch.full((B, PS), -1, dtype=torch.int32, device=dev)
        i2s = torch.full((B, F), -1, dtype=torch.int32, device=dev)
        lru = torch.zeros(B, PS // 16, dtype=torch.int32, device=dev)
        _, records, _ = CP.run(tk, L, pid, i2s, lru, raw_seq=S)
        table = torch.arange(rows // sbs, dtype=torch.int32, device=dev).view(B * S, K // sbs)
        state = [pool_kv, pool_rope, pid, i2s, lru]
        t = time_cuda(lambda: CI.run(records, sel_kv, sel_rope, table, *state, metadata_update=0, **kw), reps)
        rec("install (all misses, md=0) vs D2D copy", t, t_d2d)
    except Exception as e:
        rec("install (all misses, md=0) vs D2D copy", None, t_d2d, None, _err(e))
    return out


def bench_decode(contexts: Sequence[int], pools: Sequence[int], steps: int, dev: torch.device) -> list:
    from offload_passes.backend import make_offload_backend
    from offload_passes.custom_ops.cuda import fallback
    from offload_passes.models import hf

    b = hf.build("hf-glm5-attn")
    model = b.model.to(dev)
    cfg = b.config
    C, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    out = []
    for ctx in contexts:
        dense_bytes = None
        variants = [("dense", None, None), ("sparse", False, None)] + [(f"offload pool {p}", True, p) for p in pools]
        for name, offload, pool in variants:
            row: dict = {"variant": name, "context": ctx}
            try:
                torch._dynamo.reset()
                n0 = sum(fallback.CALLS.values())
                if offload is None:
                    fn, be = model, None
                elif offload is False:
                    be = make_offload_backend(enable_offload=False)
                    fn = torch.compile(model, backend=be, fullgraph=True, dynamic=False)
                else:
                    be = cuda_backend(pool_size=pool)
                    fn = torch.compile(model, backend=be, fullgraph=True, dynamic=False)
                times: list = []
                _, cache = _hf_decode(b, model, fn, ctx, steps + 1, dev, timings=times, host_kv=bool(offload))
                row["ms_per_step"] = statistics.median(times[1:]) * 1e3  # the first step compiles
                where = cache_device_bytes(cache)
                dev_kv = where["device"]
                if be is not None and be.state is not None:
                    st = be.state  # pools, selection buffers, metadata (device-resident when placed right)
                    dev_kv += sum(t.numel() * t.element_size() for t in st.tensors().values() if t.is_cuda)
                    rows_read = st.totals("step")["host_rows_read"]
                    row["host_mib_per_step"] = host_bytes_per_step(rows_read, C, R) / 2 ** 20
                row["device_kv_mib"] = dev_kv / 2 ** 20
                row["host_kv_mib"] = where["host"] / 2 ** 20
                row["fallback_calls"] = sum(fallback.CALLS.values()) - n0
                if offload is None:
                    dense_bytes = row["device_kv_mib"]
                elif offload and dense_bytes:
                    row["kv_fraction"] = ratio(row.get("device_kv_mib"), dense_bytes)
                    if ctx == 65536 and pool == 8192:
                        row["goal"] = GOALS["kv_fraction_64k_8k"]
            except Exception as e:
                row["error"] = _err(e)
                traceback.print_exc()
            out.append(row)
    return out


# ------------------------------------------------------------------------------------ correctness parts
# (run on a GPU against the CPU twins, and under Triton's interpreter by --dry-run)

NO_GPU = "no GPU"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.is_floating_point() else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a.cpu()), _bits(b.cpu()))


def op_chain(dev: torch.device, steps: int = 3, B: int = 2, S: int = 1, K: int = 64, PS: int = 32, F: int = 200,
             D: int = 8, Dr: int = 4, sbs: int = 16, second_chance: bool = False, seed: int = 0) -> dict:
    """``steps`` chained plan -> serve -> install steps, the Triton kernels on ``dev`` against the CPU twins
    (the C++ kernels) on host copies of the same state; adversarial top-k: -1 sentinels, duplicates, ids
    beyond the length. Returns ``{"steps", "mismatch": first differing output or None}``."""
    from offload_passes.custom_ops.cuda import dsa_install as CI
    from offload_passes.custom_ops.cuda import dsa_install_sc as CSC
    from offload_passes.custom_ops.cuda import dsa_plan as CP
    from offload_passes.custom_ops.cuda import dsa_serve as CS

    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    host = dict(pid=torch.full((B, PS), -1, dtype=torch.int32), i2s=torch.full((B, F), -1, dtype=torch.int32),
                lru=torch.zeros(B, PS // 16, dtype=torch.int32), pkv=torch.zeros(B, PS, D, dtype=bf),
                prope=torch.zeros(B, PS, Dr, dtype=bf))
    full_kv, full_rope = torch.randn(B, F, D, generator=g).to(bf), torch.randn(B, F, Dr, generator=g).to(bf)
    on = {k: v.to(dev) for k, v in host.items()}
    fkv_d, frope_d = full_kv.to(dev), full_rope.to(dev)
    rows = B * S * K
    table = torch.arange(rows // sbs, dtype=torch.int32).view(B * S, K // sbs)
    kw = dict(raw_seq=S, topk=K, selection_block_size=sbs)
    for step in range(steps):
        L = torch.full((B,), 120 + 10 * step, dtype=torch.int32)
        tk = torch.randint(-1, 140 + 10 * step, (B, S, 1, K), generator=g, dtype=torch.int32)
        tk[..., K // 2:] = tk[..., :K // 2]  # duplicates
        plan, rec, act = torch.ops.custom.dsa_plan(tk, L, host["pid"], host["i2s"], host["lru"], raw_seq=S)
        plan_d, rec_d, act_d = CP.run(tk.to(dev), L.to(dev), on["pid"], on["i2s"], on["lru"], raw_seq=S)
        for name, a, b in (("plan", plan, plan_d), ("records", rec, rec_d), ("actual_seq", act, act_d)):
            if not _same(a, b):
                return {"steps": step, "mismatch": f"step {step}: dsa_plan {name}"}
        sel = [torch.zeros(rows // sbs, sbs, D, dtype=bf), torch.zeros(rows // sbs, sbs, Dr, dtype=bf)]
        sel_d = [t.to(dev) for t in sel]
        torch.ops.custom.dsa_serve(plan, full_kv, full_rope, host["pkv"], host["prope"], *sel, compact_layout=1, **kw)
        CS.run(plan_d, fkv_d, frope_d, on["pkv"], on["prope"], *sel_d, compact_layout=1, **kw)
        if not all(_same(a, b) for a, b in zip(sel, sel_d)):
            return {"steps": step, "mismatch": f"step {step}: dsa_serve selection"}
        state = [host[k] for k in ("pkv", "prope", "pid", "i2s", "lru")]
        state_d = [on[k] for k in ("pkv", "prope", "pid", "i2s", "lru")]
        if second_chance:
            torch.ops.offload_ref.dsa_install_sc(plan, rec, *sel, table, *state, metadata_update=1, **kw)
            CSC.run(plan_d, rec_d, *sel_d, table.to(dev), *state_d, metadata_update=1, **kw)
        else:
            torch.ops.custom.dsa_install(rec, *sel, table, *state, metadata_update=1, **kw)
            CI.run(rec_d, *sel_d, table.to(dev), *state_d, metadata_update=1, **kw)
        for k in ("pkv", "prope", "pid", "i2s", "lru"):
            if not _same(host[k], on[k]):
                return {"steps": step, "mismatch": f"step {step}: install {k}"}
    return {"steps": steps, "mismatch": None}


def host_write_check(dev: torch.device) -> Optional[str]:
    """The host-KV write kernel against the CPU kernel (rows in any order, distinct)."""
    from offload_passes.custom_ops.cuda import cache_write as CW

    g = torch.Generator().manual_seed(1)
    kvc, krc = torch.randn(8, 16, 1, 512, generator=g).bfloat16(), torch.randn(8, 16, 1, 64, generator=g).bfloat16()
    idx = torch.randperm(128, generator=g)[:40]
    kv, kr = torch.randn(40, 512, generator=g).bfloat16(), torch.randn(40, 64, generator=g).bfloat16()
    ref = [kvc.clone(), krc.clone()]
    torch.ops.offload_ref.npu_mla_prolog_cache_write_(*ref, idx, kv, kr)
    dst = [kvc.clone(), krc.clone()]
    if dev.type == "cuda":
        from offload_passes.cuda import host_pinned

        dst = [host_pinned(t) for t in dst]  # the production case: a pinned host cache, device rows
    CW.run(*dst, idx.to(dev), kv.to(dev), kr.to(dev))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return None if all(_same(a, b) for a, b in zip(ref, dst)) else "host write differs from the CPU kernel"


def model_check(dev: torch.device, steps: int, preset: str = "tiny") -> dict:
    """The recipe model with host KV (on a GPU: place_full_caches) compiled in exe_mode "cuda" against the
    unmodified model, logits step by step; on the CPU (--dry-run) the same flow with host tensors."""
    from offload_passes import models

    torch._dynamo.reset()
    base = models.build(preset, enable_offload=True, decode_steps=steps, device=dev)
    comp = models.build(preset, enable_offload=True, decode_steps=steps, device=dev)
    if dev.type == "cuda":
        from offload_passes.cuda import place_full_caches

        place_full_caches(comp.model, dev)
    be = cuda_backend(pool_size=1024)
    r0 = base.driver.run(steps=steps)
    r1 = comp.driver.run(steps=steps, step_fn=torch.compile(comp.model, backend=be))
    from offload_passes.cuda import raise_device_errors

    raise_device_errors()
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(r0.logits, r1.logits))
    return {"model": f"{preset} host KV", "max_abs_diff": diff, "steps": steps,
            "rewritten": bool(be.reports and be.reports[-1]["rewritten"])}


def run_section(name: str, fn: Callable[[], Any], limit_s: float) -> tuple:
    """``fn()`` under a wall-clock limit (SIGALRM; main thread); ``(result, error, seconds)``."""
    import signal

    def _alarm(signum, frame):
        raise TimeoutError(f"section {name} passed its limit of {limit_s:.0f} s")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    t0 = time.perf_counter()
    try:
        return fn(), None, time.perf_counter() - t0
    except Exception as e:  # a failing section must not hide the others
        traceback.print_exc()
        return None, _err(e), time.perf_counter() - t0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


#: section -> seconds it may run on an H200, Triton's first compiles included (together under 8 minutes)
LIMITS = {"correctness": 180, "ops": 90, "decode": 200}


def dry_run_rows(steps: int) -> list:
    """Every section's correctness part on the CPU (Triton's interpreter), timing cells "no GPU"."""
    cpu = torch.device("cpu")
    rows = []
    for sc in (False, True):
        res, err, _ = run_section("ops", lambda: op_chain(cpu, second_chance=sc), 120)
        rows.append({"check": f"ops chain ({'second chance' if sc else 'FIFO'}) == CPU twins", "value":
                     None if res is None else int(res["mismatch"] is None), "goal": 1,
                     "note": err or res["mismatch"] or f"{res['steps']} steps, interpreter"})
    res, err, _ = run_section("ops", lambda: host_write_check(cpu), 60)
    rows.append({"check": "host-KV write == CPU kernel", "value": None if err else int(res is None), "goal": 1,
                 "note": err or res or "interpreter"})
    res, err, _ = run_section("models", lambda: model_check(cpu, steps), 300)
    rows.append({"check": "correctness tiny (cuda mode, host tensors)", "value": None if res is None else
                 res["max_abs_diff"], "goal": 0, "note": err or f"{steps} steps, rewritten {res['rewritten']}"})
    for what in ("serve hits B=32 vs D2D", "serve hits B=128 vs D2D", "misses vs host link",
                 "install ms", "decode ms/step hf-glm5-attn", "CUDA graph replay vs eager"):
        rows.append({"check": what, "value": NO_GPU, "goal": None, "note": NO_GPU})
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--pools", default=",".join(map(str, POOLS)))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default="gpu_check.json", help="where the results go (JSON)")
    ap.add_argument("--merge", action="store_true",
                    help="partial rerun: keep the other sections' results already in --json")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: every correctness part on the CPU under Triton's interpreter, timing cells 'no GPU'")
    try:
        args = ap.parse_args(argv)
        sections = [s for s in args.sections.split(",") if s]
        bad = [s for s in sections if s not in SECTIONS]
        if bad:
            raise ValueError(f"--sections: unknown {bad}; known: {list(SECTIONS)}")
        contexts = [int(x) for x in args.contexts.split(",") if x]
        pools = [int(x) for x in args.pools.split(",") if x]
        if args.steps < 1 or args.reps < 1:
            raise ValueError(f"--steps and --reps must be >= 1, got {args.steps} and {args.reps}")
    except ValueError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        return _dry_run(args)
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False); "
              "this check needs a GPU", file=sys.stderr)
        return 2
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        print("gpu_check: the Triton kernels need the `triton` package (pip install 'offload_passes[cuda]')",
              file=sys.stderr)
        return 2
    import offload_passes  # noqa: F401  (registers the ops and, with CUDA + triton, their CUDA kernels)

    dev = torch.device("cuda", torch.cuda.current_device())
    results: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "steps": args.steps}
    t0 = time.perf_counter()
    if args.merge and os.path.exists(args.json):  # a partial rerun: the other sections' results are kept
        with open(args.json) as f:
            results = {**json.load(f), **results}

    def equal_rows() -> list:
        rows = []
        for sc in (False, True):
            r = op_chain(dev, second_chance=sc)
            rows.append({"model": f"ops chain ({'second chance' if sc else 'FIFO'}) on CUDA vs CPU twins",
                         "max_abs_diff": 0.0 if r["mismatch"] is None else None, "steps": r["steps"],
                         "error": r["mismatch"]})
        err = host_write_check(dev)
        rows.append({"model": "host-KV write (pinned) vs CPU kernel", "max_abs_diff": None if err else 0.0,
                     "steps": 1, "error": err})
        rows.append(model_check(dev, args.steps))
        return rows

    plan = {"correctness": lambda: equal_rows() + check_correctness(args.steps, dev),
            "ops": lambda: bench_ops(dev, args.reps),
            "decode": lambda: bench_decode(contexts, pools, args.steps, dev)}
    for name in SECTIONS:
        if name in sections:
            res, err, secs = run_section(name, plan[name], LIMITS[name])
            results[name] = res if res is not None else [{"model": name, "what": name, "variant": name,
                                                          "context": 0, "error": err}]
            results.setdefault("section_s", {})[name] = secs
    results["wall_s"] = time.perf_counter() - t0
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"gpu_check on {results['device']} ({results['wall_s']:.0f} s), JSON: {args.json}")
    print(format_table(summary_rows(results), ("check", "value", "goal", "note")))
    return 0


def _dry_run(args) -> int:
    if importlib_util_find_spec("triton") is None:
        print("gpu_check: --dry-run needs the `triton` package (pip install 'offload_passes[cuda]')", file=sys.stderr)
        return 2
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        print("gpu_check: --dry-run: triton was imported before TRITON_INTERPRET=1 could be set", file=sys.stderr)
        return 2
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported: the kernels run on CPU tensors
    import offload_passes  # noqa: F401
    from offload_passes.custom_ops import cuda as kernels

    t0 = time.perf_counter()
    rows = dry_run_rows(min(args.steps, 2))
    results = {"device": "cpu (dry run, Triton interpreter)", "torch": torch.__version__, "dry_run": True,
               "kernels_importable": kernels.triton_available(), "rows": rows, "wall_s": time.perf_counter() - t0}
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"gpu_check --dry-run ({results['wall_s']:.0f} s), JSON: {args.json}")
    print(format_table(rows, ("check", "value", "goal", "note")))
    return 0 if all(r["value"] == r["goal"] for r in rows if r["goal"] is not None) else 1


def importlib_util_find_spec(name: str):
    import importlib.util

    return importlib.util.find_spec(name)


if __name__ == "__main__":
    sys.exit(main())

"""GPU check of the CUDA lowering: one script, one run (fits 10 minutes on an H100/H200-class GPU).

    python benchmarks/gpu_check.py                      # all three sections, table last, gpu_check.json
    python benchmarks/gpu_check.py --sections ops --json out.json --contexts 16384

1. **correctness**: recipe-form ``tiny`` / ``small`` and Hugging Face ``hf-tiny`` / ``hf-glm5-attn``,
   unmodified vs compiled with the offload backend in ``exe_mode="cuda"`` (installs on a side stream),
   logits compared step by step (max |diff|; 0 expected where the CPU path is exact).
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
    from offload_passes.lowering_cuda import CUDA_MODE, CudaLowering

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


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--pools", default=",".join(map(str, POOLS)))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default="gpu_check.json", help="where the results go (JSON)")
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
    if "correctness" in sections:
        results["correctness"] = check_correctness(args.steps, dev)
    if "ops" in sections:
        results["ops"] = bench_ops(dev, args.reps)
    if "decode" in sections:
        results["decode"] = bench_decode(contexts, pools, args.steps, dev)
    results["wall_s"] = time.perf_counter() - t0
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"gpu_check on {results['device']} ({results['wall_s']:.0f} s), JSON: {args.json}")
    print(format_table(summary_rows(results), ("check", "value", "goal", "note")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

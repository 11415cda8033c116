"""GPU check of the CUDA lowering: one command, one run, at most 8 minutes on an H200 (Triton's first
compiles included), a Markdown table and a JSON file.

    python benchmarks/gpu_check.py                           # every section, table last, gpu_check.json
    python benchmarks/gpu_check.py --sections serve --merge  # partial rerun: one section, keep the others
    python benchmarks/gpu_check.py --dry-run                 # no GPU: correctness parts under Triton's interpreter

Sections (:data:`SECTIONS`: each with its own wall-clock limit and an estimate of its time on an H200; a
section past its limit reports ``TimeoutError`` and the next one starts):

* ``equal``: every op's Triton kernel on CUDA equal to its CPU twin (the C++ kernel), bit for bit: chained
  plan / serve / install steps with adversarial top-k (-1 sentinels, duplicates, ids past the length),
  FIFO and second chance, at a small geometry and at the GLM-5 geometry; the baseline gather (K <= 32
  block path and the K = 64 token path); the host-KV write into a pinned cache; ``torch.library.opcheck``
  of the ops with CUDA tensors.
* ``models``: the recipe ``tiny`` model and the Hugging Face ``hf-tiny`` / ``hf-glm5-attn`` with their full
  caches in pinned host memory, compiled in ``exe_mode="cuda"``, against the unmodified model (logits step
  by step, 0 expected where the CPU path is exact); also with a deliberate delay on the install side
  stream (``torch.cuda._sleep`` at every scope entry: a missing join shows as a difference).
* ``serve``: ``dsa_serve`` hits at B = 32 and 128 against a device-to-device copy of the same bytes (the
  device-copy ceiling); misses from pinned host memory, sequential and random rows, against a
  pinned-host-to-device copy of the same bytes (the host-link ceiling).
* ``kernels``: ``dsa_plan``, ``dsa_install`` (FIFO) and ``dsa_install_sc`` (second chance) times at B = 32
  and 128 (K = 2048, pool 8192, half the rows hits).
* ``decode``: ms per decode step of ``hf-glm5-attn`` at 16K and 64K: dense HF, sparse (the rewrite without
  offload), sparse + offload with an 8K and a 16K pool (host KV); device KV bytes as a fraction of the
  dense model's KV (latent + rope + indexer).
* ``graphs``: the offload step captured in one CUDA graph (``cuda_graphs=True``,
  ``offload_passes/lowering/cuda_graphs.py``) against the same step run eagerly: ms per step and the
  logits' difference; host KV when the graph is capturable, else the refusal and device KV.

Goals (docs/cuda.md; not asserted): equal rows exact; serve >= 0.8x the device copy for hits; misses >=
0.7x the host-link copy; at 64K with an 8K pool the device keeps <= 0.3x the dense KV. Without CUDA the
script exits 2 with one line on stderr, except ``--dry-run``, which runs every section's correctness part
on CPU tensors under Triton's interpreter and writes "no GPU" in every timing cell. The pure parts (byte
accounting, ratios, table) and the dry run are tested on CPU (``tests/cuda/test_gpu_check.py``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402

CONTEXTS = (16384, 65536)
POOLS = (8192, 16384)
GOALS = {"serve_hit_vs_d2d": 0.8, "miss_vs_h2d": 0.7, "kv_fraction_64k_8k": 0.3}
NO_GPU = "no GPU"
COLUMNS = ("section", "check", "value", "goal", "note")


class Section(NamedTuple):
    """One part of the check: its wall-clock limit and the estimate it was sized by (seconds on an H200,
    Triton's first compile of the kernels it launches included)."""

    name: str
    limit_s: int
    estimate_s: int
    why: str


#: the sections, in run order; limits 470 s together (under 8 minutes), estimates 315 s
SECTIONS = {s.name: s for s in (
    Section("equal", 80, 50, "chains at two geometries x 2 policies, gather, host write, 6 opchecks; "
            "about 20 kernel compiles of 1-2 s"),
    Section("models", 110, 80, "6 compiles (tiny, hf-tiny, hf-glm5-attn; with and without delay) of "
            "5-15 s, 4 decode steps each"),
    Section("serve", 40, 25, "pinned host allocations (1.2 GB) and 6 timed kernels x 20 reps"),
    Section("kernels", 30, 15, "plan / install / second chance at 2 batch sizes x 20 reps"),
    Section("decode", 160, 115, "8 compiles of hf-glm5-attn (2 contexts x 4 variants) of about 10 s, "
            "synthetic 64K context fills"),
    Section("graphs", 50, 30, "2 compiles of hf-glm5-attn at 16K, one capture, 20 replays"),
)}


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


def row(section: str, check: str, value: Any = None, goal: Any = None, note: str = "", ok: Optional[bool] = None,
        **extra: Any) -> dict:
    """One line of the table. ``ok``: a correctness verdict (False fails the run), None for a figure."""
    return {"section": section, "check": check, "value": value, "goal": goal, "note": note, "ok": ok, **extra}


def timing_row(section: str, check: str, seconds: Optional[float], ref: Optional[float] = None,
               goal: Optional[float] = None, nbytes: Optional[int] = None, dry: bool = False,
               note: str = "") -> dict:
    """A timing line: ``ref / seconds`` when a ceiling is given (value = fraction of the ceiling), else ms."""
    if dry:
        return row(section, check, NO_GPU, goal, NO_GPU)
    if ref is not None:
        value = ratio(ref, seconds)
        if nbytes:
            rate = f"{_cell(gbps(nbytes, seconds))} GB/s vs {_cell(gbps(nbytes, ref))} GB/s"
            note = f"{note}; {rate}" if note else rate
    else:
        value = None if seconds is None else seconds * 1e3
        note = note or "ms"
    return row(section, check, value, goal, note)


def summary_rows(results: dict) -> list:
    """Every section's rows in section order (a section that failed: one row with its error)."""
    rows = []
    for name in SECTIONS:
        part = results.get(name)
        if isinstance(part, dict) and "error" in part:
            rows.append(row(name, f"section {name}", None, None, part["error"], ok=False))
        elif isinstance(part, list):
            rows.extend(part)
    return rows


def failed(rows: Sequence[dict]) -> list:
    """The rows whose correctness verdict is False."""
    return [r for r in rows if r.get("ok") is False]


# ------------------------------------------------------------------------------------ device helpers

def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
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



# ------------------------------------------------------------------------------------ equal

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.is_floating_point() else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a.cpu()), _bits(b.cpu()))


def _copy(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A separate copy of ``t`` on ``dev`` (``Tensor.to`` returns ``t`` itself when it is already there: the
    dry run's two sides would share their state)."""
    return t.clone() if t.device == dev else t.to(dev)


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
    on = {k: _copy(v, dev) for k, v in host.items()}
    fkv_d, frope_d = full_kv.to(dev), full_rope.to(dev)
    rows = B * S * K
    table = torch.arange(rows // sbs, dtype=torch.int32).view(B * S, K // sbs)
    kw = dict(raw_seq=S, topk=K, selection_block_size=sbs)
    for step in range(steps):
        L = torch.full((B,), 3 * F // 5 + step * (F // 20), dtype=torch.int32)
        tk = torch.randint(-1, 3 * F // 5 + F // 10 + step * (F // 20), (B, S, 1, K), generator=g, dtype=torch.int32)
        tk[..., K // 2:] = tk[..., :K // 2]  # duplicates
        plan, rec, act = torch.ops.custom.dsa_plan(tk, L, host["pid"], host["i2s"], host["lru"], raw_seq=S)
        plan_d, rec_d, act_d = CP.run(tk.to(dev), L.to(dev), on["pid"], on["i2s"], on["lru"], raw_seq=S)
        for name, a, b in (("plan", plan, plan_d), ("records", rec, rec_d), ("actual_seq", act, act_d)):
            if not _same(a, b):
                return {"steps": step, "mismatch": f"step {step}: dsa_plan {name}"}
        sel = [torch.zeros(rows // sbs, sbs, D, dtype=bf), torch.zeros(rows // sbs, sbs, Dr, dtype=bf)]
        sel_d = [_copy(t, dev) for t in sel]
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




def gather_check(dev: torch.device, K: int, bsz: int, seed: int = 3) -> Optional[str]:
    """The baseline gather's Triton kernels against the C++ kernel, two chained steps (the second reuses the
    first step's ledger); None when equal, else what differs."""
    from offload_passes.custom_ops.cuda import npu_gather_selection_kv_cache as CG

    g = torch.Generator().manual_seed(seed)
    B, S, D, Dr = 2, 2, 8, 4
    SBS = FBS = 16 * bsz if bsz > 1 else 16
    cap = 3 * K * bsz + 16 * bsz
    fblk = (cap + FBS - 1) // FBS
    full_kv = torch.randn(B * fblk, FBS, D, generator=g).bfloat16()
    full_rope = torch.randn(B * fblk, FBS, Dr, generator=g).bfloat16()
    fbt = torch.randperm(B * fblk, generator=g).to(torch.int32).view(B, fblk)
    sblk = (K * bsz + SBS - 1) // SBS
    sbt = torch.arange(B * S * sblk, dtype=torch.int32).view(B * S, sblk)
    state = [torch.zeros(B * S * sblk, SBS, d, dtype=torch.bfloat16) for d in (Dr, D)]
    state += [sbt, torch.full((B, S, 1, K + 1), -1, dtype=torch.int32)]  # the ledger, BSND, empty
    mine = [_copy(t, dev) for t in state]
    L = torch.tensor([2 * K * bsz + 5, K * bsz // 2 + 3], dtype=torch.int32)
    qs = torch.full((B,), S, dtype=torch.int32)
    for step in range(2):
        blocks = (int(L.max()) + bsz - 1) // bsz + 2
        tk = torch.randint(-1, blocks, (B, S, 1, K), generator=g, dtype=torch.int32)
        tk[..., K // 2:] = tk[..., :K // 2].flip(-1)  # duplicates
        args = lambda st, d: (*st, tk.to(d), full_rope.to(d), full_kv.to(d), fbt.to(d), L.to(d), qs.to(d))  # noqa: E731
        act = torch.ops.custom.npu_gather_selection_kv_cache(*args(state, "cpu"), selection_topk_block_size=bsz)
        act_d = CG.run(*args(mine, dev), bsz)
        if not _same(act, act_d):
            return f"step {step}: actual_seq"
        for name, a, b in zip(("selection_k_rope", "selection_kv_cache", "table", "status"), state, mine):
            if not _same(a, b):
                return f"step {step}: {name}"
        L = L + 3
    return None


def opcheck_rows(dev: torch.device, dry: bool) -> list:
    """``torch.library.opcheck`` of the offload ops with CUDA tensors (schema, fake kernel, dispatch)."""
    if dry:
        return [row("equal", "opcheck on CUDA (plan, serve, install + twins)", NO_GPU, None,
                    "needs CUDA tensors (dispatch picks the CPU kernel on host tensors)")]
    g = torch.Generator().manual_seed(5)
    B, S, K, PS, F, D, Dr, sbs = 1, 1, 64, 32, 200, 8, 4, 16
    bf = torch.bfloat16
    tk = torch.randint(-1, 130, (B, S, 1, K), generator=g, dtype=torch.int32).to(dev)
    L = torch.tensor([120], dtype=torch.int32, device=dev)
    pid = torch.full((B, PS), -1, dtype=torch.int32, device=dev)
    i2s = torch.full((B, F), -1, dtype=torch.int32, device=dev)
    lru = torch.zeros(B, PS // 16, dtype=torch.int32, device=dev)
    plan, rec, _ = torch.ops.custom.dsa_plan(tk, L, pid, i2s, lru, raw_seq=S)
    fkv, frope = torch.randn(B, F, D, generator=g).to(bf).to(dev), torch.randn(B, F, Dr, generator=g).to(bf).to(dev)
    pkv, prope = torch.zeros(B, PS, D, dtype=bf, device=dev), torch.zeros(B, PS, Dr, dtype=bf, device=dev)
    sel = [torch.zeros(K // sbs, sbs, D, dtype=bf, device=dev), torch.zeros(K // sbs, sbs, Dr, dtype=bf, device=dev)]
    table = torch.arange(K // sbs, dtype=torch.int32, device=dev).view(1, K // sbs)
    kw = dict(raw_seq=S, topk=K, selection_block_size=sbs)
    cases = [
        ("dsa_plan", torch.ops.custom.dsa_plan.default, (tk, L, pid, i2s, lru), {"raw_seq": S}),
        ("dsa_serve", torch.ops.custom.dsa_serve.default, (plan, fkv, frope, pkv, prope, *sel),
         dict(kw, compact_layout=1)),
        ("dsa_serve_functional", torch.ops.custom.dsa_serve_functional.default, (plan, fkv, frope, pkv, prope, *sel),
         dict(kw, compact_layout=1)),
        ("dsa_install", torch.ops.custom.dsa_install.default, (rec, *sel, table, pkv, prope, pid, i2s, lru), kw),
        ("dsa_install_functional", torch.ops.custom.dsa_install_functional.default,
         (rec, *sel, table, pkv, prope, pid, i2s, lru), kw),
        ("dsa_install_sc", torch.ops.offload_ref.dsa_install_sc.default,
         (plan, rec, *sel, table, pkv, prope, pid, i2s, lru), kw),
    ]
    out = []
    for name, op, args, kwargs in cases:
        try:
            res = torch.library.opcheck(op, [a.clone() for a in args], kwargs)
            bad = {k: v for k, v in res.items() if v != "SUCCESS"}
            out.append(row("equal", f"opcheck {name} on CUDA", int(not bad), 1, str(bad) if bad else "", ok=not bad))
        except Exception as e:  # one op's failure must not hide the others
            out.append(row("equal", f"opcheck {name} on CUDA", 0, 1, _err(e), ok=False))
    return out


def section_equal(dev: torch.device, dry: bool, args: Any) -> list:
    rows = []
    geometries = [("small", dict(steps=3)),
                  ("GLM-5 (K 2048, pool 8192, 512 + 64)", dict(steps=1 if dry else 3, B=1, K=2048, PS=8192, F=16384,
                                                                D=512, Dr=64, sbs=128))]
    for label, geo in geometries:
        for sc in (False, True):
            r = op_chain(dev, second_chance=sc, **geo)
            ok = r["mismatch"] is None
            rows.append(row("equal", f"chain {label} ({'second chance' if sc else 'FIFO'}) == CPU twins",
                            int(ok), 1, r["mismatch"] or f"{r['steps']} steps", ok=ok))
    for K, bsz in ((16, 4), (64, 1)):
        try:
            err = gather_check(dev, K, bsz)
        except Exception as e:  # one check's failure must not hide the others
            traceback.print_exc()
            err = _err(e)
        rows.append(row("equal", f"gather K={K} bsz={bsz} == CPU twin", int(err is None), 1, err or "2 steps",
                        ok=err is None))
    err = host_write_check(dev)
    rows.append(row("equal", "host-KV write (pinned) == CPU kernel", int(err is None), 1, err or "", ok=err is None))
    return rows + opcheck_rows(dev, dry)


# ------------------------------------------------------------------------------------ models

@contextlib.contextmanager
def side_stream_delay(cycles: int) -> Iterator[None]:
    """Every install scope starts with ``torch.cuda._sleep(cycles)`` on the side stream (a GPU only: on the
    CPU the stream ops do nothing). A join placed too late shows as a difference in the logits."""
    from offload_passes.lowering.cuda import RUNTIME

    enter = RUNTIME.scope_enter

    def delayed(tag: int) -> None:
        enter(tag)
        if RUNTIME.enabled():
            torch.cuda._sleep(cycles)

    RUNTIME.scope_enter = delayed
    try:
        yield
    finally:
        RUNTIME.scope_enter = enter


def model_check(dev: torch.device, steps: int, preset: str = "tiny", delay: int = 0) -> dict:
    """The recipe model with host KV (on a GPU: place_full_caches) compiled in exe_mode "cuda" against the
    unmodified model, logits step by step; on the CPU (--dry-run) the same flow with host tensors."""
    from offload_passes import models
    from offload_passes.cuda import raise_device_errors

    torch._dynamo.reset()
    base = models.build(preset, enable_offload=True, decode_steps=steps, device=dev)
    comp = models.build(preset, enable_offload=True, decode_steps=steps, device=dev)
    if dev.type == "cuda":
        from offload_passes.cuda import place_full_caches

        place_full_caches(comp.model, dev)
    be = cuda_backend(pool_size=1024)
    r0 = base.driver.run(steps=steps)
    with side_stream_delay(delay):
        r1 = comp.driver.run(steps=steps, step_fn=torch.compile(comp.model, backend=be))
    _sync()
    raise_device_errors()
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(r0.logits, r1.logits))
    return {"max_abs_diff": diff, "steps": steps, "rewritten": bool(be.reports and be.reports[-1]["rewritten"])}


def hf_check(dev: torch.device, steps: int, preset: str, delay: int = 0, ctx: int = 256) -> dict:
    """A Hugging Face model, unmodified (caches on ``dev``) against compiled in exe_mode "cuda" with its
    full caches in pinned host memory (on a GPU), logits step by step."""
    from offload_passes.cuda import raise_device_errors
    from offload_passes.models import hf

    torch._dynamo.reset()
    b = hf.build(preset)
    model = b.model.to(dev)
    ref, _ = _hf_decode(b, model, model, ctx=ctx, steps=steps, dev=dev)
    be = cuda_backend()
    fn = torch.compile(model, backend=be, fullgraph=True, dynamic=False)
    with side_stream_delay(delay):
        got, _ = _hf_decode(b, model, fn, ctx=ctx, steps=steps, dev=dev, host_kv=dev.type == "cuda")
    _sync()
    raise_device_errors()
    diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(ref, got))
    return {"max_abs_diff": diff, "steps": steps, "rewritten": bool(be.reports and be.reports[-1]["rewritten"])}


#: cycles of the deliberate side-stream delay (about 25 ms at 2 GHz: longer than a decode step of these models)
DELAY_CYCLES = 50_000_000


def section_models(dev: torch.device, dry: bool, args: Any) -> list:
    rows = []
    steps = min(args.steps, 2) if dry else args.steps
    where = "host tensors, interpreter" if dry else "host KV pinned"
    runs = [("tiny", 0), ("tiny", DELAY_CYCLES), ("hf-tiny", 0), ("hf-tiny", DELAY_CYCLES)]
    if not dry:
        runs.append(("hf-glm5-attn", 0))
    for preset, delay in runs:
        check = f"{preset} ({'side-stream delay, ' if delay else ''}{where}) == unmodified"
        try:
            r = (model_check if not preset.startswith("hf-") else hf_check)(dev, steps, preset, delay)
            note = f"{r['steps']} steps, rewritten {r['rewritten']}"
            if delay and dry:
                note += "; the delay needs a GPU (the stream ops do nothing on the CPU)"
            rows.append(row("models", check, r["max_abs_diff"], 0, note, ok=r["max_abs_diff"] == 0 and r["rewritten"]))
        except Exception as e:  # one model's failure must not hide the others
            traceback.print_exc()
            rows.append(row("models", check, None, 0, _err(e), ok=False))
    if dry:
        rows.append(row("models", "hf-glm5-attn (host KV pinned) == unmodified", NO_GPU, 0,
                        "GLM-5 attention dims at 256 context: too slow for the CPU dry run"))
    return rows


# ------------------------------------------------------------------------------------ serve

def _serve_inputs(dev: torch.device, B: int, K: int, PS: int, F: int, g: torch.Generator, host: bool) -> dict:
    bf, Dkv, Dr, sbs = torch.bfloat16, 512, 64, 128
    if dev.type == "cpu":  # the dry run: a small payload, same plans
        Dkv, Dr, sbs = 8, 4, 16
    rows = B * K
    full = [torch.randn(B, F, d, generator=g).to(bf) for d in (Dkv, Dr)]
    if host and dev.type == "cuda":
        from offload_passes.cuda import host_pinned

        full = [host_pinned(t) for t in full]
    elif not host:
        full = [t.to(dev) for t in full]
    pool = [torch.randn(B, PS, d, generator=g).to(bf).to(dev) for d in (Dkv, Dr)]
    sel = [torch.empty(rows // sbs, sbs, d, dtype=bf, device=dev) for d in (Dkv, Dr)]
    return dict(full=full, pool=pool, sel=sel, nbytes=rows * (Dkv + Dr) * 2, kw=dict(raw_seq=1, topk=K,
                                                                                     selection_block_size=sbs))


def serve_plans(B: int, K: int, PS: int, F: int, g: torch.Generator) -> dict:
    """Plans of B x K rows: all hits (random pool slots), all misses of sequential rows (one contiguous
    run of the full cache per batch row), all misses of random rows."""
    hits = torch.stack([torch.ones(B * K, dtype=torch.int32),
                        torch.cat([torch.randperm(PS, generator=g)[:K] for _ in range(B)]).to(torch.int32)], 1)
    start = torch.randint(0, F - K, (B,), generator=g)
    seq = torch.cat([torch.arange(K) + s for s in start.tolist()]).to(torch.int32)
    rnd = torch.cat([torch.randperm(F, generator=g)[:K] for _ in range(B)]).to(torch.int32)
    miss = lambda v: torch.stack([torch.full((B * K,), 2, dtype=torch.int32), v], 1)  # noqa: E731
    return {"hits": hits, "misses sequential": miss(seq), "misses random": miss(rnd)}


def section_serve(dev: torch.device, dry: bool, args: Any) -> list:
    from offload_passes.custom_ops.cuda import dsa_serve as CS

    rows = []
    g = torch.Generator().manual_seed(0)
    gpu_configs = [(32, "hits"), (128, "hits"), (32, "misses sequential"), (32, "misses random")]
    name = lambda B, kind: f"serve {kind} B={B} vs {'device copy' if kind == 'hits' else 'host link'}"  # noqa: E731
    goal_of = lambda kind: GOALS["serve_hit_vs_d2d"] if kind == "hits" else GOALS["miss_vs_h2d"]  # noqa: E731
    if dry:  # the correctness part: the Triton kernel == the C++ kernel on each kind of plan (B=2, K=64)
        for kind in ("hits", "misses sequential", "misses random"):
            B, K, PS, F = 2, 64, 64, 256
            x = _serve_inputs(dev, B, K, PS, F, g, host=True)
            plan = serve_plans(B, K, PS, F, g)[kind]
            CS.run(plan, *x["full"], *x["pool"], *x["sel"], compact_layout=1, **x["kw"])
            want = [torch.zeros_like(t) for t in x["sel"]]
            torch.ops.custom.dsa_serve(plan, *x["full"], *x["pool"], *want, compact_layout=1, **x["kw"])
            same = all(_same(a, b) for a, b in zip(want, x["sel"]))
            rows.append(row("serve", f"serve {kind} == CPU twin", int(same), 1, "interpreter, B=2 K=64", ok=same))
        return rows + [timing_row("serve", name(B, kind), None, goal=goal_of(kind), dry=True)
                       for B, kind in gpu_configs]
    K, PS, F = 2048, 8192, 16384
    ceilings: dict = {}
    for B, kind in gpu_configs:
        try:
            f = F if kind != "hits" else K + 8  # hits never read the full caches: keep the host allocation small
            x = _serve_inputs(dev, B, K, PS, f, g, host=True)
            plan = serve_plans(B, K, PS, f, g)[kind].to(dev)
            key = (B, kind == "hits")
            if key not in ceilings:
                src = torch.empty(x["nbytes"], dtype=torch.uint8, device=dev)
                dst = torch.empty_like(src)
                if kind == "hits":
                    ceilings[key] = time_cuda(lambda: dst.copy_(src), args.reps)
                else:
                    hsrc = torch.empty(x["nbytes"], dtype=torch.uint8).pin_memory()
                    ceilings[key] = time_cuda(lambda: dst.copy_(hsrc, non_blocking=True), args.reps)
            t = time_cuda(lambda: CS.run(plan, *x["full"], *x["pool"], *x["sel"], compact_layout=1, **x["kw"]),
                          args.reps)
            rows.append(timing_row("serve", name(B, kind), t, ceilings[key], goal_of(kind), x["nbytes"]))
        except Exception as e:
            traceback.print_exc()
            rows.append(row("serve", name(B, kind), None, None, _err(e), ok=False))
    return rows


# ------------------------------------------------------------------------------------ kernels

def section_kernels(dev: torch.device, dry: bool, args: Any) -> list:
    """Plan, install (FIFO) and second-chance install times; their correctness is the equal section's."""
    from offload_passes.custom_ops.cuda import dsa_install as CI
    from offload_passes.custom_ops.cuda import dsa_install_sc as CSC
    from offload_passes.custom_ops.cuda import dsa_plan as CP

    rows = []
    for B in (32, 128):
        names = [f"dsa_plan B={B} ms", f"dsa_install B={B} ms", f"dsa_install_sc B={B} ms"]
        if dry:
            rows += [row("kernels", n, NO_GPU, None, "correctness: section equal") for n in names]
            continue
        try:
            g = torch.Generator().manual_seed(B)
            K, PS, F, sbs = 2048, 8192, 16384, 128
            L = torch.full((B,), F - 8, dtype=torch.int32, device=dev)
            tk = torch.stack([torch.randperm(F - 16, generator=g)[:K] for _ in range(B)]).to(torch.int32)
            tk = tk.view(B, 1, 1, K).to(dev)
            pid = torch.full((B, PS), -1, dtype=torch.int32, device=dev)
            i2s = torch.full((B, F), -1, dtype=torch.int32, device=dev)
            lru = torch.zeros(B, PS // 16, dtype=torch.int32, device=dev)
            half = tk[..., : K // 2].reshape(B, K // 2).long()  # half the ids already in the pool: hits
            i2s.scatter_(1, half, torch.arange(K // 2, dtype=torch.int32, device=dev).expand(B, -1).contiguous())
            plan, rec, _ = CP.run(tk, L, pid, i2s, lru, raw_seq=1)
            sel = [torch.zeros(B * K // sbs, sbs, d, dtype=torch.bfloat16, device=dev) for d in (512, 64)]
            pool = [torch.zeros(B, PS, d, dtype=torch.bfloat16, device=dev) for d in (512, 64)]
            table = torch.arange(B * K // sbs, dtype=torch.int32, device=dev).view(B, K // sbs)
            kw = dict(raw_seq=1, topk=K, selection_block_size=sbs, metadata_update=0)
            times = [time_cuda(lambda: CP.run(tk, L, pid, i2s, lru, raw_seq=1), args.reps),
                     time_cuda(lambda: CI.run(rec, *sel, table, *pool, pid, i2s, lru, **kw), args.reps),
                     time_cuda(lambda: CSC.run(plan, rec, *sel, table, *pool, pid, i2s, lru, **kw), args.reps)]
            rows += [timing_row("kernels", n, t, note="ms (metadata_update=0: same state every rep)")
                     for n, t in zip(names, times)]
        except Exception as e:
            traceback.print_exc()
            rows += [row("kernels", n, None, None, _err(e), ok=False) for n in names]
    return rows


# ------------------------------------------------------------------------------------ decode

def bench_decode(contexts: Sequence[int], pools: Sequence[int], steps: int, dev: torch.device) -> list:
    from offload_passes.backend import make_offload_backend
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


def glm5_attn_kv_fraction(context: int, pool: int) -> float:
    """Device KV bytes of ``hf-glm5-attn`` with the offload over its dense KV, by arithmetic: 2 layers of
    512 + 64, one indexer layer of 128, top-k 2048 (models/configs/hf-glm5-attn.yaml)."""
    d = dense_kv_bytes(2, context, 512, 64, 128, 1)
    o = offload_kv_bytes(2, context, 512, 64, 128, 1, pool, 2048)
    return ratio(o["total"], d["total"])


def section_decode(dev: torch.device, dry: bool, args: Any) -> list:
    rows = []
    contexts = [int(x) for x in args.contexts.split(",") if x]
    pools = [int(x) for x in args.pools.split(",") if x]
    for ctx in contexts:
        for pool in pools:
            frac = glm5_attn_kv_fraction(ctx, pool)
            goal = GOALS["kv_fraction_64k_8k"] if (ctx, pool) == (65536, 8192) else None
            rows.append(row("decode", f"device KV fraction @ {ctx} pool {pool} (arithmetic)", frac, goal,
                            "pools + selection + indexer over latent + rope + indexer"))
    if dry:
        for ctx in contexts:
            for name in ["dense", "sparse"] + [f"offload pool {p}" for p in pools]:
                rows.append(row("decode", f"decode {name} @ {ctx} ms/step", NO_GPU, None, NO_GPU))
        return rows
    for r in bench_decode(contexts, pools, args.steps, dev):
        note = r.get("error") or (f"device KV {_cell(r.get('device_kv_mib'))} MiB, host read/step "
                                  f"{_cell(r.get('host_mib_per_step'))} MiB")
        rows.append(row("decode", f"decode {r['variant']} @ {r['context']} ms/step", r.get("ms_per_step"), None, note,
                        ok=False if r.get("error") else None))
        if r.get("kv_fraction") is not None:
            rows.append(row("decode", f"device KV fraction measured @ {r['context']} {r['variant']}",
                            r["kv_fraction"], r.get("goal"), "measured device bytes over the dense run's"))
    return rows


# ------------------------------------------------------------------------------------ graphs

def section_graphs(dev: torch.device, dry: bool, args: Any) -> list:
    """The offload step of ``hf-glm5-attn`` at 16K (pool 8192) eagerly and as one captured CUDA graph."""
    checks = ("CUDA graph replay vs eager (ms/step ratio)", "CUDA graph replay == eager (max abs diff)")
    if dry:
        return [row("graphs", c, NO_GPU, None, "needs torch.cuda.CUDAGraph; the capture check and the replay "
                    "logic run on CPU in tests/cuda/test_cuda_graphs.py") for c in checks]
    from offload_passes.models import hf

    ctx, steps = 16384, max(args.steps, 4)
    b = hf.build("hf-glm5-attn")
    model = b.model.to(dev)
    out: dict = {}
    note = ""
    for host_kv in (True, False):
        try:
            for graphs in (False, True):
                torch._dynamo.reset()
                fn = torch.compile(model, backend=cuda_backend(pool_size=8192, cuda_graphs=graphs), fullgraph=True,
                                   dynamic=False)
                times: list = []
                logits, _ = _hf_decode(b, model, fn, ctx, steps, dev, timings=times, host_kv=host_kv)
                out[graphs] = (statistics.median(times[2:]), logits)  # warm-up and capture calls left out
            note = "host KV" if host_kv else note + "; device KV"
            break
        except Exception as e:  # a refused capture (host copies of HF's cache update): say why, try device KV
            traceback.print_exc()
            note = f"host KV refused: {_err(e)}"
    if len(out) < 2:
        return [row("graphs", c, None, None, note, ok=False) for c in checks]
    (t_eager, l_eager), (t_graph, l_graph) = out[False], out[True]
    diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(l_eager, l_graph))
    return [row("graphs", checks[0], ratio(t_eager, t_graph), None,
                f"{note}; eager {t_eager * 1e3:.3g} ms, replay {t_graph * 1e3:.3g} ms"),
            row("graphs", checks[1], diff, 0, note, ok=diff == 0)]


RUNNERS = {"equal": section_equal, "models": section_models, "serve": section_serve, "kernels": section_kernels,
           "decode": section_decode, "graphs": section_graphs}


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


#: the interpreter runs every program in Python: the dry run's own limits (CPU seconds, not an H200's)
DRY_LIMITS = {"equal": 400, "models": 400, "serve": 60, "kernels": 10, "decode": 10, "graphs": 10}


def run_sections(sections: Sequence[str], dev: torch.device, dry: bool, args: Any, results: dict) -> dict:
    """Run ``sections`` in order into ``results`` (rows, or ``{"error"}``), with their seconds."""
    for name in SECTIONS:
        if name not in sections:
            continue
        limit = DRY_LIMITS[name] if dry else SECTIONS[name].limit_s
        res, err, secs = run_section(name, lambda: RUNNERS[name](dev, dry, args), limit)
        results[name] = res if res is not None else {"error": err}
        results.setdefault("section_s", {})[name] = secs
    return results


def parse(argv: Optional[Sequence[str]]) -> Any:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--pools", default=",".join(map(str, POOLS)))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default="gpu_check.json", help="where the results go (JSON)")
    ap.add_argument("--merge", action="store_true",
                    help="partial rerun: keep the other sections' results already in --json")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: every correctness part on the CPU under Triton's interpreter, timing cells 'no GPU'")
    args = ap.parse_args(argv)
    args.section_list = [s for s in args.sections.split(",") if s]
    bad = [s for s in args.section_list if s not in SECTIONS]
    if bad:
        raise ValueError(f"--sections: unknown {bad}; known: {list(SECTIONS)}")
    [int(x) for x in (args.contexts + "," + args.pools).split(",") if x]  # noqa: B018  (ValueError on bad input)
    if args.steps < 1 or args.reps < 1:
        raise ValueError(f"--steps and --reps must be >= 1, got {args.steps} and {args.reps}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parse(argv)
    except ValueError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    import importlib.util

    if args.dry_run:
        if importlib.util.find_spec("triton") is None:
            print("gpu_check: --dry-run needs the `triton` package (pip install 'offload_passes[cuda]')",
                  file=sys.stderr)
            return 2
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("gpu_check: --dry-run: triton was imported before TRITON_INTERPRET=1 could be set", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported: the kernels run on CPU tensors
        dev = torch.device("cpu")
        results: dict = {"device": "cpu (dry run, Triton interpreter)", "dry_run": True}
    else:
        if not torch.cuda.is_available():
            print(f"gpu_check: no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False); "
                  "this check needs a GPU", file=sys.stderr)
            return 2
        if importlib.util.find_spec("triton") is None:
            print("gpu_check: the Triton kernels need the `triton` package (pip install 'offload_passes[cuda]')",
                  file=sys.stderr)
            return 2
        dev = torch.device("cuda", torch.cuda.current_device())
        results = {"device": torch.cuda.get_device_name(dev)}
    import offload_passes  # noqa: F401  (registers the ops and, with CUDA + triton, their CUDA kernels)

    results.update(torch=torch.__version__, steps=args.steps, date=time.strftime("%Y-%m-%d", time.gmtime()))
    if args.merge and os.path.exists(args.json):  # a partial rerun: the other sections' results are kept
        with open(args.json) as f:
            results = {**json.load(f), **results}
    t0 = time.perf_counter()
    run_sections(args.section_list, dev, args.dry_run, args, results)
    results["wall_s"] = time.perf_counter() - t0
    rows = summary_rows(results)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1, default=str)
    kind = "--dry-run" if args.dry_run else f"on {results['device']}"
    print(f"gpu_check {kind} ({results['wall_s']:.0f} s), JSON: {args.json}")
    print(format_table(rows, COLUMNS))
    return 1 if failed(rows) else 0


if __name__ == "__main__":
    sys.exit(main())

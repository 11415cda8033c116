"""GPU check of the CUDA path: one command for a lent H200, at most 8 minutes (Triton's first compiles included),
a Markdown table and a JSON file.

    python benchmarks/gpu_check.py                             # every section, table last, gpu_check.json
    python benchmarks/gpu_check.py --sections serve --merge    # partial rerun: one section, keep the others
    python benchmarks/gpu_check.py --dry-run                   # no GPU: every correctness part on the CPU

Each section runs in **its own process** under its own wall-clock limit (:data:`SECTIONS`): a fatal CUDA error
(an illegal address loses the context) or a hang ends that process only, its row says why, and the next
section starts on a fresh context. Section data is generated on the device (``torch.Generator(device=...)``);
the CPU twins of the ``equal`` section get copies of it.

* ``equal``: every op's Triton kernel on CUDA equal to its CPU twin, bit for bit: chained plan / serve / install
  steps with adversarial top-k, FIFO and second chance, at a small and at the GLM-5 geometry; the baseline
  gather (both ledger paths); the recipe's and the HF cache's host-KV writes into pinned caches;
  ``torch.library.opcheck`` with CUDA tensors.
* ``models``: the recipe ``tiny`` model with its full caches pinned on the host, compiled in ``exe_mode="cuda"``,
  against the unmodified model (0 expected); ``hf-tiny`` / ``hf-glm5-attn`` with host KV
  (``offload_passes.hf_cache.HostStaticCache``) against the same compiled model on device KV (0 expected) and
  against the unmodified model (the bf16 bound); both also with a delay on the install side stream
  (``torch.cuda._sleep`` at every scope entry: a missing join shows as a difference).
* ``serve``: ``dsa_serve`` hits against a device-to-device copy of the same bytes, misses (sequential and
  random rows) from pinned host memory against a host-to-device copy of the same bytes, at B = 1, 32, 128.
* ``kernels``: ``dsa_plan`` and each replacement policy's install (``metadata_update`` 0 and 1) at B = 1, 32, 128.
* ``graphs``: one CUDA graph per decode step on both paths: the recipe ``tiny`` model and ``hf-glm5-attn`` at 16K,
  host KV, compiled with ``mode="reduce-overhead"`` (``offload_passes/lowering/cuda_graphs.py``) against the same
  compile without it: ms per step, logits equal, the decode graph's capture check.
* ``capacity``: a GLM-5-shaped attention stack (:class:`StackGeo`) at 64K and 128K context: the largest batch
  that fits one HBM budget with dense device KV and with the offload (host budget: what this machine pins),
  the measured peak device memory, tokens/s of each at its batch and the measured pool hit rate; the
  offloaded stack equals the dense one bit for bit at a small batch.

Timings (:func:`time_cuda`): device time per call from CUDA-graph replays (the call captured ``reps`` times,
timed by CUDA events), else from launches queued behind a device sleep; the host's time per call (the op's
Python wrapper and the launch: the launch overhead) is its own column, never mixed into the device figure.

Goals (docs/cuda.md; not asserted): equal rows exact; serve >= 0.8x the device copy for hits; misses >= 0.7x
the host-link copy. Without CUDA the script exits 2 with one line on stderr, except ``--dry-run``, which runs
every section's correctness part on CPU tensors (Triton's interpreter; the models on the CPU) and writes
"no GPU" in every timing cell. Tested on CPU: ``tests/cuda/test_gpu_check.py``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
if "--dry-run" in sys.argv[1:] and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before torch: torch._inductor may import triton

import torch  # noqa: E402

BATCHES = (1, 32, 128)
CAPACITY_CONTEXTS = (65536, 131072)
GOALS = {"serve_hit_vs_d2d": 0.8, "miss_vs_h2d": 0.7}
#: offload-demo's bf16 bound (docs/hf.md): the rewritten bf16 model against the unmodified one, relative to the
#: largest logit (the rewrite reduces over K rows instead of T)
BF16_BOUND = 2e-2
NO_GPU = "no GPU"
COLUMNS = ("section", "check", "value", "goal", "host_us", "note")


class Section(NamedTuple):
    """One part of the check: its wall-clock limit (its own process: start, imports, Triton's compiles of what it
    launches, its work) and the estimate it was sized by (seconds on an H200, by arithmetic from the work
    listed in ``why``: not measured)."""

    name: str
    limit_s: int
    estimate_s: int
    why: str


#: the sections, in run order; limits 470 s together (under 8 minutes), estimates 315 s
SECTIONS = {s.name: s for s in (
    Section("equal", 90, 55, "process start 10 s; about 30 kernel compiles of 1-1.5 s; chains at two geometries x 2 "
            "policies, gather, 2 host writes, 6 opchecks"),
    Section("models", 100, 70, "process start 10 s; 7 compiles (tiny x 2, hf-tiny x 3, hf-glm5-attn x 2) of 5-8 s, "
            "4 decode steps each; the recipe ops on the device"),
    Section("serve", 45, 25, "process start 10 s; 2.4 GB pinned host cache; 9 serve cases and their ceilings, "
            "each a captured graph of 20 calls"),
    Section("kernels", 35, 20, "process start 10 s; plan and 2 policies x 2 installs at 3 batch sizes, captured"),
    Section("graphs", 60, 45, "process start 10 s; 2 compiles of tiny and 2 of hf-glm5-attn at 16K (op by op, "
            "captured), 8 steps each"),
    Section("capacity", 140, 100, "process start 10 s; up to 64 GiB pinned and filled from the device twice; "
            "dense and offloaded stacks at 2 contexts, 12 steps each, captured"),
)}
#: the dry run's limits: CPU seconds (the interpreter runs every program in Python; the models compile on 2 cores)
DRY_LIMITS = {"equal": 500, "models": 600, "serve": 120, "kernels": 30, "graphs": 300, "capacity": 300}


# ------------------------------------------------------------------------------------ pure parts

def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    """``num / den``, None when either is missing or ``den`` is 0."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def gbps(nbytes: int, seconds: Optional[float]) -> Optional[float]:
    return None if not seconds else nbytes / seconds / 1e9


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


class Timing(NamedTuple):
    """One call's time: on the device (``how``: "graph replay" or "queued launches") and on the host (the
    Python wrapper and the launch: the launch overhead)."""

    device_s: Optional[float]
    host_s: Optional[float]
    how: str


def timing_row(section: str, check: str, t: Optional[Timing], ref: Optional[Timing] = None,
               goal: Optional[float] = None, nbytes: Optional[int] = None, dry: bool = False, note: str = "") -> dict:
    """A timing line: with a ceiling ``ref`` the value is ``ref / t`` (the fraction of the ceiling reached), else
    device ms per call; ``host_us`` is the host's time per call."""
    if dry or t is None:
        return row(section, check, NO_GPU, goal, NO_GPU, host_us=NO_GPU)
    if ref is not None:
        value = ratio(ref.device_s, t.device_s)
        if nbytes:
            rate = f"{_cell(gbps(nbytes, t.device_s))} GB/s vs {_cell(gbps(nbytes, ref.device_s))} GB/s"
            note = f"{note}; {rate}" if note else rate
    else:
        value = None if t.device_s is None else t.device_s * 1e3
        note = f"{note}; ms on the device" if note else "ms on the device"
    note = f"{note} ({t.how})"
    return row(section, check, value, goal, note, host_us=None if t.host_s is None else t.host_s * 1e6)


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


# ------------------------------------------------------------------------------------ capacity arithmetic

@dataclass(frozen=True)
class StackGeo:
    """A GLM-5-shaped attention stack: GLM-5's per-layer shapes (latent 512 + rope 64 in bf16, 64 heads, top-k
    2048, a lightning indexer of 32 heads x 128 shared by a group of 4 layers: IndexShare), ``layers`` of them.
    ``pool`` rows per layer and batch row when offloaded; selection blocks of ``sbs`` rows."""

    layers: int = 8
    group: int = 4
    heads: int = 64
    dkv: int = 512
    dr: int = 64
    topk: int = 2048
    idx_heads: int = 32
    idx_dim: int = 128
    pool: int = 8192
    sbs: int = 128
    elem: int = 2

    def __post_init__(self) -> None:
        if self.layers < 1 or self.layers % self.group:
            raise ValueError(f"StackGeo: layers must be a positive multiple of group={self.group}, got {self.layers}")

    @property
    def groups(self) -> int:
        return self.layers // self.group

    @property
    def row(self) -> int:
        """Bytes of one token's latent + rope row of one layer."""
        return (self.dkv + self.dr) * self.elem


#: the check's stack (8 layers: 2 IndexShare groups) and the dry run's (interpreter-sized widths)
GLM5_STACK = StackGeo()
DRY_STACK = StackGeo(layers=8, heads=4, dkv=8, dr=4, topk=64, idx_heads=2, idx_dim=8, pool=64, sbs=16)


def stack_bytes(geo: StackGeo, T: int) -> dict:
    """Bytes per batch row of the stack over ``T`` cached tokens: ``dense`` (device KV + indexer keys + the
    step's transient), ``offload`` (device: pools, selection buffers, pool metadata, indexer keys, transient),
    ``host`` (the offloaded full caches), ``transient`` (what one step allocates per row: the indexer's scores
    and top-k, the attention's rows and probabilities, the plan)."""
    idx = geo.groups * T * geo.idx_dim * geo.elem
    # one step's intermediates (the indexer's scores [heads, T] and their weighted sum in fp32, the top-k; a layer's
    # K rows, its fp32 scores and probabilities, the plan; the layers' outputs), twice: the eager step's and the
    # captured step's (its own memory pool)
    transient = 2 * (T * (geo.idx_heads * geo.elem + 12) + geo.topk * (geo.row + geo.heads * 4 * 2 + 16)
                     + 2 * geo.layers * geo.heads * geo.dkv * geo.elem)
    dense = geo.layers * T * geo.row + idx + transient
    meta = geo.groups * (geo.pool * 4 + T * 4 + geo.pool // 16 * 4)
    offload = geo.layers * (geo.pool + geo.topk) * geo.row + meta + idx + transient
    return {"dense": dense, "offload": offload, "host": geo.layers * T * geo.row, "transient": transient}


def capacity_batches(geo: StackGeo, T: int, hbm_bytes: int, host_bytes: int) -> dict:
    """The largest batch of the stack at ``T`` tokens that fits ``hbm_bytes`` of device memory, dense and
    offloaded; the offloaded one also within ``host_bytes`` of pinned host memory (``binds``: which bound)."""
    b = stack_bytes(geo, T)
    dense = hbm_bytes // b["dense"]
    by_hbm, by_host = hbm_bytes // b["offload"], host_bytes // b["host"]
    return {"dense": int(dense), "offload": int(min(by_hbm, by_host)), "offload_by_hbm": int(by_hbm),
            "offload_by_host": int(by_host), "binds": "host" if by_host < by_hbm else "hbm", "bytes": b}


# ------------------------------------------------------------------------------------ device helpers

def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _gen(dev: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=dev).manual_seed(seed)


def randn(shape: Sequence[int], dev: torch.device, g: torch.Generator, dtype: torch.dtype = torch.bfloat16
          ) -> torch.Tensor:
    """Normal data generated on ``dev`` (the device's generator: no single-threaded host fill)."""
    return torch.randn(tuple(shape), generator=g, device=dev, dtype=torch.float32).to(dtype)


def time_cuda(fn: Callable[[], Any], reps: int = 20, warmup: int = 3) -> Timing:
    """``fn``'s time per call: on the device from a CUDA graph of ``reps`` calls replayed (CUDA events), or, when
    ``fn`` cannot be captured, from ``reps`` launches queued while the device sleeps (so they run back to back);
    on the host from ``reps`` eager calls without synchronisation (the launch overhead)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # torch's recipe: one call on the capture stream before capturing
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        return Timing(a.elapsed_time(b) / 1e3 / reps, host, "graph replay")
    except Exception as e:  # not capturable: queue the launches behind a sleep long enough to cover them
        print(f"gpu_check: capture refused ({_err(e)}); timing queued launches", file=sys.stderr)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(max(host * reps * 1.5, 1e-3) * 2e9))  # ~2 GHz: the host queues while it sleeps
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        return Timing(a.elapsed_time(b) / 1e3 / reps, host, "queued launches")


def cuda_backend(**opts: Any):
    """The offload backend in exe_mode "cuda"."""
    from offload_passes import make_offload_backend

    return make_offload_backend(exe_mode="cuda", **opts)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


# ------------------------------------------------------------------------------------ equal

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()]) if t.is_floating_point() else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a.cpu()), _bits(b.cpu()))


def _twin(t: torch.Tensor) -> torch.Tensor:
    """A separate host copy of ``t`` for the CPU twin (``Tensor.cpu`` returns ``t`` itself on the CPU)."""
    return t.clone() if t.device.type == "cpu" else t.cpu()


def op_chain(dev: torch.device, steps: int = 3, B: int = 2, S: int = 1, K: int = 64, PS: int = 32, F: int = 200,
             D: int = 8, Dr: int = 4, sbs: int = 16, second_chance: bool = False, seed: int = 0) -> dict:
    """``steps`` chained plan -> serve -> install steps, the Triton kernels on ``dev`` against the CPU twins (the C++
    kernels) on host copies of the same state; adversarial top-k: -1 sentinels, duplicates, ids beyond the length.
    Returns ``{"steps", "mismatch": first differing output or None}``."""
    from offload_passes.custom_ops.cuda import dsa_install as CI
    from offload_passes.custom_ops.cuda import dsa_install_sc as CSC
    from offload_passes.custom_ops.cuda import dsa_plan as CP
    from offload_passes.custom_ops.cuda import dsa_serve as CS

    g = _gen(dev, seed)
    bf = torch.bfloat16
    on = dict(pid=torch.full((B, PS), -1, dtype=torch.int32, device=dev),
              i2s=torch.full((B, F), -1, dtype=torch.int32, device=dev),
              lru=torch.zeros(B, PS // 16, dtype=torch.int32, device=dev),
              pkv=torch.zeros(B, PS, D, dtype=bf, device=dev), prope=torch.zeros(B, PS, Dr, dtype=bf, device=dev))
    host = {k: _twin(v) for k, v in on.items()}
    fkv_d, frope_d = randn((B, F, D), dev, g), randn((B, F, Dr), dev, g)
    full_kv, full_rope = _twin(fkv_d), _twin(frope_d)
    rows = B * S * K
    table = torch.arange(rows // sbs, dtype=torch.int32).view(B * S, K // sbs)
    kw = dict(raw_seq=S, topk=K, selection_block_size=sbs)
    for step in range(steps):
        L = torch.full((B,), 3 * F // 5 + step * (F // 20), dtype=torch.int32)
        tk_d = torch.randint(-1, 3 * F // 5 + F // 10 + step * (F // 20), (B, S, 1, K), generator=g, device=dev,
                             dtype=torch.int32)
        tk_d[..., K // 2:] = tk_d[..., :K // 2]  # duplicates
        tk = _twin(tk_d)
        plan, rec, act = torch.ops.custom.dsa_plan(tk, L, host["pid"], host["i2s"], host["lru"], raw_seq=S)
        plan_d, rec_d, act_d = CP.run(tk_d, L.to(dev), on["pid"], on["i2s"], on["lru"], raw_seq=S)
        for name, a, b in (("plan", plan, plan_d), ("records", rec, rec_d), ("actual_seq", act, act_d)):
            if not _same(a, b):
                return {"steps": step, "mismatch": f"step {step}: dsa_plan {name}"}
        sel = [torch.zeros(rows // sbs, sbs, D, dtype=bf), torch.zeros(rows // sbs, sbs, Dr, dtype=bf)]
        sel_d = [t.to(dev) if dev.type != "cpu" else t.clone() for t in sel]
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


def _pinned_like(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host copy of ``t``: pinned when ``dev`` is a CUDA device (the production case: a pinned cache)."""
    out = _twin(t)
    if dev.type == "cuda":
        from offload_passes.cuda import host_pinned

        out = host_pinned(out)
    return out


def _write_check(dev: torch.device, seed: int, op: Any, run: Callable, caches: Sequence[tuple], n_index: int,
                 n: int, rows: Sequence[tuple]) -> bool:
    """A cache-write kernel storing ``rows`` (on ``dev``) at ``n`` distinct indices of ``[0, n_index)`` into pinned
    caches (on a CUDA device), against the op's CPU kernel on host copies of the same data."""
    g = _gen(dev, seed)
    cache = [randn(s, dev, g) for s in caches]
    idx = torch.randperm(n_index, generator=g, device=dev)[:n]
    new = [randn(s, dev, g) for s in rows]
    ref = [_twin(t) for t in cache]
    op(*ref, _twin(idx), *[_twin(t) for t in new])
    dst = [_pinned_like(t, dev) for t in cache]
    run(*dst, idx, *new)
    _sync()
    return all(_same(a, b) for a, b in zip(ref, dst))


def host_write_check(dev: torch.device) -> Optional[str]:
    """The recipe's host-KV write kernel (pinned ``[blocks, BS, 1, D]`` caches, device rows) against the CPU kernel."""
    from offload_passes.custom_ops.cuda import cache_write as CW

    ok = _write_check(dev, 1, torch.ops.offload_ref.npu_mla_prolog_cache_write_, CW.run,
                      [(8, 16, 1, 512), (8, 16, 1, 64)], 128, 40, [(40, 512), (40, 64)])
    return None if ok else "host write differs from the CPU kernel"


def static_write_check(dev: torch.device) -> Optional[str]:
    """The HF host-KV cache's write kernel (``offload_ref::static_cache_write_``: a pinned ``[B, 1, T, D]`` cache,
    device rows at distinct positions) against the CPU kernel (``index_copy_``)."""
    from offload_passes.custom_ops.cuda import static_cache_write as SW

    ok = _write_check(dev, 2, torch.ops.offload_ref.static_cache_write_, SW.run, [(3, 1, 300, 512), (3, 1, 300, 64)],
                      300, 17, [(3, 1, 17, 512), (3, 1, 17, 64)])
    return None if ok else "HF cache write differs from index_copy_"


def gather_check(dev: torch.device, K: int, bsz: int, seed: int = 3) -> Optional[str]:
    """The baseline gather's Triton kernels against the C++ kernel, two chained steps (the second reuses the
    first step's ledger); None when equal, else what differs."""
    from offload_passes.custom_ops.cuda import npu_gather_selection_kv_cache as CG

    g = _gen(dev, seed)
    B, S, D, Dr = 2, 2, 8, 4
    SBS = FBS = 16 * bsz if bsz > 1 else 16
    cap = 3 * K * bsz + 16 * bsz
    fblk = (cap + FBS - 1) // FBS
    full_kv, full_rope = randn((B * fblk, FBS, D), dev, g), randn((B * fblk, FBS, Dr), dev, g)
    fbt = torch.randperm(B * fblk, generator=g, device=dev).to(torch.int32).view(B, fblk)
    sblk = (K * bsz + SBS - 1) // SBS
    sbt = torch.arange(B * S * sblk, dtype=torch.int32).view(B * S, sblk)
    state = [torch.zeros(B * S * sblk, SBS, d, dtype=torch.bfloat16) for d in (Dr, D)]
    state += [sbt, torch.full((B, S, 1, K + 1), -1, dtype=torch.int32)]  # the ledger, BSND, empty
    mine = [t.to(dev) if dev.type != "cpu" else t.clone() for t in state]
    L = torch.tensor([2 * K * bsz + 5, K * bsz // 2 + 3], dtype=torch.int32)
    qs = torch.full((B,), S, dtype=torch.int32)
    for step in range(2):
        blocks = (int(L.max()) + bsz - 1) // bsz + 2
        tk = torch.randint(-1, blocks, (B, S, 1, K), generator=g, device=dev, dtype=torch.int32)
        tk[..., K // 2:] = tk[..., :K // 2].flip(-1)  # duplicates
        host = (*state, _twin(tk), _twin(full_rope), _twin(full_kv), _twin(fbt), L, qs)
        act = torch.ops.custom.npu_gather_selection_kv_cache(*host, selection_topk_block_size=bsz)
        act_d = CG.run(*mine, tk, full_rope, full_kv, fbt, L.to(dev), qs.to(dev), bsz)
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
        return [row("equal", "opcheck on CUDA (plan, serve, install + twins, SC, HF write)", NO_GPU, None,
                    "needs CUDA tensors (dispatch picks the CPU kernel on host tensors)")]
    g = _gen(dev, 5)
    B, S, K, PS, F, D, Dr, sbs = 1, 1, 64, 32, 200, 8, 4, 16
    tk = torch.randint(-1, 130, (B, S, 1, K), generator=g, device=dev, dtype=torch.int32)
    L = torch.tensor([120], dtype=torch.int32, device=dev)
    pid = torch.full((B, PS), -1, dtype=torch.int32, device=dev)
    i2s = torch.full((B, F), -1, dtype=torch.int32, device=dev)
    lru = torch.zeros(B, PS // 16, dtype=torch.int32, device=dev)
    plan, rec, _ = torch.ops.custom.dsa_plan(tk, L, pid, i2s, lru, raw_seq=S)
    fkv, frope = randn((B, F, D), dev, g), randn((B, F, Dr), dev, g)
    pkv, prope = torch.zeros(B, PS, D, dtype=torch.bfloat16, device=dev), torch.zeros(B, PS, Dr, dtype=torch.bfloat16,
                                                                                        device=dev)
    sel = [torch.zeros(K // sbs, sbs, D, dtype=torch.bfloat16, device=dev),
           torch.zeros(K // sbs, sbs, Dr, dtype=torch.bfloat16, device=dev)]
    table = torch.arange(K // sbs, dtype=torch.int32, device=dev).view(1, K // sbs)
    kw = dict(raw_seq=S, topk=K, selection_block_size=sbs)
    keys, values = randn((2, 1, 40, D), dev, g), randn((2, 1, 40, Dr), dev, g)
    pos = torch.tensor([5, 9], device=dev)
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
        ("static_cache_write_", torch.ops.offload_ref.static_cache_write_.default,
         (keys, values, pos, randn((2, 1, 2, D), dev, g), randn((2, 1, 2, Dr), dev, g)), {}),
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


def _verdict(section: str, check: str, fn: Callable[[], Optional[str]], note: str = "") -> dict:
    """A check returning None (equal) or what differs, as a row; an exception is a failed row, not a crash."""
    try:
        err = fn()
    except Exception as e:  # one check's failure must not hide the others
        traceback.print_exc()
        err = _err(e)
    return row(section, check, int(err is None), 1, err or note, ok=err is None)


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
        rows.append(_verdict("equal", f"gather K={K} bsz={bsz} == CPU twin", lambda: gather_check(dev, K, bsz),
                             "2 steps"))
    rows.append(_verdict("equal", "host-KV write (pinned) == CPU kernel", lambda: host_write_check(dev)))
    rows.append(_verdict("equal", "HF host-KV write (pinned) == index_copy_", lambda: static_write_check(dev)))
    return rows + opcheck_rows(dev, dry)


# ------------------------------------------------------------------------------------ models

@contextlib.contextmanager
def side_stream_delay(cycles: int) -> Iterator[None]:
    """Every install scope starts with ``torch.cuda._sleep(cycles)`` on the side stream (a GPU only: on the CPU the
    stream ops do nothing). A join placed too late shows as a difference in the logits."""
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


#: cycles of the deliberate side-stream delay (about 25 ms at 2 GHz: longer than a decode step of these models)
DELAY_CYCLES = 50_000_000


def model_check(dev: torch.device, steps: int, delay: int = 0) -> dict:
    """The recipe ``tiny`` model with host KV (on a GPU: place_full_caches) compiled in exe_mode "cuda" against the
    unmodified model, logits step by step; on the CPU (--dry-run) the same flow with host tensors."""
    from offload_passes import models
    from offload_passes.cuda import raise_device_errors

    torch._dynamo.reset()
    base = models.build("tiny", enable_offload=True, decode_steps=steps, device=dev)
    comp = models.build("tiny", enable_offload=True, decode_steps=steps, device=dev)
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


def fill_context(model: Any, cache: Any, ids: torch.Tensor, ctx: int, dev: torch.device, seed: int = 0) -> None:
    """Make ``cache`` hold ``ctx`` tokens without a dense prefill: a one-token prefill (eager) allocates what is
    lazy, then rows ``[0, ctx)`` of every latent / rope / indexer cache get random rows generated on ``dev`` and
    the counters say ``ctx``. A host cache's rows go through its write op (stream-ordered stores through the
    pinned address), a device cache's with ``copy_``."""
    from offload_passes.hf_cache import HostIndexedLayer

    g = _gen(dev, seed)
    with torch.no_grad():
        model(ids[:, :1], past_key_values=cache, use_cache=True)
        for layer in cache.layers:
            if isinstance(layer, HostIndexedLayer):
                k, v = layer.keys, layer.values
                pos = torch.arange(ctx, device=dev)
                torch.ops.offload_ref.static_cache_write_(k, v, pos, randn(k[:, :, :ctx].shape, dev, g, k.dtype),
                                                          randn(v[:, :, :ctx].shape, dev, g, v.dtype))
            else:
                for t in (layer.keys, layer.values):
                    t.narrow(2, 0, ctx).copy_(randn(t.narrow(2, 0, ctx).shape, dev, g, t.dtype))
            ik = getattr(layer, "indexer_keys", None)
            if ik is not None:
                ik.narrow(1, 0, ctx).copy_(randn(ik.narrow(1, 0, ctx).shape, dev, g, ik.dtype))
            for name in ("cumulative_length", "indexer_cumulative_length"):
                c = getattr(layer, name, None)
                if isinstance(c, torch.Tensor):
                    c.fill_(ctx)


def hf_logits(b: Any, model: Any, fn: Callable, host_kv: bool, ctx: int, steps: int, dev: torch.device,
              timings: Optional[list] = None) -> list:
    """``steps`` decode steps of ``fn`` after a synthetic context of ``ctx`` tokens (B = 1): a ``HostStaticCache``
    (host KV) or transformers' ``StaticCache`` (device KV). ``timings``: seconds per step (CUDA events)."""
    import transformers as tf

    from offload_passes.hf_cache import HostStaticCache

    n = ctx + steps + 2
    dtype = next(model.parameters()).dtype
    cache = (HostStaticCache(b.config, max_cache_len=n, batch_size=1, device=dev, dtype=dtype) if host_kv
             else tf.StaticCache(config=b.config, max_cache_len=n))
    ids = torch.randint(0, b.config.vocab_size, (1, n), generator=_gen(dev, 7), device=dev)
    fill_context(model, cache, ids, ctx, dev)
    out = []
    with torch.no_grad():
        for s in range(steps):
            pos = torch.full((1, 1), ctx + s, dtype=torch.long, device=dev)
            if timings is not None and dev.type == "cuda":
                a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            res = fn(ids[:, ctx + s:ctx + s + 1], past_key_values=cache, use_cache=True, position_ids=pos)
            if timings is not None and dev.type == "cuda":
                e.record()
                e.synchronize()
                timings.append(a.elapsed_time(e) / 1e3)
            out.append(res.logits.detach().clone())
    return out


def _max_diff(a: list, b: list, relative: bool = False) -> float:
    d = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))
    return d / max(float(y.float().abs().max()) for y in b) if relative else d


def hf_check(dev: torch.device, steps: int, preset: str, ctx: int = 256) -> list:
    """``preset`` with host KV compiled in exe_mode "cuda": against the same compiled model on device KV (0: the
    KV's place changes nothing), against the unmodified model (the bf16 bound), and with a side-stream delay
    against without (0: the joins hold)."""
    from offload_passes.cuda import raise_device_errors
    from offload_passes.models import hf

    b = hf.build(preset)
    model = b.model.to(dev)
    where = "host tensors" if dev.type == "cpu" else "host KV pinned"
    ref = hf_logits(b, model, model, False, ctx, steps, dev)
    runs = {}
    for name, host_kv, delay in (("device", False, 0), ("host", True, 0), ("delay", True, DELAY_CYCLES)):
        torch._dynamo.reset()
        be = cuda_backend()
        fn = torch.compile(model, backend=be, fullgraph=True, dynamic=False)
        with side_stream_delay(delay):
            runs[name] = hf_logits(b, model, fn, host_kv, ctx, steps, dev)
        _sync()
        raise_device_errors()
        rep = be.reports[-1] if be.reports else {}
        runs[name + "_offload"] = bool(rep.get("rewritten") and rep.get("hf", {}).get("offload"))
    note = f"{steps} steps at {ctx} tokens, offloaded {runs['host_offload']}"
    rel = _max_diff(runs["host"], ref, relative=True)
    d_dev, d_delay = _max_diff(runs["host"], runs["device"]), _max_diff(runs["delay"], runs["host"])
    delay_note = note + ("; the delay needs a GPU (the stream ops do nothing on the CPU)" if dev.type == "cpu" else "")
    return [row("models", f"{preset} host KV ({where}) == device KV, compiled", d_dev, 0, note,
                ok=d_dev == 0 and runs["host_offload"] and runs["device_offload"]),
            row("models", f"{preset} host KV ({where}) vs unmodified (max diff / max logit)", rel, BF16_BOUND,
                note, ok=rel <= BF16_BOUND and runs["host_offload"]),
            row("models", f"{preset} host KV, side-stream delay == no delay", d_delay, 0, delay_note,
                ok=d_delay == 0 and runs["delay_offload"])]


def section_models(dev: torch.device, dry: bool, args: Any) -> list:
    rows = []
    steps = min(args.steps, 2) if dry else args.steps
    where = "host tensors, interpreter" if dry else "host KV pinned"
    for delay in (0, DELAY_CYCLES):
        check = f"tiny ({'side-stream delay, ' if delay else ''}{where}) == unmodified"
        try:
            r = model_check(dev, steps, delay)
            note = f"{r['steps']} steps, rewritten {r['rewritten']}"
            if delay and dry:
                note += "; the delay needs a GPU (the stream ops do nothing on the CPU)"
            rows.append(row("models", check, r["max_abs_diff"], 0, note, ok=r["max_abs_diff"] == 0 and r["rewritten"]))
        except Exception as e:  # one model's failure must not hide the others
            traceback.print_exc()
            rows.append(row("models", check, None, 0, _err(e), ok=False))
    for preset in ("hf-tiny",) + (() if dry else ("hf-glm5-attn",)):
        try:
            rows += hf_check(dev, steps, preset)
        except Exception as e:
            traceback.print_exc()
            rows.append(row("models", f"{preset} host KV", None, 0, _err(e), ok=False))
    if dry:
        rows.append(row("models", "hf-glm5-attn host KV (pinned)", NO_GPU, 0,
                        "GLM-5 attention dims at 256 context: too slow for the CPU dry run"))
    return rows


# ------------------------------------------------------------------------------------ serve

def pinned_empty(shape: Sequence[int], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """Host memory for a full cache: pinned in place (exact size) when ``dev`` is a CUDA device."""
    t = torch.empty(tuple(shape), dtype=dtype)
    if dev.type == "cuda":
        from offload_passes.cuda import host_pinned

        t = host_pinned(t)
    return t


def fill_from_device(dst: torch.Tensor, dev: torch.device, g: torch.Generator, chunk_bytes: int = 1 << 30) -> None:
    """Random rows into ``dst`` (host or device), generated on ``dev`` in chunks along dim 0."""
    per = max(1, chunk_bytes // max(1, dst[0].numel() * dst.element_size()))
    for i in range(0, dst.size(0), per):
        part = dst[i:i + per]
        part.copy_(randn(part.shape, dev, g, dst.dtype))


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


def _serve_case(dev: torch.device, B: int, K: int, PS: int, F: int, D: int, Dr: int, sbs: int, g: torch.Generator,
                full: Optional[list] = None) -> dict:
    if full is None:
        full = [pinned_empty((B, F, d), torch.bfloat16, dev) for d in (D, Dr)]
        for t in full:
            fill_from_device(t, dev, g)
    pool = [randn((B, PS, d), dev, g) for d in (D, Dr)]
    sel = [torch.empty(B * K // sbs, sbs, d, dtype=torch.bfloat16, device=dev) for d in (D, Dr)]
    return dict(full=full, pool=pool, sel=sel, nbytes=B * K * (D + Dr) * 2,
                kw=dict(raw_seq=1, topk=K, selection_block_size=sbs, compact_layout=1))


SERVE_KINDS = ("hits", "misses sequential", "misses random")


def section_serve(dev: torch.device, dry: bool, args: Any) -> list:
    from offload_passes.custom_ops.cuda import dsa_serve as CS

    rows = []
    g = _gen(dev, 0)
    name = lambda B, kind: f"serve {kind} B={B} vs {'device copy' if kind == 'hits' else 'host link'}"  # noqa: E731
    goal_of = lambda kind: GOALS["serve_hit_vs_d2d"] if kind == "hits" else GOALS["miss_vs_h2d"]  # noqa: E731
    if dry:  # the correctness part: the Triton kernel == the C++ kernel on each kind of plan (B=2, K=64)
        B, K, PS, F = 2, 64, 64, 256
        x = _serve_case(dev, B, K, PS, F, 8, 4, 16, g)
        plans = serve_plans(B, K, PS, F, dev, g)
        for kind in SERVE_KINDS:
            CS.run(plans[kind], *x["full"], *x["pool"], *x["sel"], **x["kw"])
            want = [torch.zeros_like(t) for t in x["sel"]]
            torch.ops.custom.dsa_serve(plans[kind], *x["full"], *x["pool"], *want, **x["kw"])
            same = all(_same(a, b) for a, b in zip(want, x["sel"]))
            rows.append(row("serve", f"serve {kind} == CPU twin", int(same), 1, "interpreter, B=2 K=64", ok=same))
        return rows + [timing_row("serve", name(B, kind), None, goal=goal_of(kind), dry=True)
                       for B in BATCHES for kind in SERVE_KINDS]
    K, PS, F, D, Dr, sbs = 2048, 8192, 16384, 512, 64, 128
    full = [pinned_empty((max(BATCHES), F, d), torch.bfloat16, dev) for d in (D, Dr)]  # 2.4 GB, shared by the Bs
    for t in full:
        fill_from_device(t, dev, g)
    for B in BATCHES:
        try:
            x = _serve_case(dev, B, K, PS, F, D, Dr, sbs, g, [t[:B] for t in full])
            plans = serve_plans(B, K, PS, F, dev, g)
            src = torch.empty(x["nbytes"], dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            hsrc = pinned_empty((x["nbytes"],), torch.uint8, dev)
            ceil = {"hits": time_cuda(lambda: dst.copy_(src), args.reps),
                    "misses": time_cuda(lambda: dst.copy_(hsrc, non_blocking=True), args.reps)}
            for kind in SERVE_KINDS:
                t = time_cuda(lambda: CS.run(plans[kind], *x["full"], *x["pool"], *x["sel"], **x["kw"]), args.reps)
                rows.append(timing_row("serve", name(B, kind), t, ceil["hits" if kind == "hits" else "misses"],
                                       goal_of(kind), x["nbytes"]))
        except Exception as e:
            traceback.print_exc()
            rows += [row("serve", name(B, kind), None, None, _err(e), ok=False) for kind in SERVE_KINDS]
    return rows


# ------------------------------------------------------------------------------------ kernels

def cuda_policies() -> tuple:
    """The replacement policies of the cuda exe_mode (``offload_passes/modes.py``)."""
    from offload_passes.modes import MODES

    return tuple(MODES["cuda"].replacement_policies)


def section_kernels(dev: torch.device, dry: bool, args: Any) -> list:
    """Plan time and each replacement policy's install time (the owner's ``metadata_update=1`` and a shared
    layer's ``0``), half of the plan's rows hits; their correctness is the equal section's."""
    from offload_passes.custom_ops.cuda import dsa_install as CI
    from offload_passes.custom_ops.cuda import dsa_install_sc as CSC
    from offload_passes.custom_ops.cuda import dsa_plan as CP

    installs = {"fifo": lambda plan, *a, **kw: CI.run(*a, **kw), "second_chance": CSC.run}
    rows = []
    for B in BATCHES:
        names = [(f"dsa_plan B={B}", None, None)] + [(f"install {p} md={md} B={B}", p, md)
                                                     for p in cuda_policies() for md in (1, 0)]
        if dry:
            rows += [row("kernels", n, NO_GPU, None, "correctness: section equal", host_us=NO_GPU)
                     for n, _, _ in names]
            continue
        try:
            g = _gen(dev, B)
            K, PS, F, sbs = 2048, 8192, 16384, 128
            L = torch.full((B,), F - 8, dtype=torch.int32, device=dev)
            tk = torch.stack([torch.randperm(F - 16, generator=g, device=dev)[:K] for _ in range(B)]).to(torch.int32)
            tk = tk.view(B, 1, 1, K)
            pid = torch.full((B, PS), -1, dtype=torch.int32, device=dev)
            i2s = torch.full((B, F), -1, dtype=torch.int32, device=dev)
            lru = torch.zeros(B, PS // 16, dtype=torch.int32, device=dev)
            half = tk[..., : K // 2].reshape(B, K // 2).long()  # half the ids already in the pool: hits
            i2s.scatter_(1, half, torch.arange(K // 2, dtype=torch.int32, device=dev).expand(B, -1).contiguous())
            plan, rec, _ = CP.run(tk, L, pid, i2s, lru, raw_seq=1)
            sel = [randn((B * K // sbs, sbs, d), dev, g) for d in (512, 64)]
            pool = [torch.zeros(B, PS, d, dtype=torch.bfloat16, device=dev) for d in (512, 64)]
            table = torch.arange(B * K // sbs, dtype=torch.int32, device=dev).view(B, K // sbs)
            kw = dict(raw_seq=1, topk=K, selection_block_size=sbs)
            for n, policy, md in names:
                if policy is None:
                    t = time_cuda(lambda: CP.run(tk, L, pid, i2s, lru, raw_seq=1), args.reps)
                else:
                    t = time_cuda(lambda: installs[policy](plan, rec, *sel, table, *pool, pid, i2s, lru,
                                                           metadata_update=md, **kw), args.reps)
                rows.append(timing_row("kernels", n, t, note="one plan's records, replayed"))
        except Exception as e:
            traceback.print_exc()
            rows += [row("kernels", n, None, None, _err(e), ok=False) for n, _, _ in names]
    return rows


# ------------------------------------------------------------------------------------ graphs

def _step_times(dev: torch.device, timings: Optional[list], fn: Callable) -> Any:
    """``fn()``, its wall time on the device appended to ``timings`` (CUDA events; nothing on the CPU)."""
    if timings is None or dev.type != "cuda":
        return fn()
    a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    out = fn()
    e.record()
    e.synchronize()
    timings.append(a.elapsed_time(e) / 1e3)
    return out


def recipe_graph_logits(dev: torch.device, steps: int, captured: bool, timings: Optional[list] = None) -> tuple:
    """The recipe ``tiny`` model with host KV (pinned on a GPU), its decode step compiled in exe_mode "cuda"
    with ``mode="reduce-overhead"`` (captured: the lowering's own capture) or without (op by op): the logits of
    ``steps`` steps and the backend."""
    from offload_passes import models

    torch._dynamo.reset()
    b = models.build("tiny", enable_offload=True, decode_steps=steps, device=dev)
    if dev.type == "cuda":
        from offload_passes.cuda import place_full_caches

        place_full_caches(b.model, dev)
    be = cuda_backend(pool_size=1024)
    fn = torch.compile(b.model, backend=be, **({"mode": "reduce-overhead"} if captured else {}))
    b.driver.prefill()
    out = [_step_times(dev, timings, lambda: b.driver.step(fn)).logits.detach().clone() for _ in range(steps)]
    return out, be


GRAPH_PATHS = ("tiny (recipe, host KV)", "hf-glm5-attn (HF, host KV, 16K)")


def section_graphs(dev: torch.device, dry: bool, args: Any) -> list:
    """One CUDA graph per decode step on both paths: the recipe ``tiny`` model and ``hf-glm5-attn`` at 16K (pool
    8192), host KV, compiled with ``mode="reduce-overhead"`` (the lowering's own capture,
    ``offload_passes/lowering/cuda_graphs.py``) against the same compile without it (op by op): ms per step,
    logits equal, the decode graph's capture check. ``--dry-run``: ``tiny`` and ``hf-tiny`` on host tensors,
    where nothing is captured (no CUDA tensor): the capture check and the logits of the compile with the mode."""
    from offload_passes.cuda import raise_device_errors
    from offload_passes.lowering.cuda_graphs import capture_problems
    from offload_passes.models import hf

    rows = []
    steps = 3 if dry else max(args.steps, 4) + 2
    for path in GRAPH_PATHS:
        name = path if not dry else path.replace("hf-glm5-attn (HF, host KV, 16K)", "hf-tiny (HF, host KV, 128)")
        checks = (f"{name}: replay vs op by op (ms/step ratio)", f"{name}: replay == op by op (max abs diff)",
                  f"{name}: decode graph capture problems")
        out: dict = {}
        try:
            for captured in (False, True):
                times: list = []
                if path.startswith("tiny"):
                    logits, be = recipe_graph_logits(dev, steps, captured, times)
                else:
                    torch._dynamo.reset()
                    b = hf.build("hf-tiny" if dry else "hf-glm5-attn")
                    model = b.model.to(dev)
                    be = cuda_backend(pool_size=1024 if dry else 8192)
                    fn = torch.compile(model, backend=be, fullgraph=True, dynamic=False,
                                       **({"mode": "reduce-overhead"} if captured else {}))
                    logits = hf_logits(b, model, fn, True, 128 if dry else 16384, steps, dev, timings=times)
                _sync()
                raise_device_errors()
                replays = sum(r.replays for r in be.lowering.replays.values())
                t = statistics.median(times[2:]) if len(times) > 2 else None  # warm-up and capture left out
                out[captured] = (t, logits, capture_problems(be.final_graph()), replays)
        except Exception as e:
            traceback.print_exc()
            rows += [row("graphs", c, None, None, _err(e), ok=False) for c in checks]
            continue
        (t_eager, l_eager, _, _), (t_graph, l_graph, problems, replays) = out[False], out[True]
        diff = _max_diff(l_eager, l_graph)
        if dry:
            note = "host tensors: nothing captured, the lowered step op by op (tests/cuda/test_step_capture.py: the " \
                   "capture on fake CUDA)"
            rows.append(row("graphs", checks[0], NO_GPU, None, "needs torch.cuda.CUDAGraph", host_us=NO_GPU))
        else:
            note = f"{steps} steps, {replays} replays; op by op {t_eager * 1e3:.3g} ms, replay {t_graph * 1e3:.3g} ms"
            rows.append(row("graphs", checks[0], ratio(t_eager, t_graph), None, note))
        rows.append(row("graphs", checks[1], diff, 0, note, ok=diff == 0 and (dry or replays == steps - 2)))
        rows.append(row("graphs", checks[2], len(problems), 0, "; ".join(problems[:3]), ok=not problems))
    return rows


# ------------------------------------------------------------------------------------ capacity

class AttentionStack:
    """``geo.layers`` attention layers of GLM-5's shapes over ``B`` rows holding ``ctx`` tokens, one decode token per
    row and step; the full latent / rope caches on the device (``offload=False``) or in pinned host memory with a
    pool per layer (``offload=True``: one ``dsa_plan`` per group, ``dsa_serve`` per layer, the installs after each
    layer, the owner's ``metadata_update=1`` install last, as ``passes/rewrite.py`` emits them).

    Per group, per step: the new token's rows are written (host: the cache-write kernel through the pinned
    address), an indexer of ``idx_heads x idx_dim`` scores every cached token (``relu(q . k)``, weighted over its
    heads; its query turns a little every step, so successive top-k overlap as a decode's do), the top-k ids;
    then every layer attends (absorbed MLA: ``softmax(q . [latent, rope]) . latent``) over its K rows, gathered
    from the device cache or placed by ``dsa_serve``. Both variants compute the same thing: :meth:`step` returns
    every layer's output, equal bit for bit. Every tensor the step touches is static, so a step is capturable.
    ``host_store``: a flat pinned ``uint8`` buffer the host caches are carved from (re-used between contexts)."""

    def __init__(self, geo: StackGeo, B: int, ctx: int, room: int, dev: torch.device, offload: bool,
                 host_store: Optional[torch.Tensor] = None, seed: int = 0):
        from offload_passes.custom_ops.cuda import cache_write as CW
        from offload_passes.custom_ops.cuda import dsa_install as CI
        from offload_passes.custom_ops.cuda import dsa_plan as CP
        from offload_passes.custom_ops.cuda import dsa_serve as CS

        self.k = dict(plan=CP.run, serve=CS.run, install=CI.run, write=CW.run)
        self.geo, self.B, self.dev, self.offload = geo, B, dev, offload
        self.T = T = ctx + room
        G, L, H, K = geo.groups, geo.layers, geo.heads, geo.topk
        g = _gen(dev, seed)
        bf = torch.bfloat16
        if offload:
            nkv, nr = L * B * T * geo.dkv, L * B * T * geo.dr
            if host_store is None:
                host_store = pinned_empty(((nkv + nr) * 2,), torch.uint8, dev)
            flat = host_store[:(nkv + nr) * 2].view(bf)
            self.kv, self.rope = flat[:nkv].view(L, B, T, geo.dkv), flat[nkv:].view(L, B, T, geo.dr)
        else:
            self.kv = torch.empty(L, B, T, geo.dkv, dtype=bf, device=dev)
            self.rope = torch.empty(L, B, T, geo.dr, dtype=bf, device=dev)
        for l in range(L):
            fill_from_device(self.kv[l], dev, g)
            fill_from_device(self.rope[l], dev, g)
        self.idx_keys = randn((G, B, T, geo.idx_dim), dev, g)
        self.q_idx = randn((G, B, geo.idx_heads, geo.idx_dim), dev, g)
        self.w_idx = torch.rand(G, B, 1, geo.idx_heads, generator=g, device=dev).to(bf)
        self.q = randn((L, B, H, geo.dkv + geo.dr), dev, g)
        self.new_kv, self.new_rope = randn((L, B, geo.dkv), dev, g), randn((L, B, geo.dr), dev, g)
        self.new_key = randn((G, B, geo.idx_dim), dev, g)
        self.length = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        self.base_rows = torch.arange(B, device=dev, dtype=torch.int64) * T
        self.cols = torch.arange(T, device=dev)
        self.scale = (geo.dkv + geo.dr) ** -0.5
        self.kinds = torch.zeros(6, dtype=torch.int64, device=dev)  # plan kinds counted on the device
        self.kind_ids = torch.arange(6, device=dev)
        if offload:
            P, sbs = geo.pool, geo.sbs
            self.pools = [(torch.zeros(B, P, geo.dkv, dtype=bf, device=dev), torch.zeros(B, P, geo.dr, dtype=bf,
                                                                                        device=dev)) for _ in range(L)]
            self.meta = [(torch.full((B, P), -1, dtype=torch.int32, device=dev),
                          torch.full((B, T), -1, dtype=torch.int32, device=dev),
                          torch.zeros(B, P // 16, dtype=torch.int32, device=dev)) for _ in range(G)]
            self.sel = [(torch.empty(B * K // sbs, sbs, geo.dkv, dtype=bf, device=dev),
                         torch.empty(B * K // sbs, sbs, geo.dr, dtype=bf, device=dev)) for _ in range(L)]
            self.table = torch.arange(B * K // sbs, dtype=torch.int32, device=dev).view(B, K // sbs)

    def _indexer(self, gi: int) -> torch.Tensor:
        q = self.q_idx[gi]
        half = q.shape[-1] // 2  # the query turns by a small angle each step (pairs of dims rotated)
        c, s = 0.9998, 0.02
        q.copy_(torch.cat([c * q[..., :half] - s * q[..., half:], s * q[..., :half] + c * q[..., half:]], -1))
        scores = torch.matmul(q, self.idx_keys[gi].transpose(1, 2)).relu_()  # [B, idx_heads, T]
        total = torch.matmul(self.w_idx[gi], scores).squeeze(1).float()  # weighted over the heads: [B, T]
        total.masked_fill_(self.cols.view(1, -1) >= self.length.view(-1, 1), float("-inf"))
        return total.topk(self.geo.topk, dim=-1).indices.to(torch.int32)  # [B, K]

    def _attend(self, l: int, kv: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        q = self.q[l]
        s = (torch.matmul(q[..., :self.geo.dkv], kv.transpose(1, 2)) +
             torch.matmul(q[..., self.geo.dkv:], rope.transpose(1, 2))).float() * self.scale
        return torch.matmul(torch.softmax(s, -1).to(kv.dtype), kv)  # [B, H, dkv]

    def step(self) -> torch.Tensor:
        """One decode token per row through every layer; returns the layers' outputs ``[L, B, H, dkv]``."""
        geo, B, K = self.geo, self.B, self.geo.topk
        pos = self.length.long()
        for gi in range(geo.groups):
            self.idx_keys[gi].index_copy_(1, pos[:1], self.new_key[gi].unsqueeze(1))
        for l in range(geo.layers):
            if self.offload:  # the new token's rows into the host cache, through the pinned address
                kvc = self.kv[l].view(1, B * self.T, 1, geo.dkv)
                self.k["write"](kvc, self.rope[l].view(1, B * self.T, 1, geo.dr), self.base_rows + pos,
                                self.new_kv[l], self.new_rope[l])
            else:
                self.kv[l].index_copy_(1, pos[:1], self.new_kv[l].unsqueeze(1))
                self.rope[l].index_copy_(1, pos[:1], self.new_rope[l].unsqueeze(1))
        self.length += 1
        outs = []
        for gi in range(geo.groups):
            ids = self._indexer(gi)
            layers = range(gi * geo.group, (gi + 1) * geo.group)
            if not self.offload:
                idx = ids.long().unsqueeze(-1)
                for l in layers:
                    outs.append(self._attend(l, torch.gather(self.kv[l], 1, idx.expand(B, K, geo.dkv)),
                                             torch.gather(self.rope[l], 1, idx.expand(B, K, geo.dr))))
                continue
            pid, i2s, lru = self.meta[gi]
            plan, rec, _ = self.k["plan"](ids.view(B, 1, 1, K), self.length, pid, i2s, lru, raw_seq=1)
            self.kinds += (plan[:, :1].long() == self.kind_ids).sum(0)  # a static shape: capturable
            kw = dict(raw_seq=1, topk=K, selection_block_size=geo.sbs)
            owner, last = layers[0], layers[-1]
            for l in layers:
                skv, srp = self.sel[l]
                self.k["serve"](plan, self.kv[l], self.rope[l], *self.pools[l], skv, srp, compact_layout=1, **kw)
                outs.append(self._attend(l, skv.view(B, K, geo.dkv), srp.view(B, K, geo.dr)))
                for layer, md in ([(l, 0)] if l != owner else []) + ([(owner, 1)] if l == last else []):
                    self.k["install"](rec, *self.sel[layer], self.table, *self.pools[layer], pid, i2s, lru,
                                      metadata_update=md, **kw)
        return torch.stack(outs)

    def hit_rate(self) -> Optional[float]:
        """Hits over hits + misses + window rows of every plan so far (offloaded only)."""
        k = self.kinds.tolist()
        looked = k[1] + k[2] + k[3]
        return k[1] / looked if looked else None


def stack_equal(geo: StackGeo, B: int, ctx: int, steps: int, dev: torch.device) -> Optional[str]:
    """The offloaded stack against the dense one over ``steps`` steps: equal outputs, and pool hits once warm."""
    dense = AttentionStack(geo, B, ctx, steps, dev, offload=False)
    off = AttentionStack(geo, B, ctx, steps, dev, offload=True)
    for s in range(steps):
        a, b = dense.step(), off.step()
        if not _same(a, b):
            return f"step {s}: outputs differ (max |diff| {float((a.float() - b.float()).abs().max()):.3g})"
    if not off.hit_rate():
        return f"no pool hit in {steps} steps (plan kinds {off.kinds.tolist()})"
    return None


def time_stack(stack: AttentionStack, steps: int) -> dict:
    """ms per step of ``stack`` eagerly (CUDA events; the launches included) and replayed as one captured step (the
    device time: the launch overhead is the difference); host ms per step of the eager launches."""
    for _ in range(2):
        stack.step()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    a.record()
    for _ in range(steps):
        stack.step()
    b.record()
    host = (time.perf_counter() - t0) / steps
    b.synchronize()
    out = {"eager_ms": a.elapsed_time(b) / steps, "host_ms": host * 1e3, "replay_ms": None}
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            stack.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            stack.step()
        torch.cuda.synchronize()
        a.record()
        for _ in range(steps):
            graph.replay()
        b.record()
        b.synchronize()
        out["replay_ms"] = a.elapsed_time(b) / steps
    except Exception as e:  # the eager figure stands; say why
        traceback.print_exc()
        out["capture_error"] = _err(e)
    return out


def _room(steps: int) -> int:
    """Tokens a capacity stack holds beyond its context: every step :func:`time_stack` runs adds one."""
    return 3 * steps + 8


def _capacity_rows(geo: StackGeo, ctx: int, hbm: int, host: int, room: int) -> tuple:
    cap = capacity_batches(geo, ctx + room, hbm, host)
    by = cap["bytes"]
    mib = lambda n: f"{n / 2 ** 20:.1f} MiB"  # noqa: E731
    rows = [row("capacity", f"largest batch, dense @ {ctx}", cap["dense"], None,
                f"arithmetic: {mib(by['dense'])} of device per row in {hbm / 2 ** 30:.0f} GiB"),
            row("capacity", f"largest batch, offloaded @ {ctx}", cap["offload"], None,
                f"arithmetic: {mib(by['offload'])} of device per row (HBM bound {cap['offload_by_hbm']}), "
                f"{mib(by['host'])} pinned per row (host bound {cap['offload_by_host']}): {cap['binds']} binds"),
            row("capacity", f"rows offloaded / dense @ {ctx}", ratio(cap["offload"], cap["dense"]), None,
                "arithmetic, the same HBM budget")]
    return rows, cap


def section_capacity(dev: torch.device, dry: bool, args: Any) -> list:
    geo = DRY_STACK if dry else StackGeo(layers=args.capacity_layers)
    hbm, host = int(args.hbm_gib * 2 ** 30), int(args.host_gib * 2 ** 30)
    check = f"attention stack ({geo.layers} layers): offloaded == dense"
    if dry:
        rows = [_verdict("capacity", check, lambda: stack_equal(geo, 2, 512, 4, dev), "B=2, 512 tokens, 4 steps")]
    else:
        rows = [_verdict("capacity", check, lambda: stack_equal(geo, 2, 8192, 4, dev), "B=2, 8192 tokens, 4 steps")]
    store, room = None, _room(args.capacity_steps)
    for ctx in CAPACITY_CONTEXTS:
        arith, cap = _capacity_rows(GLM5_STACK if dry else geo, ctx, hbm, host, room)
        rows += arith
        names = [f"tokens/s dense @ {ctx}", f"tokens/s offloaded @ {ctx}", f"tokens/s offloaded / dense @ {ctx}"]
        if dry:
            rows += [row("capacity", n, NO_GPU, None, NO_GPU, host_us=NO_GPU) for n in names]
            continue
        tok = {}
        for name, offload in ((names[0], False), (names[1], True)):
            B = cap["offload" if offload else "dense"]
            try:
                if B < 1:
                    raise ValueError(f"no row fits ({cap})")
                if offload and store is None:
                    need = max(capacity_batches(geo, c + room, hbm, host)["offload"] *
                               stack_bytes(geo, c + room)["host"] for c in CAPACITY_CONTEXTS)
                    store = pinned_empty((need,), torch.uint8, dev)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                stack = AttentionStack(geo, B, ctx, room, dev, offload, store)
                t = time_stack(stack, args.capacity_steps)
                peak = torch.cuda.max_memory_allocated() / 2 ** 30
                ms = t["replay_ms"] or t["eager_ms"]
                tok[offload] = B / ms * 1e3
                note = (f"B={B}; {ms:.3g} ms/step ({'graph replay' if t['replay_ms'] else 'eager'}), eager "
                        f"{t['eager_ms']:.3g} ms/step; peak device {peak:.1f} GiB of {args.hbm_gib:g}")
                if offload:
                    hr = stack.hit_rate()
                    note += f"; pool hit rate {hr:.1%}" if hr is not None else ""
                if t.get("capture_error"):
                    note += f"; capture: {t['capture_error']}"
                rows.append(row("capacity", name, tok[offload], None, note, host_us=t["host_ms"] * 1e3,
                                ok=None if peak <= args.hbm_gib else False))
                del stack
            except Exception as e:
                traceback.print_exc()
                rows.append(row("capacity", name, None, None, f"B={B}: {_err(e)}", ok=False))
        rows.append(row("capacity", names[2], ratio(tok.get(True), tok.get(False)), None,
                        "each at its largest batch"))
    return rows


RUNNERS = {"equal": section_equal, "models": section_models, "serve": section_serve, "kernels": section_kernels,
           "graphs": section_graphs, "capacity": section_capacity}


# ------------------------------------------------------------------------------------ processes

#: the arguments a section's process gets from the command line (``--worker`` and ``--out`` are added)
PASSED_ON = ("steps", "reps", "hbm_gib", "host_gib", "capacity_layers", "capacity_steps")


def worker_argv(name: str, out: str, args: Any) -> list:
    argv = [os.path.abspath(__file__), "--worker", name, "--out", out]
    for k in PASSED_ON:
        argv += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    return argv + (["--dry-run"] if args.dry_run else [])


def _tail(text: str) -> str:
    lines = [x for x in (text or "").strip().splitlines() if x.strip()]
    return lines[-1][:200] if lines else ""


def run_section(name: str, args: Any, limit_s: float) -> tuple:
    """Section ``name`` in a process of its own under a wall-clock limit: ``(rows, error, seconds, info)``. A crash
    (a fatal CUDA error, a signal) or the limit ends that process only."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{name}.json")
        env = dict(os.environ)
        if args.dry_run:
            env["TRITON_INTERPRET"] = "1"
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, *worker_argv(name, out, args)], env=env, timeout=limit_s,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            sys.stderr.write(err[-20000:])
            return None, f"TimeoutError: section {name} passed its limit of {limit_s:.0f} s", \
                time.perf_counter() - t0, {}
        secs = time.perf_counter() - t0
        sys.stderr.write(p.stderr[-20000:])
        if not os.path.exists(out):
            return None, f"the section's process exited with {p.returncode}: {_tail(p.stderr)}", secs, {}
        with open(out) as f:
            data = json.load(f)
        info = {k: data[k] for k in ("device", "torch", "triton") if k in data}
        if "error" in data:
            return None, data["error"], secs, info
        return data["rows"], None, secs, info


def run_sections(sections: Sequence[str], args: Any, results: dict) -> dict:
    """Run ``sections`` in order into ``results`` (rows, or ``{"error"}``), with their seconds."""
    for name in SECTIONS:
        if name not in sections:
            continue
        limit = DRY_LIMITS[name] if args.dry_run else SECTIONS[name].limit_s
        rows, err, secs, info = run_section(name, args, limit)
        results[name] = rows if rows is not None else {"error": err}
        results.setdefault("section_s", {})[name] = secs
        for k, v in info.items():
            results.setdefault(k, v)
    return results


def worker(args: Any) -> int:
    """The body of one section's process: its rows (or its error) into ``args.out``."""
    import importlib.metadata

    if args.dry_run:
        dev = torch.device("cpu")
        device = "cpu (dry run, Triton interpreter)"
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
        device = torch.cuda.get_device_name(dev)
    import offload_passes  # noqa: F401  (registers the ops and, with CUDA + triton, their CUDA kernels)

    data: dict = {"device": device, "torch": torch.__version__, "triton": importlib.metadata.version("triton")}
    try:
        data["rows"] = RUNNERS[args.worker](dev, args.dry_run, args)
    except Exception as e:
        traceback.print_exc()
        data["error"] = _err(e)
    with open(args.out, "w") as f:
        json.dump(data, f, default=str)
    return 0


# ------------------------------------------------------------------------------------ command line

def parse(argv: Optional[Sequence[str]]) -> Any:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    ap.add_argument("--steps", type=int, default=4, help="decode steps of the model checks")
    ap.add_argument("--reps", type=int, default=20, help="calls per timing (one captured graph)")
    ap.add_argument("--hbm-gib", type=float, default=24.0,
                    help="capacity: the device memory the KV (and the step) may take, GiB")
    ap.add_argument("--host-gib", type=float, default=64.0,
                    help="capacity: the pinned host memory the offloaded caches may take, GiB")
    ap.add_argument("--capacity-layers", type=int, default=GLM5_STACK.layers,
                    help=f"capacity: layers of the attention stack (a multiple of {GLM5_STACK.group})")
    ap.add_argument("--capacity-steps", type=int, default=4, help="capacity: timed decode steps per variant")
    ap.add_argument("--json", default="gpu_check.json", help="where the results go (JSON)")
    ap.add_argument("--merge", action="store_true",
                    help="partial rerun: keep the other sections' results already in --json")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: every correctness part on the CPU under Triton's interpreter, timing cells 'no GPU'")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.section_list = [s for s in args.sections.split(",") if s]
    bad = [s for s in args.section_list + ([args.worker] if args.worker else []) if s not in SECTIONS]
    if bad:
        raise ValueError(f"--sections: unknown {bad}; known: {list(SECTIONS)}")
    if args.steps < 1 or args.reps < 1 or args.capacity_steps < 1:
        raise ValueError(f"--steps, --reps and --capacity-steps must be >= 1, got {args.steps}, {args.reps} and "
                         f"{args.capacity_steps}")
    if not (args.hbm_gib > 0 and args.host_gib > 0):
        raise ValueError(f"--hbm-gib and --host-gib must be > 0, got {args.hbm_gib} and {args.host_gib}")
    try:
        StackGeo(layers=args.capacity_layers)
    except ValueError as e:
        raise ValueError(f"--capacity-layers: {e}") from None
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parse(argv)
    except ValueError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        print("gpu_check: the Triton kernels need the `triton` package (pip install 'offload_passes[cuda]')",
              file=sys.stderr)
        return 2
    if args.dry_run:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("gpu_check: --dry-run: triton was imported before TRITON_INTERPRET=1 could be set", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False); "
              "this check needs a GPU", file=sys.stderr)
        return 2
    if args.worker:
        return worker(args)
    results: dict = {"dry_run": True} if args.dry_run else {}
    results.update(steps=args.steps, date=time.strftime("%Y-%m-%d", time.gmtime()),
                   capacity={"hbm_gib": args.hbm_gib, "host_gib": args.host_gib,
                             "stack": asdict(StackGeo(layers=args.capacity_layers))})
    if args.merge and os.path.exists(args.json):  # a partial rerun: the other sections' results are kept
        with open(args.json) as f:
            results = {**json.load(f), **results}
    t0 = time.perf_counter()
    run_sections(args.section_list, args, results)
    results["wall_s"] = time.perf_counter() - t0
    rows = summary_rows(results)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1, default=str)
    kind = "--dry-run" if args.dry_run else f"on {results.get('device', 'CUDA')}"
    print(f"gpu_check {kind} ({results['wall_s']:.0f} s), JSON: {args.json}")
    print(format_table(rows, COLUMNS))
    return 1 if failed(rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Every Triton kernel compiles for the GPU it is meant for (sm_90, H100/H200), here, without a GPU.

The interpreter (tests/cuda/test_cuda_kernels.py) checks what the kernels compute; it does not run
Triton's compiler, which rejects things the interpreter accepts (loop-carried types, constexpr rules,
block sizes, shared memory). Here every launch the launchers make is recorded, under the interpreter,
on small geometries (each constexpr branch) and at the GLM-5 decode geometry (production block sizes),
and each distinct (kernel, signature, constexprs, launch options) is compiled
by ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` down to a cubin, in a child process with
``TRITON_INTERPRET`` unset (tests/cuda/_compile_kernels.py). What this cannot show: that the cubin runs,
its speed, and anything CUDA-driver side (docs/cuda.md).
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

import _gen as G
import test_npu_gather_selection_kv_cache as TG
import test_properties as TP
from offload_passes.custom_ops import _library as Lib

H100_SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)
SPILL_LIMIT = 128  # bytes per thread: 32 registers' worth; a tile that does not fit spills kilobytes
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion")
MODULES = ("dsa_plan", "dsa_serve", "dsa_install", "npu_gather_selection_kv_cache", "cache_write", "guard",
           "static_cache_write", "npu_lightning_indexer", "npu_sparse_flash_attention", "scatter_nd_update")
TRITON_DTYPE = {torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
                torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
                torch.bool: "i1"}


def _modules():
    import importlib
    return {m: importlib.import_module(f"offload_passes.custom_ops.cuda.{m}") for m in MODULES}


def launched_kernels(mods) -> dict[str, set[str]]:
    """Per module, the @triton.jit functions launched with a grid (``name[grid](...)`` in its source)."""
    from triton.runtime.interpreter import InterpretedFunction
    out = {}
    for m, mod in mods.items():
        src = inspect.getsource(mod)
        out[m] = {n for n, v in vars(mod).items() if isinstance(v, InterpretedFunction) and f"{n}[" in src}
    return out


def _is_constexpr(p: inspect.Parameter) -> bool:
    ann = p.annotation
    return ann is not inspect.Parameter.empty and "constexpr" in (ann if isinstance(ann, str) else repr(ann))


def signature_of(fn, args, kwargs) -> dict:
    """Triton's AOT signature of one launch: pointer dtypes, scalar widths, constexpr values."""
    sig = inspect.signature(fn)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in LAUNCH_OPTIONS}
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    types, consts, div16 = {}, {}, []
    for i, (name, p) in enumerate(sig.parameters.items()):
        v = bound.arguments[name]
        if _is_constexpr(p) or v is None:
            types[name], consts[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            types[name] = "*" + TRITON_DTYPE[v.dtype]
            if v.data_ptr() % 16 == 0:  # the JIT's specialisation: 16-byte aligned pointers get the hint
                div16.append(i)
        elif isinstance(v, bool):
            types[name] = "i1"
        elif isinstance(v, int):
            types[name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
            if v % 16 == 0:  # ... and integers divisible by 16
                div16.append(i)
        elif isinstance(v, float):
            types[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(v).__name__}")
    return {"signature": types, "constexprs": consts, "options": options, "divisible_by_16": div16}


class Recorder:
    """Stands in for ``mod.<kernel>``: records each launch's signature, then runs it (interpreter) unless the
    phase says record only (``phase[1]`` False: what follows needs only the outputs' shapes)."""

    def __init__(self, module: str, name: str, kern, log: list, phase: list):
        self.module, self.name, self.kern, self.log, self.phase = module, name, kern, log, phase

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            rec = signature_of(self.kern.fn, args, dict(kwargs))
            self.log.append({"module": f"offload_passes.custom_ops.cuda.{self.module}", "kernel": self.name,
                             "geometry": self.phase[0], **rec})
            return self.kern[grid](*args, **kwargs) if self.phase[1] else None
        return launch


def _step(B, S, K, PS, IR, D, Dr, sbs, dtype, seed=0):
    return dict(B=B, S=S, K=K, PS=PS, IR=IR, sbs=sbs, L=[min(IR, 3 * K)] * B, F=min(IR, 3 * K) + 1, seed=seed,
                fill=1.0, hole=0.0, dup=0.0, future=0.0, beyond=False, garbage=False, pool_fill=0.5, D=D, Dr=Dr,
                dtype=dtype)


def _plan_serve_install(mods, c, mu, sc_policy):
    from offload_passes.custom_ops.cuda import dsa_install_sc
    L, tk, pid, i2s, lru, fkv, frope, pkv, prope = TP._make_step(c)
    S, K, sbs = c["S"], c["K"], c["sbs"]
    plan, rec, _ = mods["dsa_plan"].run(tk, L, pid, i2s, lru, raw_seq=S)
    rows = c["B"] * S * K
    g = G.gen(c["seed"] + 1)
    sel = [G.payload((rows // sbs, sbs, c["D"]), c["dtype"], g), G.payload((rows // sbs, sbs, c["Dr"]), c["dtype"], g)]
    kw = dict(raw_seq=S, topk=K, selection_block_size=sbs)
    mods["dsa_serve"].run(plan, fkv, frope, pkv, prope, *sel, compact_layout=1, **kw)
    table = torch.arange(rows // sbs, dtype=torch.int32).view(c["B"] * S, K // sbs)
    if sc_policy:
        dsa_install_sc.run(plan, rec, *sel, table, pkv, prope, pid, i2s, lru, metadata_update=mu, **kw)
    else:
        mods["dsa_install"].run(rec, *sel, table, pkv, prope, pid, i2s, lru, metadata_update=mu, **kw)


def _host_write_and_guard(mods, T, D, Dr, dtype):
    """The host-KV writes (the recipe's: rows T of a 4T-row cache; the HF cache's: one token of T rows of a
    [T, 1, 8, D] cache) and one device guard (its flag cleared after)."""
    g = G.gen(7)
    kvc, krc = G.payload((T, 4, 1, D), dtype, g), G.payload((T, 4, 1, Dr), dtype, g)
    mods["cache_write"].run(kvc, krc, torch.arange(T, dtype=torch.int64) * 3, G.payload((T, D), dtype, g),
                            G.payload((T, Dr), dtype, g))
    keys, values = G.payload((T, 1, 8, D), dtype, g), G.payload((T, 1, 8, Dr), dtype, g)
    mods["static_cache_write"].run(keys, values, torch.tensor([5]), G.payload((T, 1, 1, D), dtype, g),
                                   G.payload((T, 1, 1, Dr), dtype, g))
    mods["guard"].flag(torch.tensor(True), "offload guard: compile test")


def _gather(mods, K, bsz, dtype, no_rope, D, Dr, B=1, S=1):
    """One gather step; K <= 32 is the SMALL (block ledger) path, as in tests/ops."""
    case = TG.Case(3, K=K, B=B, S=S, bsz=bsz, dtype=dtype, no_rope=no_rope, layout="BSND", D=D, Dr=Dr)
    tk = case.next_topk(hole=0.0, dup=0.0, future=0.0)
    mods["npu_gather_selection_kv_cache"].run(*case.args(tk, case.clone_state()), case.bsz)


def _decode_ops(T, N, D, Dr, Hi, Di, K, bs, maxblk, int8_indexer: bool):
    """One step of the recipe model's decode ops (``_decode_cases.Case``: TND query, paged keys): an indexer,
    sparse attention over the paged cache, the indexer-cache write of ``cache_write: inplace``."""
    import _decode_cases as DC
    from offload_passes.custom_ops.cuda import npu_quant_lightning_indexer as QLI
    mods = _modules()
    c = DC.Case(seed=5, B=T, S=1, bs=bs, maxblk=maxblk, kv_len=[maxblk * bs - 3] * T)
    if int8_indexer:
        args, kw = c.quant_indexer(Hi, Di, K)
        QLI.run(*args, **kw)
    else:
        args, kw = c.indexer(Hi, Di, K)
        mods["npu_lightning_indexer"].run(*args, **kw)
    args, kw = c.sfa(N, D, Dr, K)
    mods["npu_sparse_flash_attention"].run(*args, **kw)
    cache = torch.zeros(c.num_blocks, bs, 1, Di, dtype=torch.int8 if int8_indexer else torch.bfloat16)
    slots = torch.arange(T, dtype=torch.int64) * 3
    mods["scatter_nd_update"].run(cache, torch.stack((slots // bs, slots % bs), -1),
                                  torch.ones(T, 1, Di, dtype=cache.dtype))


@pytest.fixture(scope="module")
def launches(triton_interpreted):
    mods = _modules()
    log, phase = [], ["small", True]
    mp = pytest.MonkeyPatch()
    for m, names in launched_kernels(mods).items():
        for n in names:
            mp.setattr(mods[m], n, Recorder(m, n, getattr(mods[m], n), log, phase))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for op in ("dsa_plan", "dsa_serve", "dsa_install", "dsa_install_sc", "npu_gather_selection_kv_cache"):
            Lib.cpu_op(op)
        # small geometries, executed: every constexpr branch (FIFO / second chance, metadata update on / off,
        # both payload widths, the gather's SMALL and rope variants)
        for mu, sc_policy in ((1, False), (0, False), (1, True)):  # pool payloads: 16-bit in plan / serve / install
            _plan_serve_install(mods, _step(1, 2, 64, 32, 130, 4, 2, 16, torch.bfloat16), mu, sc_policy)
        _plan_serve_install(mods, _step(1, 2, 64, 32, 130, 4, 0, 16, torch.bfloat16), 1, False)  # no rope (Dr = 0)
        for dtype in (torch.bfloat16, torch.int8):
            for K, bsz in ((16, 4), (64, 1)):
                for no_rope in (False, True):
                    _gather(mods, K, bsz, dtype, no_rope, 4, 2)
        _gather(mods, 64, 1, torch.bfloat16, False, 4, 0)  # the gather's zero-width rope
        _host_write_and_guard(mods, 8, 4, 2, torch.bfloat16)
        for int8_indexer in (False, True):  # the recipe's decode ops at tiny's geometry, both indexers
            _decode_ops(T=2, N=4, D=64, Dr=16, Hi=4, Di=32, K=64, bs=16, maxblk=8, int8_indexer=int8_indexer)
        # the GLM-5 decode geometry (topk 2048, selection block 128, latent 512 + rope 64, pool 8192 rows,
        # context 8192, next_n 0 and 3): the block sizes, so registers and shared memory, of production
        phase[0] = "glm5"
        for S in (1, 4):
            c = dict(_step(1, S, 2048, 8192, 65536, 512, 64, 128, torch.bfloat16), F=4 * 2048, L=[4 * 2048])
            _plan_serve_install(mods, c, 1, False)
        _gather(mods, 2048, 1, torch.bfloat16, False, 512, 64)
        _host_write_and_guard(mods, 4 * 128, 512, 64, torch.bfloat16)  # B=128 rows, next_n 3: one step's writes
        # 64 heads of 512 + 64, indexer 32 heads of 128, a 4096-token table; recorded, not run (the interpreter
        # takes minutes for one such step; test_decode_kernels.py runs the GLM-5 head dims at a smaller K)
        phase[1] = False
        for int8_indexer in (False, True):
            _decode_ops(T=1, N=64, D=512, Dr=64, Hi=32, Di=128, K=2048, bs=128, maxblk=32, int8_indexer=int8_indexer)
        phase[1] = True
    finally:
        mp.undo()
        torch.set_num_threads(threads)
    unique = {json.dumps(r, sort_keys=True, default=str): r for r in log}
    return mods, list(unique.values())


@pytest.fixture(scope="module")
def compiled(launches, tmp_path_factory):
    _, recs = launches
    d = tmp_path_factory.mktemp("aot")
    (d / "launches.json").write_text(json.dumps(recs, default=str))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(d / "triton_cache")  # a fresh cache: every launch really compiles
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # triton 3.9 warns when unset; 1 is every version's default
    script = os.path.join(os.path.dirname(__file__), "_compile_kernels.py")
    p = subprocess.run([sys.executable, script, str(d / "launches.json"), str(d / "results.json"), "--arch", "90"],
                       env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    return recs, json.loads((d / "results.json").read_text())


def test_every_launched_kernel_is_recorded(launches):
    mods, recs = launches
    want = {(f"offload_passes.custom_ops.cuda.{m}", n) for m, ns in launched_kernels(mods).items() for n in ns}
    got = {(r["module"], r["kernel"]) for r in recs}
    assert want == got
    # plan 1, serve 1, install 6 (second chance's reference pass), gather 5 (the block-table check and its
    # report, ledger, copies, the K <= 32 swap), host writes 2 (the recipe's, the HF cache's), guard 1,
    # indexer 2 (scores, finish), sparse attention 3, indexer-cache write 1
    assert len(want) == 22
    assert {r["constexprs"]["QUANT"] for r in recs if r["kernel"] == "_indexer_score_kernel"} == {False, True}
    # the indexer adds in the reference's order: no contraction into fused multiply-adds
    assert {r["options"].get("enable_fp_fusion") for r in recs if r["kernel"] == "_indexer_score_kernel"} == {False}
    # both policies and both metadata modes reached the install's victim kernel
    assign = {(r["constexprs"]["SECOND_CHANCE"], r["constexprs"]["UPDATE"]) for r in recs
              if r["kernel"] == "_assign_kernel"}
    assert assign == {(False, True), (False, False), (True, True)}
    assert {r["constexprs"]["SMALL"] for r in recs if r["kernel"] == "_ledger_kernel"} == {False, True}
    assert {r["constexprs"]["HAS_ROPE"] for r in recs if r["kernel"] in ("_copy_kernel", "_swap_kernel")} == {False, True}
    for kernel in ("_serve_kernel", "_apply_kernel"):  # the no-rope mode (Dr = 0) of serve and install
        assert {r["constexprs"]["HAS_ROPE"] for r in recs if r["kernel"] == kernel} == {False, True}, kernel


def test_every_launch_compiles_to_an_sm90_cubin(compiled):
    recs, results = compiled
    assert len(results) == len(recs)
    bad = [f"{r['kernel']} {r['constexprs']}: {res.get('error')}" for r, res in zip(recs, results) if not res["ok"]]
    assert not bad, "\n".join(bad)
    assert all(res["cubin_bytes"] > 0 for res in results)


def test_no_tile_spills_at_the_glm5_geometry(compiled):
    """At the GLM-5 geometry no kernel spills more than SPILL_LIMIT bytes per thread (``ptxas -v``), and none
    needs more than sm_90's 255 registers per thread at any geometry. The install's copy tile was once 512K
    elements per program: 87,020 bytes spilled per thread, and minutes of ptxas. Below the limit are
    ptxas's own choices, which differ between triton releases: triton 3.9 spills nothing at this
    geometry, triton 3.4 (torch 2.8) 20 bytes in the plan kernel (255 registers); docs/cuda.md."""
    recs, results = compiled
    assert {r["geometry"] for r in recs} == {"small", "glm5"}
    bad = [(r["kernel"], r["constexprs"], res["regs"], res["spill_stores"], res["spill_loads"])
           for r, res in zip(recs, results)
           if res["regs"] > 255 or (r["geometry"] == "glm5" and max(res["spill_stores"], res["spill_loads"]) > SPILL_LIMIT)]
    assert not bad, bad
    glm5 = {r["kernel"] for r in recs if r["geometry"] == "glm5"}
    assert glm5 == {"_plan_kernel", "_serve_kernel", "_first_kernel", "_cand_kernel", "_assign_kernel",
                    "_keys_kernel", "_apply_kernel", "_check_kernel", "_report_kernel", "_ledger_kernel",
                    "_copy_kernel", "_write_kernel", "_static_write_kernel", "_guard_kernel",
                    "_indexer_score_kernel", "_indexer_finish_kernel", "_sfa_score_kernel", "_sfa_stats_kernel",
                    "_sfa_out_kernel", "_scatter_kernel"}


def test_indexer_scores_compile_without_fused_multiply_adds(compiled):
    """The indexer's score is the reference's fixed order of IEEE single operations (docs/ops.md §6.1): a
    fused multiply-add would round once where the reference rounds twice. Its launches disable contraction,
    and its PTX holds no FMA; sparse attention's softmax (fp64 ``exp``, Triton's default) shows the count
    finds them where they are."""
    recs, results = compiled
    fma = {(r["geometry"], r["constexprs"]["QUANT"]): res["fma"] for r, res in zip(recs, results)
           if r["kernel"] == "_indexer_score_kernel"}
    assert set(fma) == {(g, q) for g in ("small", "glm5") for q in (False, True)}
    assert set(fma.values()) == {0}, fma
    assert all(res["fma"] > 0 for r, res in zip(recs, results) if r["kernel"] == "_sfa_stats_kernel")


def test_shared_memory_fits_one_sm90_block(compiled):
    recs, results = compiled
    over = [(r["kernel"], r["constexprs"], res["shared"]) for r, res in zip(recs, results)
            if res["shared"] > H100_SHARED_LIMIT]
    assert not over, over

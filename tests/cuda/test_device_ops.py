"""The offload ops' Triton kernels on the device (``dev``: the GPU with ``OFFLOAD_PASSES_GPU=1``, else CPU tensors
under Triton's interpreter) equal their CPU twins (the C++ kernels) bit for bit, on host copies of the same data:

* chained plan -> serve -> install steps with adversarial top-k (-1 sentinels, duplicates, ids beyond the
  length), FIFO and second chance, at a small and at the GLM-5 geometry (K 2048, pool 8192, 512 + 64);
* the baseline gather over two steps (the second reuses the first step's ledger), block size 1 and 4;
* ``dsa_serve`` on plans of all hits, all misses of sequential rows and all misses of random rows: on a GPU
  the misses read pinned host caches over the host link (the zero-copy path the ``serve`` timing measures);
* ``torch.library.opcheck`` (schema, fake kernel, dispatch) with tensors on ``dev``: on a GPU the CUDA
  kernels; on a CPU the same calls check the CPU kernels (tests/ops has more cases of those).

Data is generated on ``dev`` (``torch.Generator(device=...)``); the twins get host copies. The many random
small cases of each kernel are ``test_cuda_kernels.py`` (CPU tensors only).
"""
from __future__ import annotations

import pytest
import torch

from _device import on, same, twin
from _harness import gen, randn

pytestmark = pytest.mark.device

GEOMETRIES = {"small": dict(B=2, S=1, K=64, PS=32, F=200, D=8, Dr=4, sbs=16),
              "glm5": dict(B=1, S=1, K=2048, PS=8192, F=16384, D=512, Dr=64, sbs=128)}


def op_chain(dev: torch.device, steps: int, B: int, S: int, K: int, PS: int, F: int, D: int, Dr: int, sbs: int,
             second_chance: bool, seed: int = 0) -> str | None:
    """``steps`` chained plan -> serve -> install steps, the Triton kernels on ``dev`` against the CPU twins on host
    copies of the same state. Returns the first differing output, or None."""
    from offload_passes.custom_ops.cuda import dsa_install as CI
    from offload_passes.custom_ops.cuda import dsa_install_sc as CSC
    from offload_passes.custom_ops.cuda import dsa_plan as CP
    from offload_passes.custom_ops.cuda import dsa_serve as CS

    g = gen(dev, seed)
    bf = torch.bfloat16
    mine = dict(pid=torch.full((B, PS), -1, dtype=torch.int32, device=dev),
                i2s=torch.full((B, F), -1, dtype=torch.int32, device=dev),
                lru=torch.zeros(B, PS // 16, dtype=torch.int32, device=dev),
                pkv=torch.zeros(B, PS, D, dtype=bf, device=dev), prope=torch.zeros(B, PS, Dr, dtype=bf, device=dev))
    host = {k: twin(v) for k, v in mine.items()}
    fkv_d, frope_d = randn((B, F, D), dev, g), randn((B, F, Dr), dev, g)
    full_kv, full_rope = twin(fkv_d), twin(frope_d)
    rows = B * S * K
    table = torch.arange(rows // sbs, dtype=torch.int32).view(B * S, K // sbs)
    kw = dict(raw_seq=S, topk=K, selection_block_size=sbs)
    names = ("pkv", "prope", "pid", "i2s", "lru")
    for step in range(steps):
        L = torch.full((B,), 3 * F // 5 + step * (F // 20), dtype=torch.int32)
        tk_d = torch.randint(-1, 3 * F // 5 + F // 10 + step * (F // 20), (B, S, 1, K), generator=g, device=dev,
                             dtype=torch.int32)
        tk_d[..., K // 2:] = tk_d[..., :K // 2]  # duplicates
        tk = twin(tk_d)
        plan, rec, act = torch.ops.custom.dsa_plan(tk, L, host["pid"], host["i2s"], host["lru"], raw_seq=S)
        plan_d, rec_d, act_d = CP.run(tk_d, on(L, dev), mine["pid"], mine["i2s"], mine["lru"], raw_seq=S)
        for name, a, b in (("plan", plan, plan_d), ("records", rec, rec_d), ("actual_seq", act, act_d)):
            if not same(a, b):
                return f"step {step}: dsa_plan {name}"
        sel = [torch.zeros(rows // sbs, sbs, D, dtype=bf), torch.zeros(rows // sbs, sbs, Dr, dtype=bf)]
        sel_d = [on(t, dev) for t in sel]
        torch.ops.custom.dsa_serve(plan, full_kv, full_rope, host["pkv"], host["prope"], *sel, compact_layout=1, **kw)
        CS.run(plan_d, fkv_d, frope_d, mine["pkv"], mine["prope"], *sel_d, compact_layout=1, **kw)
        if not all(same(a, b) for a, b in zip(sel, sel_d)):
            return f"step {step}: dsa_serve selection"
        state, state_d = [host[k] for k in names], [mine[k] for k in names]
        if second_chance:
            torch.ops.offload_ref.dsa_install_sc(plan, rec, *sel, table, *state, metadata_update=1, **kw)
            CSC.run(plan_d, rec_d, *sel_d, on(table, dev), *state_d, metadata_update=1, **kw)
        else:
            torch.ops.custom.dsa_install(rec, *sel, table, *state, metadata_update=1, **kw)
            CI.run(rec_d, *sel_d, on(table, dev), *state_d, metadata_update=1, **kw)
        for k in names:
            if not same(host[k], mine[k]):
                return f"step {step}: install {k}"
    return None


@pytest.mark.parametrize("policy", ["fifo", "second_chance"])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_chained_steps_equal_the_cpu_twins(dev, geometry, policy):
    """Three steps (the GLM-5 geometry under the interpreter: one, the interpreter runs every program in Python)."""
    steps = 1 if geometry == "glm5" and dev.type == "cpu" else 3
    assert op_chain(dev, steps, second_chance=policy == "second_chance", **GEOMETRIES[geometry]) is None


def gather_mismatch(dev: torch.device, K: int, bsz: int, seed: int = 3) -> str | None:
    """The baseline gather's Triton kernels against the C++ kernel, two chained steps (the second reuses the
    first step's ledger); None when equal, else what differs."""
    from offload_passes.custom_ops.cuda import npu_gather_selection_kv_cache as CG

    g = gen(dev, seed)
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
    mine = [on(t, dev) for t in state]
    L = torch.tensor([2 * K * bsz + 5, K * bsz // 2 + 3], dtype=torch.int32)
    qs = torch.full((B,), S, dtype=torch.int32)
    for step in range(2):
        blocks = (int(L.max()) + bsz - 1) // bsz + 2
        tk = torch.randint(-1, blocks, (B, S, 1, K), generator=g, device=dev, dtype=torch.int32)
        tk[..., K // 2:] = tk[..., :K // 2].flip(-1)  # duplicates
        host = (*state, twin(tk), twin(full_rope), twin(full_kv), twin(fbt), L, qs)
        act = torch.ops.custom.npu_gather_selection_kv_cache(*host, selection_topk_block_size=bsz)
        act_d = CG.run(*mine, tk, full_rope, full_kv, fbt, on(L, dev), on(qs, dev), bsz)
        if not same(act, act_d):
            return f"step {step}: actual_seq"
        for name, a, b in zip(("selection_k_rope", "selection_kv_cache", "table", "status"), state, mine):
            if not same(a, b):
                return f"step {step}: {name}"
        L = L + 3
    return None


@pytest.mark.parametrize("K,bsz", [(16, 4), (64, 1)])
def test_gather_two_steps_equal_the_cpu_twin(dev, K, bsz):
    assert gather_mismatch(dev, K, bsz) is None


@pytest.mark.parametrize("kind", ["hits", "misses sequential", "misses random"])
def test_serve_plan_kinds_equal_the_cpu_twin(dev, kind):
    """The plans the ``serve`` timing uses (``benchmarks/gpu_ops.py``), full caches in (pinned, on a GPU) host
    memory: on a GPU at the GLM-5 widths (B 2, K 2048, pool 8192, 16384 rows), under the interpreter B 2, K 64."""
    from gpu_ops import serve_case, serve_plans

    from offload_passes.custom_ops.cuda import dsa_serve as CS

    g = gen(dev, 0)
    B, K, PS, F, D, Dr, sbs = (2, 2048, 8192, 16384, 512, 64, 128) if dev.type == "cuda" else (2, 64, 64, 256, 8, 4, 16)
    x = serve_case(dev, B, K, PS, F, D, Dr, sbs, g)
    plan = serve_plans(B, K, PS, F, dev, g)[kind]
    CS.run(plan, *x["full"], *x["pool"], *x["sel"], **x["kw"])
    want = [torch.zeros(t.shape, dtype=t.dtype) for t in x["sel"]]
    torch.ops.custom.dsa_serve(twin(plan), *[twin(t) for t in x["full"] + x["pool"]], *want, **x["kw"])
    assert all(same(a, b) for a, b in zip(want, x["sel"]))
    assert not all(bool((t == 0).all()) for t in want)  # rows were placed, not a zero selection on both sides


def _opcheck_cases(dev: torch.device) -> dict:
    g = gen(dev, 5)
    B, S, K, PS, F, D, Dr, sbs = 1, 1, 64, 32, 200, 8, 4, 16
    tk = torch.randint(-1, 130, (B, S, 1, K), generator=g, device=dev, dtype=torch.int32)
    L = torch.tensor([120], dtype=torch.int32, device=dev)
    pid = torch.full((B, PS), -1, dtype=torch.int32, device=dev)
    i2s = torch.full((B, F), -1, dtype=torch.int32, device=dev)
    lru = torch.zeros(B, PS // 16, dtype=torch.int32, device=dev)
    plan, rec, _ = torch.ops.custom.dsa_plan(tk, L, pid, i2s, lru, raw_seq=S)
    fkv, frope = randn((B, F, D), dev, g), randn((B, F, Dr), dev, g)
    pkv = torch.zeros(B, PS, D, dtype=torch.bfloat16, device=dev)
    prope = torch.zeros(B, PS, Dr, dtype=torch.bfloat16, device=dev)
    sel = [torch.zeros(K // sbs, sbs, d, dtype=torch.bfloat16, device=dev) for d in (D, Dr)]
    table = torch.arange(K // sbs, dtype=torch.int32, device=dev).view(1, K // sbs)
    kw = dict(raw_seq=S, topk=K, selection_block_size=sbs)
    keys, values = randn((2, 1, 40, D), dev, g), randn((2, 1, 40, Dr), dev, g)
    pos = torch.tensor([5, 9], device=dev)
    c, r = torch.ops.custom, torch.ops.offload_ref
    return {
        "dsa_plan": (c.dsa_plan.default, (tk, L, pid, i2s, lru), {"raw_seq": S}),
        "dsa_serve": (c.dsa_serve.default, (plan, fkv, frope, pkv, prope, *sel), dict(kw, compact_layout=1)),
        "dsa_serve_functional": (c.dsa_serve_functional.default, (plan, fkv, frope, pkv, prope, *sel),
                                 dict(kw, compact_layout=1)),
        "dsa_install": (c.dsa_install.default, (rec, *sel, table, pkv, prope, pid, i2s, lru), kw),
        "dsa_install_functional": (c.dsa_install_functional.default, (rec, *sel, table, pkv, prope, pid, i2s, lru),
                                   kw),
        "dsa_install_sc": (r.dsa_install_sc.default, (plan, rec, *sel, table, pkv, prope, pid, i2s, lru), kw),
        "static_cache_write_": (r.static_cache_write_.default,
                                (keys, values, pos, randn((2, 1, 2, D), dev, g), randn((2, 1, 2, Dr), dev, g)), {}),
    }


OPCHECK_OPS = ("dsa_plan", "dsa_serve", "dsa_serve_functional", "dsa_install", "dsa_install_functional",
               "dsa_install_sc", "static_cache_write_")


@pytest.mark.parametrize("name", OPCHECK_OPS)
def test_opcheck_on_the_device(dev, name):
    op, args, kwargs = _opcheck_cases(dev)[name]
    assert {a.device.type for a in args} == {dev.type}
    res = torch.library.opcheck(op, [a.clone() for a in args], kwargs)
    assert {k: v for k, v in res.items() if v != "SUCCESS"} == {}

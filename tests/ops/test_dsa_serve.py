"""custom::dsa_serve / dsa_serve_functional: C++ kernel vs reference (bit-exact), semantics, validation,
opcheck, functionalization (ours and PyTorch's auto-functionalization)."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from offload_passes.custom_ops import _library as Lib
from offload_passes.custom_ops import dsa_serve as M

serve = torch.ops.custom.dsa_serve.default
serve_f = torch.ops.custom.dsa_serve_functional.default


@pytest.fixture(scope="module", autouse=True)
def cpp_kernel(force_cpp_kernels):
    """Build (or load from the ninja cache) the C++ kernel once; this module tests the C++ path."""
    return Lib.cpu_op("dsa_serve")


@pytest.fixture
def one_thread():
    """Bulk comparisons run single-threaded: on a shared 2-core box each intra-op thread hand-off of
    the many small reference ops can cost a scheduler slice (test_parallel_chunks_match covers the
    multi-threaded kernel)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------------------------
# input generation
# --------------------------------------------------------------------------------------------

def _rint(lo: int, hi: int, g: torch.Generator) -> int:
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def bits(shape, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs, infs, denormals included): a copy kernel must move them untouched."""
    return torch.randint(-(2 ** 15), 2 ** 15, shape, generator=g, dtype=torch.int16).view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def random_plan(rows: int, PS: int, F: int, g: torch.Generator) -> torch.Tensor:
    """All six kinds plus unknown kinds, with in-range and out-of-range values for every kind."""
    kind = torch.randint(-2, 8, (rows,), generator=g, dtype=torch.int32)
    u = torch.rand(rows, generator=g)
    in_pool = torch.randint(0, PS, (rows,), generator=g, dtype=torch.int32)
    in_full = torch.randint(0, F, (rows,), generator=g, dtype=torch.int32)
    wild = torch.randint(-(2 ** 31), 2 ** 31 - 1, (rows,), generator=g, dtype=torch.int32)
    edge = torch.tensor([-1, PS, F, PS - 1, F - 1, 2 ** 31 - 1], dtype=torch.int32)
    edge = edge[torch.randint(0, edge.numel(), (rows,), generator=g)]
    val = torch.where(kind == 1, in_pool, in_full)
    val = torch.where(u < 0.08, wild, torch.where(u < 0.16, edge, val))
    return torch.stack([kind, val], 1).contiguous()


def make_case(seed: int, dtype: torch.dtype, compact: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    if compact:
        B, S = _rint(1, 8, g), _rint(1, 4, g)
        K = [64, 512, 2048][_rint(0, 2, g)]
        sbs = [16, 32, 64, 128][_rint(0, 3, g)]
        sbs = min(sbs, K)
        PS = [256, 8192, 16384][_rint(0, 2, g)]
        F = _rint(1, 3000, g)
        while B * S * K > 16384:  # keep the suite fast: every B, S and K occurs, not all at once
            B = max(1, B // 2)
            S = max(1, S // 2) if B == 1 else S
        nb = B * S * K // sbs
    else:
        K = 8 * _rint(1, 8, g)
        S = _rint(1, 4, g)
        B = _rint(1, min(16, 256 // (S * K)), g)
        sbs = [16, 32, 64, 128][_rint(0, 3, g)]
        PS = _rint(1, 256, g)
        F = _rint(1, 512, g)
        nb = B * S * K
    Dkv, Dr = _rint(1, 24, g), _rint(1, 8, g)
    rows = B * S * K
    return dict(
        plan=random_plan(rows, PS, F, g),
        full_kv=bits((B, F, Dkv), dtype, g), full_rope=bits((B, F, Dr), dtype, g),
        pool_kv=bits((B, PS, Dkv), dtype, g), pool_rope=bits((B, PS, Dr), dtype, g),
        sel_kv=bits((nb, sbs, Dkv), dtype, g), sel_rope=bits((nb, sbs, Dr), dtype, g),
        kw=dict(raw_seq=S, topk=K, selection_block_size=sbs, compact_layout=compact),
    )


def args_of(c: dict, sel_kv=None, sel_rope=None) -> tuple:
    return (c["plan"], c["full_kv"], c["full_rope"], c["pool_kv"], c["pool_rope"],
            c["sel_kv"] if sel_kv is None else sel_kv, c["sel_rope"] if sel_rope is None else sel_rope)


def ref_args(c: dict) -> tuple:
    kw = c["kw"]
    return (kw["raw_seq"], kw["topk"], kw["selection_block_size"], kw["compact_layout"])


def small_case(dtype=torch.bfloat16, B=2, S=2, K=64, sbs=16, PS=32, F=40, Dkv=8, Dr=4, seed=0, compact=1) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = B * S * K
    nb = rows // sbs if compact else rows
    kind = torch.tensor([1, 2, 3, 0, 4, 5], dtype=torch.int32)[torch.randint(0, 6, (rows,), generator=g)]
    val = torch.where(kind == 1, torch.randint(0, PS, (rows,), generator=g),
                      torch.randint(0, F, (rows,), generator=g)).to(torch.int32)
    return dict(
        plan=torch.stack([kind, val], 1).contiguous(),
        full_kv=bits((B, F, Dkv), dtype, g), full_rope=bits((B, F, Dr), dtype, g),
        pool_kv=bits((B, PS, Dkv), dtype, g), pool_rope=bits((B, PS, Dr), dtype, g),
        sel_kv=bits((nb, sbs, Dkv), dtype, g), sel_rope=bits((nb, sbs, Dr), dtype, g),
        kw=dict(raw_seq=S, topk=K, selection_block_size=sbs, compact_layout=compact),
    )


# --------------------------------------------------------------------------------------------
# C++ vs reference
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compact", [1, 0])
def test_cpp_matches_reference_bit_exact(dtype, compact, one_thread):
    n_cases = 70 if compact else 30  # 200 cases over the four parametrisations
    for i in range(n_cases):
        seed = 1000 * compact + 100000 * (dtype == torch.float16) + i
        c = make_case(seed, dtype, compact)
        kv_ref, rope_ref = c["sel_kv"].clone(), c["sel_rope"].clone()
        M.reference_dsa_serve(*args_of(c, kv_ref, rope_ref), *ref_args(c))
        kv, rope = c["sel_kv"].clone(), c["sel_rope"].clone()
        serve(*args_of(c, kv, rope), **c["kw"])
        assert same_bits(kv, kv_ref), f"selection_kv_cache differs, seed {seed}, {c['kw']}"
        assert same_bits(rope, rope_ref), f"selection_k_rope differs, seed {seed}, {c['kw']}"
        fkv, frope = serve_f(*args_of(c), **c["kw"])
        assert same_bits(fkv, kv_ref) and same_bits(frope, rope_ref), f"functional differs, seed {seed}"


def test_parallel_chunks_match():
    """Production-sized plan (many row chunks, several threads) equals the reference."""
    g = torch.Generator().manual_seed(99)
    B, S, K, sbs, PS, F, D, Dr = 2, 4, 2048, 128, 8192, 4096, 16, 4
    rows = B * S * K
    c = dict(
        plan=random_plan(rows, PS, F, g),
        full_kv=bits((B, F, D), torch.bfloat16, g), full_rope=bits((B, F, Dr), torch.bfloat16, g),
        pool_kv=bits((B, PS, D), torch.bfloat16, g), pool_rope=bits((B, PS, Dr), torch.bfloat16, g),
        sel_kv=bits((rows // sbs, sbs, D), torch.bfloat16, g), sel_rope=bits((rows // sbs, sbs, Dr), torch.bfloat16, g),
        kw=dict(raw_seq=S, topk=K, selection_block_size=sbs, compact_layout=1),
    )
    kv_ref, rope_ref = c["sel_kv"].clone(), c["sel_rope"].clone()
    M.reference_dsa_serve(*args_of(c, kv_ref, rope_ref), *ref_args(c))
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        kv, rope = c["sel_kv"].clone(), c["sel_rope"].clone()
        serve(*args_of(c, kv, rope), **c["kw"])
    finally:
        torch.set_num_threads(n)
    assert same_bits(kv, kv_ref) and same_bits(rope, rope_ref)


# --------------------------------------------------------------------------------------------
# semantics (independent of the reference)
# --------------------------------------------------------------------------------------------

def test_semantics_hand_built_plan():
    B, S, K, sbs, PS, F, D, Dr = 1, 1, 16, 16, 4, 6, 3, 2
    full_kv = torch.arange(B * F * D, dtype=torch.float32).view(B, F, D).to(torch.bfloat16) + 100
    full_rope = torch.arange(B * F * Dr, dtype=torch.float32).view(B, F, Dr).to(torch.bfloat16) + 100
    pool_kv = -torch.arange(1, B * PS * D + 1, dtype=torch.float32).view(B, PS, D).to(torch.bfloat16)
    pool_rope = -torch.arange(1, B * PS * Dr + 1, dtype=torch.float32).view(B, PS, Dr).to(torch.bfloat16)
    plan = torch.tensor(
        [[1, 2], [2, 5], [3, 0], [0, -1], [4, 3], [5, -7], [1, 4], [1, -1], [2, 6], [3, -2],
         [7, 1], [-1, 1], [1, 0], [2, 2**31 - 1], [3, 5], [1, 3]], dtype=torch.int32)
    expect_src = [("p", 2), ("f", 5), ("f", 0), None, None, None, None, None, None, None,
                  None, None, ("p", 0), None, ("f", 5), ("p", 3)]
    sel_kv = torch.full((1, sbs, D), 7.0, dtype=torch.bfloat16)
    sel_rope = torch.full((1, sbs, Dr), 7.0, dtype=torch.bfloat16)
    serve(plan, full_kv, full_rope, pool_kv, pool_rope, sel_kv, sel_rope, raw_seq=S, topk=K,
          selection_block_size=sbs, compact_layout=1)
    for q, src in enumerate(expect_src):
        if src is None:
            want_kv, want_rope = torch.zeros(D, dtype=torch.bfloat16), torch.zeros(Dr, dtype=torch.bfloat16)
        elif src[0] == "p":
            want_kv, want_rope = pool_kv[0, src[1]], pool_rope[0, src[1]]
        else:
            want_kv, want_rope = full_kv[0, src[1]], full_rope[0, src[1]]
        assert torch.equal(sel_kv[0, q], want_kv), q
        assert torch.equal(sel_rope[0, q], want_rope), q
    # zero fill is the all-zero bit pattern (+0.0), not -0.0
    assert int(sel_kv[0, 3].view(torch.int16).abs().sum()) == 0


def test_batch_row_selects_its_own_full_and_pool():
    """Plan row q belongs to batch q // (raw_seq*topk); positional layout r*K + k (docs/ops.md §8.1)."""
    B, S, K, sbs, PS, F, D, Dr = 3, 2, 16, 16, 8, 10, 4, 2
    g = torch.Generator().manual_seed(3)
    full_kv, full_rope = bits((B, F, D), torch.bfloat16, g), bits((B, F, Dr), torch.bfloat16, g)
    pool_kv, pool_rope = bits((B, PS, D), torch.bfloat16, g), bits((B, PS, Dr), torch.bfloat16, g)
    ids = torch.randint(0, F, (B, S, K), generator=g, dtype=torch.int32)
    plan = torch.stack([torch.full((B * S * K,), 2, dtype=torch.int32), ids.flatten()], 1)
    nb = B * S * K // sbs
    sel_kv = torch.empty(nb, sbs, D, dtype=torch.bfloat16)
    sel_rope = torch.empty(nb, sbs, Dr, dtype=torch.bfloat16)
    serve(plan, full_kv, full_rope, pool_kv, pool_rope, sel_kv, sel_rope, raw_seq=S, topk=K,
          selection_block_size=sbs)
    flat_kv, flat_rope = sel_kv.view(-1, D), sel_rope.view(-1, Dr)
    for b in range(B):
        for s in range(S):
            for k in range(K):
                r = b * S + s
                assert same_bits(flat_kv[r * K + k], full_kv[b, ids[b, s, k]])
                assert same_bits(flat_rope[r * K + k], full_rope[b, ids[b, s, k]])


def test_compact_overwrites_everything_and_functional_equals_inplace():
    c = small_case(seed=5)
    a_kv, a_rope = c["sel_kv"].clone(), c["sel_rope"].clone()
    b_kv, b_rope = torch.zeros_like(a_kv), torch.zeros_like(a_rope)
    serve(*args_of(c, a_kv, a_rope), **c["kw"])
    serve(*args_of(c, b_kv, b_rope), **c["kw"])
    assert same_bits(a_kv, b_kv) and same_bits(a_rope, b_rope)
    f_kv, f_rope = serve_f(*args_of(c), **c["kw"])
    assert same_bits(f_kv, a_kv) and same_bits(f_rope, a_rope)
    # the functional variant does not touch its inputs
    assert same_bits(c["sel_kv"], small_case(seed=5)["sel_kv"])


def test_legacy_writes_entry_zero_only():
    c = small_case(B=2, S=1, K=32, sbs=16, PS=16, F=20, compact=0, seed=9)
    kv, rope = c["sel_kv"].clone(), c["sel_rope"].clone()
    serve(*args_of(c, kv, rope), **c["kw"])
    assert same_bits(kv[:, 1:], c["sel_kv"][:, 1:]) and same_bits(rope[:, 1:], c["sel_rope"][:, 1:])
    ref_kv, ref_rope = c["sel_kv"].clone(), c["sel_rope"].clone()
    M.reference_dsa_serve(*args_of(c, ref_kv, ref_rope), *ref_args(c))
    assert same_bits(kv, ref_kv) and same_bits(rope, ref_rope)
    f_kv, f_rope = serve_f(*args_of(c), **c["kw"])
    assert same_bits(f_kv, kv) and same_bits(f_rope, rope)


def test_non_contiguous_selection_is_written_back():
    c = small_case(seed=11)
    nb, sbs, D = c["sel_kv"].shape
    Dr = c["sel_rope"].size(2)
    kv = torch.empty(D, sbs, nb, dtype=torch.bfloat16).permute(2, 1, 0)
    rope = torch.empty(Dr, sbs, nb, dtype=torch.bfloat16).permute(2, 1, 0)
    kv.copy_(c["sel_kv"])
    rope.copy_(c["sel_rope"])
    assert not kv.is_contiguous()
    serve(*args_of(c, kv, rope), **c["kw"])
    ref_kv, ref_rope = c["sel_kv"].clone(), c["sel_rope"].clone()
    M.reference_dsa_serve(*args_of(c, ref_kv, ref_rope), *ref_args(c))
    assert same_bits(kv.contiguous(), ref_kv) and same_bits(rope.contiguous(), ref_rope)


def test_reference_mode_env_switch(monkeypatch):
    c = small_case(seed=13)
    kv, rope = c["sel_kv"].clone(), c["sel_rope"].clone()
    serve(*args_of(c, kv, rope), **c["kw"])
    monkeypatch.setenv("OFFLOAD_PASSES_CPU_KERNELS", "reference")
    called = []
    orig = M.reference_dsa_serve
    monkeypatch.setattr(M, "reference_dsa_serve", lambda *a, **k: (called.append(1), orig(*a, **k))[1])
    kv2, rope2 = c["sel_kv"].clone(), c["sel_rope"].clone()
    serve(*args_of(c, kv2, rope2), **c["kw"])
    assert called and same_bits(kv, kv2) and same_bits(rope, rope2)


def test_cpp_entry_point_rejects_unsafe_shapes(cpp_kernel):
    """Direct calls of offload_cpu::dsa_serve never write out of bounds: bad shapes raise; strided tensors are
    served like dense ones."""
    c = small_case(seed=17)
    S, K, sbs = c["kw"]["raw_seq"], c["kw"]["topk"], c["kw"]["selection_block_size"]
    short_kv = c["sel_kv"][:-1].clone()
    short_rope = c["sel_rope"][:-1].clone()
    with pytest.raises(RuntimeError, match="selection buffers hold fewer than plan rows"):
        cpp_kernel(*args_of(c, short_kv, short_rope), S, K, sbs, 1)
    with pytest.raises(RuntimeError, match="plan rows must equal"):
        cpp_kernel(*args_of(c), S + 1, K, sbs, 1)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        cpp_kernel(c["plan"], c["full_kv"].transpose(0, 1), *args_of(c)[2:], S, K, sbs, 1)
    # strided tensors of the right shapes go through dense copies: the same bytes as dense ones
    want = [c["sel_kv"].clone(), c["sel_rope"].clone()]
    cpp_kernel(*args_of(c, *want), S, K, sbs, 1)
    got = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (c["sel_kv"], c["sel_rope"])]
    strided_full = c["full_kv"].transpose(0, 1).contiguous().transpose(0, 1)
    cpp_kernel(c["plan"], strided_full, *args_of(c, *got)[2:], S, K, sbs, 1)
    assert not got[0].is_contiguous() and same_bits(want[0], got[0]) and same_bits(want[1], got[1])


# --------------------------------------------------------------------------------------------
# validation: every limit of docs/ops.md §3.1, violated once
# --------------------------------------------------------------------------------------------

def _prod_case():
    return small_case(B=2, S=1, K=64, sbs=16, PS=32, F=40, Dkv=8, Dr=4, seed=21)


def _legacy_case():
    return small_case(B=2, S=1, K=32, sbs=16, PS=16, F=20, Dkv=8, Dr=4, seed=22, compact=0)


def _with(c, **over):
    c = dict(c)
    c["kw"] = dict(c["kw"])
    for k, v in over.items():
        if k in c["kw"]:
            c["kw"][k] = v
        else:
            c[k] = v
    return c


def _resized(c, name, shape):
    t = c[name]
    return torch.zeros(shape, dtype=t.dtype)


def _bad_cases():
    p, lg = _prod_case(), _legacy_case()
    B, K = 2, 64
    rows = B * K
    out = [
        ("compact_layout", _with(p, compact_layout=2), "compact_layout must be 0 or 1, got 2"),
        ("plan dtype", _with(p, plan=p["plan"].long()), "plan must be int32, got torch.int64"),
        ("payload dtype f32", _with(p, full_kv=p["full_kv"].float()), "full_kv_cache dtype must be float16 or bfloat16, got torch.float32"),
        ("payload dtype mix", _with(p, pool_rope=p["pool_rope"].half()), "pool_k_rope dtype must equal full_kv_cache dtype torch.bfloat16, got torch.float16"),
        ("raw_seq 0", _with(p, raw_seq=0), "raw_seq must be in [1, 4], got 0"),
        ("raw_seq 5", _with(p, raw_seq=5), "raw_seq must be in [1, 4], got 5"),
        ("topk 0", _with(p, topk=0), "topk must be in [1, 2048] for compact_layout=1, got 0"),
        ("topk prod cap", _with(p, topk=4096), "topk must be in [1, 2048] for compact_layout=1, got 4096"),
        ("topk legacy cap", _with(lg, topk=72), "topk must be in [1, 64] for compact_layout=0, got 72"),
        ("topk granularity", _with(p, topk=60), "topk must be a multiple of 8, got 60"),
        ("sbs small", _with(p, selection_block_size=8), "selection_block_size must be a power of two in [16, 128], got 8"),
        ("sbs large", _with(p, selection_block_size=256), "selection_block_size must be a power of two in [16, 128], got 256"),
        ("sbs pow2", _with(p, selection_block_size=48), "selection_block_size must be a power of two in [16, 128], got 48"),
        ("compact divisibility", _with(p, selection_block_size=128), "topk must be a multiple of selection_block_size (128) for compact_layout=1, got 64"),
        ("plan 1-D", _with(p, plan=p["plan"].flatten()), "plan must be 2-D [rows, 2], got shape [256]"),
        ("plan width", _with(p, plan=torch.zeros(rows, 3, dtype=torch.int32)), "plan must be 2-D [rows, 2], got shape [128, 3]"),
        ("plan rows 0", _with(p, plan=torch.zeros(0, 2, dtype=torch.int32)), "plan rows must be > 0, got 0"),
        ("legacy rows cap", _with(lg, plan=torch.zeros(264, 2, dtype=torch.int32)), "plan rows must be <= 256 for compact_layout=0, got 264"),
        ("payload 2-D", _with(p, pool_kv=p["pool_kv"][0]), "pool_kv_cache must be 3-D, got shape [32, 8]"),
        ("batch 0", _with(p, full_kv=_resized(p, "full_kv", (0, 40, 8))), "full_kv_cache.size(0) (batch) must be > 0, got 0"),
        ("legacy batch cap", _with(lg, full_kv=_resized(lg, "full_kv", (17, 20, 8)), plan=torch.zeros(17 * 8, 2, dtype=torch.int32), topk=8), "full_kv_cache.size(0) (batch) must be <= 16 for compact_layout=0, got 17"),
        ("rows mismatch", _with(p, plan=torch.zeros(rows + 16, 2, dtype=torch.int32)), "plan rows must equal batch*raw_seq*topk = 2*1*64, got 144"),
        ("batch mismatch", _with(p, pool_kv=_resized(p, "pool_kv", (3, 32, 8))), "pool_kv_cache.size(0) must equal batch 2, got 3"),
        ("full_seq 0", _with(p, full_kv=_resized(p, "full_kv", (2, 0, 8))), "full_kv_cache.size(1) (full_seq) must be > 0, got 0"),
        ("legacy full_seq cap", _with(lg, full_kv=_resized(lg, "full_kv", (2, 513, 8)), full_rope=_resized(lg, "full_rope", (2, 513, 4))), "full_kv_cache.size(1) (full_seq) must be <= 512 for compact_layout=0, got 513"),
        ("full rope seq", _with(p, full_rope=_resized(p, "full_rope", (2, 41, 4))), "full_k_rope.size(1) must equal full_seq 40, got 41"),
        ("pool size cap", _with(p, pool_kv=_resized(p, "pool_kv", (2, 16385, 8))), "pool_kv_cache.size(1) (pool_size) must be in [1, 16384] for compact_layout=1, got 16385"),
        ("pool size 0", _with(p, pool_kv=_resized(p, "pool_kv", (2, 0, 8))), "pool_kv_cache.size(1) (pool_size) must be in [1, 16384] for compact_layout=1, got 0"),
        ("legacy pool cap", _with(lg, pool_kv=_resized(lg, "pool_kv", (2, 257, 8)), pool_rope=_resized(lg, "pool_rope", (2, 257, 4))), "pool_kv_cache.size(1) (pool_size) must be in [1, 256] for compact_layout=0, got 257"),
        ("pool rope size", _with(p, pool_rope=_resized(p, "pool_rope", (2, 31, 4))), "pool_k_rope.size(1) must equal pool_size 32, got 31"),
        ("kv dim cap", _with(p, full_kv=_resized(p, "full_kv", (2, 40, 513))), "full_kv_cache.size(2) (kv dim) must be in [1, 512], got 513"),
        ("pool kv dim", _with(p, pool_kv=_resized(p, "pool_kv", (2, 32, 9))), "pool_kv_cache.size(2) must equal kv dim 8, got 9"),
        ("rope dim cap", _with(p, full_rope=_resized(p, "full_rope", (2, 40, 129))), "full_k_rope.size(2) (rope dim) must be in [0, 128] (0: no-rope mode), got 129"),
        ("rope dim 0 pool 4", _with(p, full_rope=_resized(p, "full_rope", (2, 40, 0))), "pool_k_rope.size(2) must equal rope dim 0, got 4"),
        ("pool rope dim", _with(p, pool_rope=_resized(p, "pool_rope", (2, 32, 5))), "pool_k_rope.size(2) must equal rope dim 4, got 5"),
        ("sel kv blocks", _with(p, sel_kv=_resized(p, "sel_kv", (9, 16, 8))), "selection_kv_cache must have shape [8, 16, 8] (blocks = ceil(rows/selection_block_size)) for compact_layout=1, got [9, 16, 8]"),
        ("sel rope dim", _with(p, sel_rope=_resized(p, "sel_rope", (8, 16, 5))), "selection_k_rope must have shape [8, 16, 4]"),
        ("legacy sel blocks", _with(lg, sel_kv=_resized(lg, "sel_kv", (4, 16, 8))), "selection_kv_cache must have shape [64, 16, 8] (blocks = rows) for compact_layout=0, got [4, 16, 8]"),
    ]
    return out


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0] if isinstance(c, tuple) else None)
def test_validation_limits(case):
    _, c, msg = case
    for op, name in ((serve, "dsa_serve"), (serve_f, "dsa_serve_functional")):
        with pytest.raises(RuntimeError) as e:
            op(*args_of(c), **c["kw"])
        assert str(e.value).startswith(f"custom::{name}: "), str(e.value)
        assert msg in str(e.value), str(e.value)
    # the fake kernel applies the same checks
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in args_of(c)]
        with pytest.raises(RuntimeError, match="custom::dsa_serve: "):
            serve(*fake, **c["kw"])


def test_valid_limits_accepted():
    """The caps themselves are legal: legacy at 256 rows / B 16 / F 512 / PS 256, prod at K 2048."""
    g = torch.Generator().manual_seed(0)
    B, K = 16, 16
    c = dict(
        plan=random_plan(B * K, 256, 512, g),
        full_kv=bits((B, 512, 4), torch.float16, g), full_rope=bits((B, 512, 128), torch.float16, g),
        pool_kv=bits((B, 256, 4), torch.float16, g), pool_rope=bits((B, 256, 128), torch.float16, g),
        sel_kv=bits((B * K, 16, 4), torch.float16, g), sel_rope=bits((B * K, 16, 128), torch.float16, g),
        kw=dict(raw_seq=1, topk=K, selection_block_size=16, compact_layout=0),
    )
    serve(*args_of(c), **c["kw"])
    c = make_case(7, torch.bfloat16, 1)
    c = _with(c)
    serve(*args_of(c), **c["kw"])


# --------------------------------------------------------------------------------------------
# fake kernels, opcheck, functionalization
# --------------------------------------------------------------------------------------------

def test_fake_kernels_shapes():
    c = small_case(seed=30)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in args_of(c)]
        assert serve(*fake, **c["kw"]) is None
        kv, rope = serve_f(*fake, **c["kw"])
        assert kv.shape == c["sel_kv"].shape and kv.dtype == c["sel_kv"].dtype
        assert rope.shape == c["sel_rope"].shape and rope.stride() == c["sel_rope"].stride()


def _finite(c: dict) -> dict:
    """opcheck compares eager and traced outputs with allclose, which treats NaN != NaN."""
    g = torch.Generator().manual_seed(1)
    for k in ("full_kv", "full_rope", "pool_kv", "pool_rope", "sel_kv", "sel_rope"):
        c[k] = torch.randn(c[k].shape, generator=g).to(c[k].dtype)
    return c


def _opcheck_cases():
    return [
        _finite(small_case(seed=40)),
        _finite(small_case(dtype=torch.float16, B=1, S=4, K=128, sbs=128, PS=256, F=300, Dkv=16, Dr=8, seed=41)),
        _finite(small_case(B=3, S=1, K=16, sbs=16, PS=8, F=10, compact=0, seed=42)),
    ]


@pytest.mark.parametrize("idx", range(3))
def test_opcheck(idx):
    c = _opcheck_cases()[idx]
    torch.library.opcheck(serve, args_of(c), c["kw"])
    torch.library.opcheck(serve_f, args_of(c), c["kw"])


def test_functionalize_maps_to_functional_twin():
    from torch.fx.experimental.proxy_tensor import make_fx

    c = _finite(small_case(seed=50))

    def fn(plan, fkv, frope, pkv, prope, skv, srope):
        serve(plan, fkv, frope, pkv, prope, skv, srope, **c["kw"])
        return skv.float().sum() + srope.float().sum()

    gm = make_fx(torch.func.functionalize(fn, remove="mutations_and_views"))(*args_of(c))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert serve_f in targets and serve not in targets
    kv, rope = c["sel_kv"].clone(), c["sel_rope"].clone()
    out = gm(*args_of(c, kv, rope))
    kv2, rope2 = c["sel_kv"].clone(), c["sel_rope"].clone()
    assert torch.equal(out, fn(*args_of(c, kv2, rope2)))
    assert same_bits(kv, kv2) and same_bits(rope, rope2)  # copy_ epilogue mutated the inputs


def _compile_check_source() -> str:
    return textwrap.dedent(
        """
        import os, torch, offload_passes
        from offload_passes.custom_ops import _library as Lib
        functionalize = os.environ.get("OFFLOAD_PASSES_FUNCTIONALIZE", "1") != "0"
        assert Lib.has_kernel("dsa_serve", "Functionalize") == functionalize
        g = torch.Generator().manual_seed(0)
        B, S, K, sbs, PS, F, D, Dr = 2, 2, 64, 16, 32, 50, 8, 4
        rows = B * S * K
        kind = torch.randint(0, 6, (rows,), generator=g, dtype=torch.int32)
        val = torch.randint(0, 32, (rows,), generator=g, dtype=torch.int32)
        plan = torch.stack([kind, val], 1)
        mk = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)
        fkv, frope, pkv, prope = mk(B, F, D), mk(B, F, Dr), mk(B, PS, D), mk(B, PS, Dr)
        skv0, srope0 = mk(rows // sbs, sbs, D), mk(rows // sbs, sbs, Dr)

        def fn(plan, fkv, frope, pkv, prope, skv, srope):
            torch.ops.custom.dsa_serve(plan, fkv, frope, pkv, prope, skv, srope,
                                       raw_seq=S, topk=K, selection_block_size=sbs)
            return skv.float().sum(dim=(1, 2)) * 2 + srope.float().mean()

        e_kv, e_rope = skv0.clone(), srope0.clone()
        expect = fn(plan, fkv, frope, pkv, prope, e_kv, e_rope)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        c_kv, c_rope = skv0.clone(), srope0.clone()
        got = compiled(plan, fkv, frope, pkv, prope, c_kv, c_rope)
        assert torch.equal(got, expect), (got, expect)
        assert torch.equal(c_kv.view(torch.int16), e_kv.view(torch.int16))
        assert torch.equal(c_rope.view(torch.int16), e_rope.view(torch.int16))
        print("OK", functionalize)
        """
    )


def test_torch_compile_aot_eager_with_our_functionalization():
    ns: dict = {}
    exec(compile(_compile_check_source().replace('print("OK", functionalize)', "RESULT = functionalize"),
                 "<compile_check>", "exec"), ns)
    assert ns["RESULT"] is True


def test_torch_compile_aot_eager_with_pytorch_auto_functionalization():
    """Without our Functionalize kernels (OFFLOAD_PASSES_FUNCTIONALIZE=0) PyTorch auto-functionalizes
    the in-place ops. One fresh process (importing torch twice would double the cost) runs the serve
    check above and the gather op's GATHER_COMPILE_CHECK from its own test module."""
    gather_tests = runpy.run_path(str(Path(__file__).with_name("test_npu_gather_selection_kv_cache.py")))
    code = _compile_check_source() + "\n" + gather_tests["GATHER_COMPILE_CHECK"]
    env = dict(os.environ, OFFLOAD_PASSES_FUNCTIONALIZE="0", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.strip().splitlines()[-2:] == ["OK False", "OK False"]

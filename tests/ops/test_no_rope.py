"""The no-rope mode of the offload ops (Dr = 0, docs/ops.md §3.3): a zero-width rope part.

``dsa_serve`` / ``dsa_install`` / ``dsa_install_sc`` take rope tensors ``[..., 0]`` (CANN's schemas and the
3-D shapes unchanged); the gather takes its 1-D empty form or ``[..., 0]``; the pools are ``[B, PS, 0]``
(tests/ops/test_group_simulation.py runs a no-rope group on the backend's state). Each op in the mode: the C++
kernel equals the reference, the functional twin and ``OFFLOAD_PASSES_CPU_KERNELS=reference``, moves exactly
the kv bytes the same call moves with a rope, passes ``opcheck``, and keeps its shape rules for the rope.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import _gen as G  # noqa: E402
import test_npu_gather_selection_kv_cache as TG  # noqa: E402
from test_dsa_install import plan_case  # noqa: E402
from test_dsa_serve import args_of, small_case  # noqa: E402

from offload_passes.custom_ops import dsa_install as MI  # noqa: E402
from offload_passes.custom_ops import dsa_install_sc as MSC  # noqa: E402
from offload_passes.custom_ops import dsa_serve as MS  # noqa: E402
from offload_passes.custom_ops import npu_gather_selection_kv_cache as MG  # noqa: E402

ops, ref_ops = torch.ops.custom, torch.ops.offload_ref


@pytest.fixture(scope="module", autouse=True)
def cpp(force_cpp_kernels):
    yield


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def zero_width(t: torch.Tensor) -> torch.Tensor:
    """``t``'s shape with a rope width of 0 (no storage)."""
    return t.new_empty((*t.shape[:-1], 0))


def finite(c: dict) -> dict:
    """opcheck compares with allclose (NaN != NaN): finite payloads."""
    g = G.gen(9)
    for k in ("full_kv", "full_rope", "pool_kv", "pool_rope", "sel_kv", "sel_rope"):
        c[k] = torch.randn(c[k].shape, generator=g).to(c[k].dtype)
    return c


@pytest.mark.parametrize("compact", [1, 0])
def test_serve(compact, monkeypatch):
    rope = finite(small_case(seed=60, compact=compact, **({} if compact else dict(B=2, S=1, K=16, PS=8, F=10))))
    c = dict(rope, full_rope=zero_width(rope["full_rope"]), pool_rope=zero_width(rope["pool_rope"]),
             sel_rope=zero_width(rope["sel_rope"]))
    kw = c["kw"]
    with_rope = [rope["sel_kv"].clone(), rope["sel_rope"].clone()]
    ops.dsa_serve(*args_of(rope, *with_rope), **kw)
    got = [c["sel_kv"].clone(), c["sel_rope"].clone()]
    ops.dsa_serve(*args_of(c, *got), **kw)
    assert same(got[0], with_rope[0]) and got[1].shape == c["sel_rope"].shape  # the kv bytes of the rope call
    want = [c["sel_kv"].clone(), c["sel_rope"].clone()]
    MS.reference_dsa_serve(*args_of(c, *want), **kw)
    twin = ops.dsa_serve_functional(*args_of(c), **kw)
    assert all(same(a, b) for a, b in zip(got, want)) and all(same(a, b) for a, b in zip(got, twin))
    monkeypatch.setenv("OFFLOAD_PASSES_CPU_KERNELS", "reference")
    ref_mode = [c["sel_kv"].clone(), c["sel_rope"].clone()]
    ops.dsa_serve(*args_of(c, *ref_mode), **kw)
    assert all(same(a, b) for a, b in zip(got, ref_mode))
    monkeypatch.setenv("OFFLOAD_PASSES_CPU_KERNELS", "cpp")
    torch.library.opcheck(ops.dsa_serve.default, args_of(c), kw)
    torch.library.opcheck(ops.dsa_serve_functional.default, args_of(c), kw)


def _install_args(Dr: int, seed: int = 61):
    rope = plan_case(2, 2, 64, 64, 300, 16, torch.bfloat16, seed=seed, D=(8, 4))
    g = G.gen(seed)
    for i in (1, 2, 4, 5):  # finite payloads for opcheck
        rope[i] = torch.randn(rope[i].shape, generator=g).to(rope[i].dtype)
    if Dr:
        return rope
    return [zero_width(t) if i in (2, 5) else t for i, t in enumerate(rope)]


@pytest.mark.parametrize("mu", [1, 0])
def test_install(mu, monkeypatch):
    kw = dict(raw_seq=2, topk=64, selection_block_size=16, metadata_update=mu)
    with_rope, args = _install_args(4), _install_args(0)
    state_rope = [t.clone() for t in with_rope[4:]]
    ops.dsa_install(*with_rope[:4], *state_rope, **kw)
    got = [t.clone() for t in args[4:]]
    ops.dsa_install(*args[:4], *got, **kw)
    # the same installs (ways, metadata, kv rows) as with a rope
    assert all(same(a, b) for i, (a, b) in enumerate(zip(got, state_rope)) if i != 1)
    assert got[1].shape == (2, 64, 0)
    want = [t.clone() for t in args[4:]]
    MI.reference_dsa_install(*args[:4], *want, **kw)
    twin = ops.dsa_install_functional(*args, **kw)
    assert all(same(a, b) for a, b in zip(got, want)) and all(same(a, b) for a, b in zip(got, twin))
    monkeypatch.setenv("OFFLOAD_PASSES_CPU_KERNELS", "reference")
    ref_mode = [t.clone() for t in args[4:]]
    ops.dsa_install(*args[:4], *ref_mode, **kw)
    assert all(same(a, b) for a, b in zip(got, ref_mode))
    monkeypatch.setenv("OFFLOAD_PASSES_CPU_KERNELS", "cpp")
    torch.library.opcheck(ops.dsa_install.default, tuple(args[:4]) + tuple(t.clone() for t in args[4:]), kw)
    torch.library.opcheck(ops.dsa_install_functional.default, tuple(args), kw)


def test_install_second_chance():
    kw = dict(raw_seq=2, topk=64, selection_block_size=16, metadata_update=1)
    with_rope, args = _install_args(4, seed=62), _install_args(0, seed=62)
    B, S, K = 2, 2, 64
    plan = torch.stack([torch.randint(0, 6, (B * S * K,), generator=G.gen(3), dtype=torch.int32),
                        torch.randint(-1, 64, (B * S * K,), generator=G.gen(4), dtype=torch.int32)], 1)
    state_rope = [t.clone() for t in with_rope[4:]]
    ref_ops.dsa_install_sc(plan, *with_rope[:4], *state_rope, **kw)
    got = [t.clone() for t in args[4:]]
    ref_ops.dsa_install_sc(plan, *args[:4], *got, **kw)
    assert all(same(a, b) for i, (a, b) in enumerate(zip(got, state_rope)) if i != 1)
    want = [t.clone() for t in args[4:]]
    MSC.reference_dsa_install_sc(plan, *args[:4], *want, **kw)
    assert all(same(a, b) for a, b in zip(got, want))
    torch.library.opcheck(ref_ops.dsa_install_sc.default, (plan, *args[:4], *[t.clone() for t in args[4:]]), kw)


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_gather_zero_width_rope_equals_its_1d_form(layout):
    """The gather's no-rope mode in both forms: 1-D empty rope tensors (CANN's int8 form) or ``[..., 0]``."""
    one_d = TG._finite(TG.Case(70, K=64, B=2, S=2, bsz=1, dtype=torch.bfloat16, no_rope=True, layout=layout,
                               D=4, Dr=2))
    one_d.L = one_d.L.clamp(min=1)
    zero = TG._finite(TG.Case(70, K=64, B=2, S=2, bsz=1, dtype=torch.bfloat16, no_rope=False, layout=layout,
                              D=4, Dr=0))
    zero.L, zero.sel_kv, zero.full_kv = one_d.L, one_d.sel_kv, one_d.full_kv
    assert zero.sel_rope.shape[-1] == 0 and one_d.sel_rope.dim() == 1
    for _ in range(2):  # the second step reuses the ledger
        tk = one_d.next_topk()
        zero.prev = tk
        a_1d = TG.run_both(one_d, tk, "1-D")
        st_z = zero.clone_state()
        a_z = ops.npu_gather_selection_kv_cache(*zero.args(tk, st_z), selection_topk_block_size=1)
        st_r = zero.clone_state()
        a_r = MG.reference_npu_gather_selection_kv_cache(*zero.args(tk, st_r), 1)
        twin = ops.npu_gather_selection_kv_cache_functional(*zero.args(tk), selection_topk_block_size=1)
        assert torch.equal(a_z, a_1d) and torch.equal(a_z, a_r) and torch.equal(a_z, twin[0])
        assert same(st_z[1], one_d.sel_kv) and torch.equal(st_z[2], one_d.status)
        assert same(st_z[1], st_r[1]) and torch.equal(st_z[2], st_r[2]) and same(st_z[1], twin[2])
        zero.sel_rope, zero.sel_kv, zero.status = st_z
        one_d.advance()
        zero.L = one_d.L
    tk = one_d.next_topk()
    torch.library.opcheck(ops.npu_gather_selection_kv_cache.default, zero.args(tk), {"selection_topk_block_size": 1})
    torch.library.opcheck(ops.npu_gather_selection_kv_cache_functional.default, zero.args(tk),
                          {"selection_topk_block_size": 1})


def test_rope_shape_rules_hold_without_a_rope():
    """A zero-width rope still has its batch, sequence and block dims, checked with the same messages."""
    c = small_case(seed=63)
    c = dict(c, full_rope=zero_width(c["full_rope"]), pool_rope=zero_width(c["pool_rope"]),
             sel_rope=zero_width(c["sel_rope"]))
    bad = [(dict(full_rope=torch.empty(2, 41, 0, dtype=torch.bfloat16)), "full_k_rope.size(1) must equal full_seq 40, got 41"),
           (dict(pool_rope=torch.empty(2, 16, 0, dtype=torch.bfloat16)), "pool_k_rope.size(1) must equal pool_size 32, got 16"),
           (dict(sel_rope=torch.empty(8, 16, 1, dtype=torch.bfloat16)), "selection_k_rope must have shape [16, 16, 0]"),
           (dict(pool_rope=torch.empty(2, 32, 1, dtype=torch.bfloat16)), "pool_k_rope.size(2) must equal rope dim 0, got 1"),
           (dict(sel_rope=torch.empty(16, 16, 0, dtype=torch.float16)), "selection_k_rope dtype must equal full_kv_cache dtype")]
    for change, msg in bad:
        with pytest.raises(RuntimeError) as e:
            ops.dsa_serve(*args_of(dict(c, **change)), **c["kw"])
        assert str(e.value).startswith("custom::dsa_serve: ") and msg in str(e.value), str(e.value)
    args = _install_args(0)
    for i, t, msg in ((2, torch.empty(8, 32, 0, dtype=torch.bfloat16), "selection_k_rope dims 0,1 must equal"),
                      (5, torch.empty(2, 32, 0, dtype=torch.bfloat16), "pool_k_rope must be [B=2, PS=64, Dr]")):
        a = list(args)
        a[i] = t
        with pytest.raises(RuntimeError) as e:
            ops.dsa_install(*a, raw_seq=2, topk=64, selection_block_size=16)
        assert msg in str(e.value), str(e.value)

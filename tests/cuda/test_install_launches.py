"""Launches per install (``custom_ops/cuda/dsa_install.py``) and per baseline gather
(``custom_ops/cuda/npu_gather_selection_kv_cache.py``), counted on CPU under Triton's interpreter.

Every Triton kernel of the module is wrapped by a counting launcher (TEST DOUBLE of the CUDA launch: it
counts, then runs the interpreted kernel); every ATen op the launcher dispatches outside a kernel is counted
by a ``TorchDispatchMode``, except views and metadata ops (no kernel on a device). On a GPU each counted
ATen op is at least one launch (``torch.sort`` is several: CUB's radix sort passes), so the totals are a
lower bound of the device launches, the same bound before and after a change.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import _gen as G
import test_npu_gather_selection_kv_cache as TG
import test_properties as TP

#: ATen ops that launch nothing (views, metadata): not counted
NO_LAUNCH = {"aten::detach", "aten::alias", "aten::lift_fresh", "aten::empty", "aten::empty_strided",
             "aten::empty_like", "aten::split_with_sizes", "aten::split", "aten::_to_copy_noop"}


class _Counting(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view and func._schema.name not in NO_LAUNCH:
            self.counts["aten:" + func._schema.name.split("::")[1]] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counted_launches(module, host_checks=()):
    """Count the Triton launches of ``module``'s kernels and the ATen ops around them; each ``(owner, name)``
    of ``host_checks`` is counted as one call (``host:<name>``), its own ATen ops not counted."""
    counts: Counter = Counter()
    mode = _Counting(counts)
    originals = {}

    class _Launcher:  # TEST DOUBLE of a CUDA kernel launch: counts, then runs the interpreted kernel
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def go(*args, **kwargs):
                counts["triton:" + self.name] += 1
                mode.paused = True
                try:
                    return self.kernel[grid](*args, **kwargs)
                finally:
                    mode.paused = False
            return go

    def host(owner, name, fn):
        def go(*args, **kwargs):
            counts["host:" + name] += 1
            mode.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                mode.paused = False
        return go

    for owner, name in host_checks:
        originals[(owner, name)] = getattr(owner, name)
        setattr(owner, name, host(owner, name, originals[(owner, name)]))
    for name in dir(module):
        obj = getattr(module, name)
        if name.startswith("_") and name.endswith("_kernel") and hasattr(obj, "__getitem__"):
            originals[name] = obj
            setattr(module, name, _Launcher(name, obj))
    try:
        with mode:
            yield counts
    finally:
        for name, obj in originals.items():
            owner, attr = name if isinstance(name, tuple) else (module, name)
            setattr(owner, attr, obj)


def _case(mu: int):
    c = dict(B=2, S=1, K=64, PS=32, IR=96, sbs=16, L=[80, 60], F=90, seed=7, fill=1.0, hole=0.0, dup=0.5,
             future=0.0, beyond=False, garbage=False, pool_fill=0.5, D=8, Dr=4, dtype=torch.bfloat16, mu=mu)
    L, tk, pid, i2s, lru, fkv, frope, pkv, prope = TP._make_step(c)
    plan, rec, _ = torch.ops.custom.dsa_plan.default(tk, L, pid, i2s, lru, raw_seq=1)
    g = G.gen(9)
    rows = 64 * 2
    sel = [G.payload((rows // 16, 16, 8), torch.bfloat16, g), G.payload((rows // 16, 16, 4), torch.bfloat16, g)]
    table = torch.arange(rows // 16, dtype=torch.int32).view(2, 4)
    kw = dict(raw_seq=1, topk=64, selection_block_size=16, metadata_update=mu)
    return plan, rec, sel, table, [pkv, prope, pid, i2s, lru], kw


#: launches per install: one scratch fill, [the second-chance pre-pass], first, candidates, the device sort,
#: assign, keys, apply (the launcher before this layout: 15 FIFO / 17 second chance, with separate fills of
#: the first-occurrence words and the reference bits and a scatter_add / cumsum chain for the set lists)
WANT = {
    "fifo": {"aten:full": 1, "triton:_first_kernel": 1, "triton:_cand_kernel": 1, "aten:sort": 1,
             "triton:_assign_kernel": 1, "triton:_keys_kernel": 1, "triton:_apply_kernel": 1},
}
WANT["sc"] = dict(WANT["fifo"], **{"triton:_ref_kernel": 1})


@pytest.mark.parametrize("policy", ["fifo", "sc"])
def test_launches_per_install(triton_interpreted, policy, monkeypatch):
    from offload_passes.custom_ops import dsa_install as MI, dsa_install_sc as MS
    from offload_passes.custom_ops.cuda import dsa_install, dsa_install_sc

    plan, rec, sel, table, state, kw = _case(1)
    checks = Counter()
    for mod, name in ((MI, "validate_dsa_install"), (MS, "validate_dsa_install_sc")):
        orig = getattr(mod, name)

        def counted(*a, _orig=orig, _name=name, **k):
            checks[_name] += 1
            return _orig(*a, **k)
        monkeypatch.setattr(mod, name, counted)
    if policy == "sc":
        run, op = (lambda st: dsa_install_sc.run(plan, rec, *sel, table, *st, **kw),
                   lambda st: torch.ops.offload_ref.dsa_install_sc.default(plan, rec, *sel, table, *st, **kw))
    else:
        run, op = (lambda st: dsa_install.run(rec, *sel, table, *st, **kw),
                   lambda st: torch.ops.custom.dsa_install.default(rec, *sel, table, *st, **kw))
    want = [t.clone() for t in state]
    op(want)
    first = [t.clone() for t in state]
    run(first)
    n_checks = sum(checks.values())
    fresh = [t.clone() for t in state]
    with counted_launches(dsa_install) as counts:
        run(fresh)
    assert dict(counts) == WANT[policy]
    assert sum(checks.values()) == n_checks  # validated once per signature, not per launch
    for a, b, c in zip(want, first, fresh):  # equal to the C++ kernel, both calls
        assert torch.equal(a.view(torch.int16) if a.is_floating_point() else a,
                           b.view(torch.int16) if b.is_floating_point() else b)
        assert torch.equal(b.view(torch.int16) if b.is_floating_point() else b,
                           c.view(torch.int16) if c.is_floating_point() else c)


#: launches per gather: one fill of the int32 scratch, actual_seq, the block-table checks and their report, the
#: ledger, the copies [, the K <= 32 swap]. The block-table bounds are checked on the device (the C++ kernel's
#: messages through an error record), so nothing runs on the host (a host check is a synchronisation per call
#: on a GPU, custom_ops/cuda/npu_gather_selection_kv_cache.py)
WANT_GATHER = {"aten:full": 1, "aten:zeros": 1, "triton:_check_kernel": 1, "triton:_report_kernel": 1,
               "triton:_ledger_kernel": 1, "triton:_copy_kernel": 1}


@pytest.mark.parametrize("K,bsz", [(64, 1), (16, 4)])
def test_launches_per_gather(triton_interpreted, K, bsz):
    from offload_passes.custom_ops.cuda import npu_gather_selection_kv_cache as CG

    case = TG.Case(5, K=K, B=2, S=2, bsz=bsz, dtype=torch.bfloat16, no_rope=False, layout="BSND", D=4, Dr=2)
    tk = case.next_topk(hole=0.0, dup=0.5, future=0.0)
    want = case.clone_state()
    act_c = torch.ops.custom.npu_gather_selection_kv_cache.default(*case.args(tk, want), selection_topk_block_size=bsz)
    CG.run(*case.args(tk, case.clone_state()), bsz)  # the first call also validates and makes the error words
    got = case.clone_state()
    with counted_launches(CG, host_checks=[(CG.M, "_check_tables")]) as counts:  # never called: 0
        act_t = CG.run(*case.args(tk, got), bsz)
    small = dict(WANT_GATHER, **{"triton:_swap_kernel": 1}) if K <= 32 else WANT_GATHER
    assert dict(counts) == small
    assert torch.equal(act_c, act_t)
    for a, b in zip(want, got):
        assert torch.equal(a.view(torch.int16) if a.is_floating_point() else a,
                           b.view(torch.int16) if b.is_floating_point() else b)

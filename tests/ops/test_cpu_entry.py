"""The C++ CPU entry of the ops with a C++ kernel (``custom_ops/csrc/_entry.cpp``, docs/ops.md §13).

``custom::<op>`` on CPU runs the bare kernel directly for a call signature whose validation passed before,
and the op's Python path (``offload_cpu::<op>_checked``: bind, ``validate_<op>``, run) otherwise. Checked
here: a signature is validated once and never again, failures are never remembered, every bad call keeps
its message, the data-dependent checks of the kernels still run on remembered signatures, the reference
mode and the plan observers take the Python path, and the op's column of ``benchmarks/bench_ops.py`` is
the bare kernel's.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import _gen as G  # noqa: E402
import test_npu_gather_selection_kv_cache as TG  # noqa: E402

from offload_passes.custom_ops import OP_SPECS, spec_for  # noqa: E402
from offload_passes.custom_ops import _library as Lib  # noqa: E402
from offload_passes.custom_ops import dsa_plan as MP  # noqa: E402
from offload_passes.custom_ops import dsa_serve as MS  # noqa: E402

plan_op = torch.ops.custom.dsa_plan.default
serve_op = torch.ops.custom.dsa_serve.default
gather_op = torch.ops.custom.npu_gather_selection_kv_cache.default

#: every op with a C++ kernel (csrc/<op>.cpp) has the C++ entry in this process (the prebuilt library)
WITH_KERNEL = {"custom::dsa_plan", "custom::dsa_serve", "custom::dsa_install", "custom::npu_gather_selection_kv_cache",
               "offload_ref::dsa_install_sc"}


@pytest.fixture(autouse=True)
def cpp_mode(force_cpp_kernels):
    Lib.load_cpu_kernels()


def signatures(spec) -> int:
    return int(torch.ops.offload_cpu._checked_signatures(spec.qualname))


def test_every_op_with_a_kernel_runs_through_its_entry():
    assert {s.qualname for s in OP_SPECS if Lib.has_cpu_entry(s)} == WITH_KERNEL
    for q in WITH_KERNEL:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(q, "CPU")
        name = q.split("::")[1]
        # the bare kernel and the checked path take the op's arguments first, in order
        op_args = [a.name for a in spec_for(q).parsed.arguments]
        for other in (name, f"{name}_checked"):
            got = [a.name for a in getattr(torch.ops.offload_cpu, other).default._schema.arguments]
            assert got[: len(op_args)] == op_args, other


def _plan_inputs(B=2, S=1, K=64, PS=32, IR=200, seed=0):
    g = G.gen(seed)
    L = G.lengths(B, S, K, g, lo=K, hi=IR)
    tk = G.topk(L, S, K, g)
    pid, i2s, lru = G.pool_state(B, PS, IR, g, fill=0.5, prefer=tk)
    return tk, L, pid, i2s, lru


def test_a_signature_is_validated_once(monkeypatch):
    spec = MP.SPEC
    args = _plan_inputs(B=3, K=128, seed=1)  # a signature no other test of this module uses
    want = MP.reference_dsa_plan(*args, raw_seq=1)
    calls = []
    orig = MP.validate_dsa_plan
    monkeypatch.setattr(MP, "validate_dsa_plan", lambda *a, **k: (calls.append(1), orig(*a, **k))[1])
    before = signatures(spec)
    for _ in range(3):
        got = plan_op(*args, raw_seq=1)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert len(calls) == 1 and signatures(spec) == before + 1
    # another value of a non-tensor argument, another contiguity: new signatures
    plan_op(*args, raw_seq=1, group_id=5)
    strided = args[0].transpose(0, 3).contiguous().transpose(0, 3)
    plan_op(strided, *args[1:], raw_seq=1)
    assert len(calls) == 3 and signatures(spec) == before + 3
    plan_op(strided, *args[1:], raw_seq=1)
    assert len(calls) == 3


def test_failures_are_never_remembered():
    spec = MP.SPEC
    tk, L, pid, i2s, lru = _plan_inputs()
    before = signatures(spec)
    for _ in range(2):  # the same bad signature twice: the same message both times
        with pytest.raises(RuntimeError, match=r"^custom::dsa_plan: raw_seq must be in \[1, 4\], got 5$"):
            plan_op(tk, L, pid, i2s, lru, raw_seq=5)
    assert signatures(spec) == before


def test_data_checks_run_for_a_remembered_signature():
    """The block-table entries the gather dereferences are checked by the kernel, on every call."""
    case = TG.Case(3, K=64, B=2, S=1, bsz=1, dtype=torch.bfloat16, no_rope=False, layout="BSND", D=4, Dr=2)
    tk = case.next_topk()
    gather_op(*case.args(tk, case.clone_state()), selection_topk_block_size=1)
    gather_op(*case.args(tk, case.clone_state()), selection_topk_block_size=1)  # the signature is known now
    case.fbt[:] = 10 ** 6
    state = case.clone_state()
    before = [t.clone() for t in state]
    with pytest.raises(RuntimeError, match=r"^custom::npu_gather_selection_kv_cache: full_kv_block_table\[\d\] "):
        gather_op(*case.args(tk, state), selection_topk_block_size=1)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(state[:2], before[:2]))
    assert torch.equal(state[2], before[2])


def test_reference_mode_takes_the_python_path(monkeypatch):
    c = dict(B=2, S=1, K=64, sbs=16)
    g = G.gen(5)
    tk, L, pid, i2s, lru = _plan_inputs(seed=5)
    plan, _, _ = plan_op(tk, L, pid, i2s, lru, raw_seq=1)
    rows = c["B"] * c["K"]
    fkv, frp = G.payload((2, 300, 8), torch.bfloat16, g), G.payload((2, 300, 4), torch.bfloat16, g)
    pkv, prp = G.payload((2, 32, 8), torch.bfloat16, g), G.payload((2, 32, 4), torch.bfloat16, g)
    outs = [torch.zeros(rows // 16, 16, d, dtype=torch.bfloat16) for d in (8, 4)]
    kw = dict(raw_seq=1, topk=64, selection_block_size=16)
    serve_op(plan, fkv, frp, pkv, prp, *outs, **kw)  # the signature is remembered
    called = []
    orig = MS.reference_dsa_serve
    monkeypatch.setattr(MS, "reference_dsa_serve", lambda *a, **k: (called.append(1), orig(*a, **k))[1])
    monkeypatch.setenv("OFFLOAD_PASSES_CPU_KERNELS", " Reference ")
    again = [torch.zeros_like(t) for t in outs]
    serve_op(plan, fkv, frp, pkv, prp, *again, **kw)
    assert called == [1] and all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(outs, again))
    monkeypatch.setenv("OFFLOAD_PASSES_CPU_KERNELS", "gpu")  # neither mode: the Python path names the variable
    with pytest.raises(RuntimeError, match="OFFLOAD_PASSES_CPU_KERNELS must be 'cpp' or 'reference', got 'gpu'"):
        serve_op(plan, fkv, frp, pkv, prp, *again, **kw)


def test_plan_observers_see_every_call():
    """An observer of dsa_plan (trace recording) turns the entry's shortcut off while it is registered."""
    args = _plan_inputs(seed=6)
    plan_op(*args, raw_seq=1)  # remembered
    seen = []

    def observer(topk, lengths, pool_ids, raw_seq):
        seen.append((topk.data_ptr(), raw_seq))

    MP.add_plan_observer(observer)
    try:
        plan_op(*args, raw_seq=1)
        plan_op(*args, raw_seq=1)
    finally:
        MP.remove_plan_observer(observer)
    assert seen == [(args[0].data_ptr(), 1)] * 2
    plan_op(*args, raw_seq=1)
    assert len(seen) == 2 and MP.PLAN_OBSERVERS == []
    with pytest.raises(ValueError):
        MP.remove_plan_observer(observer)


def test_bare_kernel_checks_keep_direct_calls_safe():
    """The bare kernels behind the entry keep their own memory-safety checks for direct calls."""
    tk, L, pid, i2s, lru = _plan_inputs()
    with pytest.raises(RuntimeError, match="offload_cpu::dsa_plan: top-k numel must be B\\*raw_seq\\*K"):
        torch.ops.offload_cpu.dsa_plan(tk, L, pid, i2s, lru, 2)
    with pytest.raises(RuntimeError, match="offload_cpu::_register_checked_entry: custom::dsa_plan is registered"):
        torch.ops.offload_cpu._register_checked_entry("custom::dsa_plan")


_JIT_PROBE = """
import json, torch
import offload_passes
from offload_passes.custom_ops import OP_SPECS, _library as L
t = torch.zeros(1, 1, 1, 64, dtype=torch.int32)
try:
    torch.ops.custom.dsa_plan(t, t.view(-1)[:1], t.view(1, -1)[:, :16], t.view(1, -1), t.view(1, -1)[:, :1], raw_seq=5)
    err = None
except RuntimeError as e:
    err = str(e)
print(json.dumps({"entries": [s.qualname for s in OP_SPECS if L.has_cpu_entry(s)], "origin": L._kernels_origin,
                  "cpu": torch._C._dispatch_has_kernel_for_dispatch_key("custom::dsa_plan", "CPU"), "err": err}))
"""


def test_without_a_prebuilt_library_the_kernels_stay_python(tmp_path):
    """A process that JIT-builds its kernels (OFFLOAD_PASSES_JIT_KERNELS=1) registers the ops' Python CPU kernels
    (no build at import; a bad call fails in validation, before any build, with the same message)."""
    import json
    import subprocess

    env = dict(os.environ, OFFLOAD_PASSES_JIT_KERNELS="1", TORCH_EXTENSIONS_DIR=str(tmp_path), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    res = subprocess.run([sys.executable, "-c", _JIT_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"entries": [], "origin": None, "cpu": True,
                   "err": "custom::dsa_plan: raw_seq must be in [1, 4], got 5"}
    assert list(tmp_path.iterdir()) == []  # nothing was built

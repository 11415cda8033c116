"""The host's work per call of a CUDA op after its first call (``custom_ops/cuda/_common.py`` ``CudaOp``),
counted on CPU under Triton's interpreter: the validation and the launch constants are per call signature, so
a repeated call runs none of it; what is left is binding, one memo lookup and the launches, and the only
ATen ops that launch on a device, outside the kernels, are the op's outputs and scratch fills and the install's
device sort (counted as tests/cuda/test_install_launches.py counts them; docs/ops.md §13). On a
GPU this host work is the launch bound of a small op, and it cannot run inside a CUDA graph replay.
"""
from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
import torch

import _gen as G
import test_properties as TP

#: the package's folder (editable install: the checkout): the Python frames counted are its custom_ops/ ones
OURS = os.path.dirname(os.path.dirname(os.path.abspath(__import__("offload_passes.custom_ops", fromlist=["x"]).__file__)))
#: our Python functions a warm call may run: binding, the memo, the runner, the launcher and its helpers
#: (views of the payload bits, dense buffers, host checks of pinned caches)
MAX_CALLS = {"dsa_plan": 10, "dsa_serve": 17, "dsa_install": 23, "dsa_install_sc": 23}


def _kernel_names(modules) -> set:
    """Names of the modules' Triton functions: the interpreter runs them in Python (from rewritten code, so
    by name); on a GPU they are device code, not host work."""
    return {obj.fn.__name__ for m in modules for obj in vars(m).values()
            if hasattr(obj, "fn") and hasattr(obj, "__getitem__") and hasattr(obj.fn, "__name__")}


def _count_python(fn, kernels: set):
    """(calls of our modules' Python functions during fn(), by name), Triton functions left out."""
    names = Counter()

    def prof(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name not in kernels and code.co_filename.startswith(OURS + os.sep + "custom_ops"):
            names[code.co_name] += 1
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sum(names.values()), names


def _calls(mods):
    c = dict(B=2, S=1, K=64, PS=32, IR=96, sbs=16, L=[80, 60], F=90, seed=7, fill=1.0, hole=0.0, dup=0.5,
             future=0.0, beyond=False, garbage=False, pool_fill=0.5, D=8, Dr=4, dtype=torch.bfloat16)
    L, tk, pid, i2s, lru, fkv, frope, pkv, prope = TP._make_step(c)
    plan, rec, _ = torch.ops.custom.dsa_plan.default(tk, L, pid, i2s, lru, raw_seq=1)
    g = G.gen(9)
    sel = [G.payload((8, 16, 8), torch.bfloat16, g), G.payload((8, 16, 4), torch.bfloat16, g)]
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    kw = dict(raw_seq=1, topk=64, selection_block_size=16)
    state = [pkv, prope, pid, i2s, lru]
    return {
        "dsa_plan": (lambda: mods["plan"].run(tk, L, pid, i2s, lru, raw_seq=1),
                     {"aten::zeros": 1}),  # the records output (the other two are empty: no launch)
        "dsa_serve": (lambda: mods["serve"].run(plan, fkv, frope, pkv, prope, *sel, compact_layout=1, **kw), {}),
        "dsa_install": (lambda: mods["install"].run(rec, *sel, table, *[t.clone() for t in state], metadata_update=1, **kw),
                        {"aten::full": 1, "aten::sort": 1}),  # the scratch fill, the device sort
        "dsa_install_sc": (lambda: mods["sc"].run(plan, rec, *sel, table, *[t.clone() for t in state], metadata_update=1,
                                                  **kw),
                           {"aten::full": 1, "aten::sort": 1}),
    }


@pytest.fixture(scope="module")
def mods(triton_interpreted):
    from offload_passes.custom_ops.cuda import dsa_install, dsa_install_sc, dsa_plan, dsa_serve

    return dict(plan=dsa_plan, serve=dsa_serve, install=dsa_install, sc=dsa_install_sc)


@pytest.mark.parametrize("op", sorted(MAX_CALLS))
def test_a_warm_call_only_binds_and_launches(mods, op):
    from offload_passes.custom_ops.cuda import dsa_install as I

    from test_install_launches import counted_launches

    fn, aten_ops = _calls(mods)[op]
    module = I if op.startswith("dsa_install") else mods[op.split("_")[1]]
    kernels = _kernel_names([module, I])
    getattr(mods[{"dsa_plan": "plan", "dsa_serve": "serve", "dsa_install": "install", "dsa_install_sc": "sc"}[op]],
            "KERNELS")._memo.clear()  # other tests of this process may have validated this signature
    first, first_names = _count_python(fn, kernels)
    assert any("validate" in n for n in first_names), first_names  # a new signature is validated
    n, names = _count_python(fn, kernels)
    assert not any("validate" in n_ or n_ == "prepare" for n_ in names), names  # nothing per signature again
    assert n <= MAX_CALLS[op], names
    with counted_launches(module) as counts:
        fn()
    clones = Counter({"aten:clone": 5}) if op.startswith("dsa_install") else Counter()  # the test's state copies
    host = Counter({k: v for k, v in counts.items() if k.startswith("aten:")}) - clones
    assert host == Counter({"aten:" + k.split("::")[1]: v for k, v in aten_ops.items()}), counts

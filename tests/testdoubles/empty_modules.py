"""TEST DOUBLES for the CANN-linked modules ``torchair.core._npu_graph_executor``,
``torchair.core._npu_utils`` and ``torchair.core._abi_compat_ge_apis`` (``.so`` files in torch_npu).

TorchAir imports them lazily and only on paths that need an NPU (device ids with torch_npu loaded,
internal-format inputs, ``experimental.inference``). An empty module makes such a path fail with an
``AttributeError`` naming the missing symbol instead of an ``ImportError`` for a library that cannot
exist here.
"""
from __future__ import annotations

import types

NAMES = (
    "torchair.core._npu_graph_executor",
    "torchair.core._npu_utils",
    "torchair.core._abi_compat_ge_apis",
)


def make_modules() -> dict:
    mods = {}
    for name in NAMES:
        mod = types.ModuleType(name, f"TEST DOUBLE for the CANN-linked module {name} (empty).")
        mod.TEST_DOUBLE = True
        mods[name] = mod
    return mods

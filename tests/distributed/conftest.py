"""Fixtures of the multi-rank tests: the TorchAir / npugraph_ex fixtures of tests/converters (one
definition, re-exported here) and a one-process fake world for the structural NPU-lowering tests."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

_CONVERTERS = Path(__file__).resolve().parents[1] / "converters" / "conftest.py"


def _converters_conftest():
    name = "offload_passes_tests_converters_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _CONVERTERS)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


_c = _converters_conftest()
torchair_site = _c.torchair_site
torchair = _c.torchair
torchair_core_double = _c.torchair_core_double
torch_npu_double = _c.torch_npu_double
npugraph_ex_pkg = _c.npugraph_ex_pkg
reinplace_registered = _c.reinplace_registered


@pytest.fixture()
def fake_world():
    """``enter(rank)``: this process becomes rank ``rank`` of a 2-rank world on torch's fake process
    group (collectives are no-ops: tracing and lowering only). Torn down after the test."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def enter(rank: int, world: int = 2) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield enter
    if dist.is_initialized():
        dist.destroy_process_group()

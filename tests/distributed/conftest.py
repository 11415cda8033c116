"""Fixtures of the multi-rank tests: a one-process fake world for the structural NPU-lowering tests (the
TorchAir / npugraph_ex fixtures are tests/conftest.py's)."""
from __future__ import annotations

import pytest
import torch.distributed as dist


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

"""Backend test fixtures: the synthetic DSA model and (until every real kernel lands) stand-in kernels."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import standins  # noqa: E402,F401  (registers only missing kernels)

import torch  # noqa: E402

# Tiny matmuls on 2 shared cores: OpenMP thread contention makes them ~10x slower than one thread.
torch.set_num_threads(1)

import pytest  # noqa: E402

# Every synthetic model instance recompiles the same ``forward`` code object; keep Dynamo from
# falling back to eager after its default recompile limit of 8.
torch._dynamo.config.recompile_limit = 64


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield

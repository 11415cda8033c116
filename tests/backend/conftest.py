"""Backend test configuration: the synthetic DSA model (``dsa_synth.py``) and helpers live beside the tests."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

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

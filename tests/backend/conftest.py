"""Backend test configuration: the synthetic DSA model (``dsa_synth.py``) and helpers live beside the tests.

Process-wide settings are scoped to this folder (set per test module, restored on its teardown), so a
run of the whole ``tests/`` tree leaves other folders with their own thread count and Dynamo limits.
"""
import os
import sys

# Kept global: it only makes ``dsa_synth`` / ``backend_helpers`` importable by name (pytest's default
# "prepend" import mode needs it at collection time, before any fixture runs); both names are unique
# in tests/ and shadow nothing.
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _backend_process_settings():
    # Tiny matmuls on 2 shared cores: OpenMP thread contention makes them ~10x slower than one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # Every synthetic model instance recompiles the same ``forward`` code object; keep Dynamo from
    # falling back to eager after its default recompile limit of 8.
    try:
        with torch._dynamo.config.patch(recompile_limit=64):
            yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield

"""The compile settings of the folders that compile many small models (tests/backend, tests/passes and the
CPU lowering's tests import these autouse fixtures): scoped per test module and restored on teardown, so
a run of the whole ``tests/`` tree leaves other folders with their own thread count and Dynamo limits."""
import pytest
import torch


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

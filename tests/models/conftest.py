"""Fixtures for the model tests."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    # The tiny model runs hundreds of small GEMMs; on a shared 2-core machine OpenMP spin-waiting makes
    # them 5-10x slower with 2 threads than with 1. Results do not depend on it.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

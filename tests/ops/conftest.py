"""Fixtures shared by the op tests."""
import pytest


@pytest.fixture(scope="module")
def force_cpp_kernels():
    """The ``custom::`` ops take the C++ path in the requesting module even if
    ``OFFLOAD_PASSES_CPU_KERNELS=reference`` is set outside (restored afterwards)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("OFFLOAD_PASSES_CPU_KERNELS", "cpp")
    try:
        yield
    finally:
        mp.undo()

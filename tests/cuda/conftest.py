"""tests/cuda: the Triton kernels on CPU tensors through Triton's interpreter; the tests marked ``device`` also on a
GPU.

``TRITON_INTERPRET=1`` must be set before a kernel module is imported (``triton.jit`` picks the
interpreter when the function is decorated), so it is set here (and in tests/conftest.py), at collection time.
``triton`` is the ``[cuda]`` extra; CI installs it (``scripts/setup.sh``), so a missing triton is a skip that
``OFFLOAD_PASSES_NO_SKIP=1`` turns into a failure.

The device tests (``@pytest.mark.device``, fixture ``dev``): on a CPU they run on CPU tensors under the interpreter
with the rest of the suite; with ``OFFLOAD_PASSES_GPU=1`` (``scripts/lent_gpu.sh``) the interpreter is not set,
``dev`` is the CUDA device, and only the device tests are collected (the others take CPU tensors into the
kernels, which a compiled kernel cannot read). ``OFFLOAD_PASSES_GPU=1`` without a CUDA device is a usage error.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "ops"))  # _gen, test_properties

import _device  # noqa: E402  (also puts benchmarks/ on sys.path: the device tests share its models)

if not _device.ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "device: runs on the GPU with OFFLOAD_PASSES_GPU=1 (fixture dev), on CPU "
                                       "tensors under Triton's interpreter otherwise")
    if _device.ON_GPU and not torch.cuda.is_available():
        raise pytest.UsageError(f"OFFLOAD_PASSES_GPU=1 asks for the device tests on a GPU, but "
                                f"torch.cuda.is_available() is False (torch {torch.__version__})")


def pytest_collection_modifyitems(config, items):
    """With ``OFFLOAD_PASSES_GPU=1`` only the device tests run (deselected, not skipped: nothing is hidden)."""
    if not _device.ON_GPU:
        return
    keep = [i for i in items if i.get_closest_marker("device")]
    dropped = [i for i in items if not i.get_closest_marker("device")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(scope="session")
def dev(request):
    """Where a device test runs: the CUDA device with ``OFFLOAD_PASSES_GPU=1``, else the CPU (the kernels under
    Triton's interpreter)."""
    if _device.ON_GPU:
        return torch.device("cuda", torch.cuda.current_device())
    request.getfixturevalue("triton_interpreted")
    return torch.device("cpu")


@pytest.fixture(scope="session")
def flow():
    """The tiny recipe model's whole flow on fake CUDA tensors (``test_fake_cuda_flow.run_flow``), once per
    session: test_fake_cuda_flow.py and test_cuda_graphs.py read the same compiled graph."""
    from test_fake_cuda_flow import run_flow

    yield from run_flow()

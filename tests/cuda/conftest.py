"""tests/cuda: the Triton kernels on CPU tensors through Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before a kernel module is imported (``triton.jit`` picks the
interpreter when the function is decorated), so it is set here (and in tests/conftest.py), at collection time. ``triton`` is the
``[cuda]`` extra; CI installs it (``scripts/setup.sh``), so a missing triton is a skip that
``OFFLOAD_PASSES_NO_SKIP=1`` turns into a failure.
"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "ops"))  # _gen, test_properties


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def flow():
    """The tiny recipe model's whole flow on fake CUDA tensors (``test_fake_cuda_flow.run_flow``), once per
    session: test_fake_cuda_flow.py and test_cuda_graphs.py read the same compiled graph."""
    from test_fake_cuda_flow import run_flow

    yield from run_flow()

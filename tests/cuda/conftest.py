"""tests/cuda: the Triton kernels on CPU tensors through Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before a kernel module is imported (``triton.jit`` picks the
interpreter when the function is decorated), so it is set here, at collection time. ``triton`` is the
``[cuda]`` extra; CI installs it (``scripts/setup.sh``), so a missing triton is a skip that
``OFFLOAD_PASSES_NO_SKIP=1`` turns into a failure.
"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "ops"))  # _gen, test_properties

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def triton_interpreted():
    """triton imported in interpreter mode (the kernels then run on CPU tensors)."""
    triton = pytest.importorskip("triton", reason="the [cuda] extra (triton) is not installed")
    from triton.runtime.interpreter import InterpretedFunction

    from offload_passes.custom_ops.cuda import dsa_serve

    assert isinstance(dsa_serve._serve_kernel, InterpretedFunction), (
        "triton was imported before TRITON_INTERPRET=1 was set; the kernels would need a GPU")
    return triton

"""Shared pytest configuration: the fixtures several folders use (the TorchAir / npugraph_ex test doubles of
``npu_doubles.py``, Triton's interpreter, the compile settings of ``compile_settings.py``); a folder's
own fixtures stay in its own conftest.py. Helper modules shared by folders (``dsa_synth``,
``backend_helpers``, ``new_request_cases``, ``npu_capture``) live here, importable by name."""
import os

# Never let an installed torch_npu autoload into a CPU test run (docs/platform.md §6).
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# tests/cuda runs the Triton kernels on CPU tensors through Triton's interpreter, which triton only
# sets up if this is set when triton is first imported (torch._inductor imports it, e.g. while other
# test modules are collected); CPU Inductor never uses triton, so nothing else changes. Not with
# OFFLOAD_PASSES_GPU=1: the device tests on a GPU run the compiled kernels (tests/cuda/conftest.py).
if os.environ.get("OFFLOAD_PASSES_GPU") != "1":
    os.environ["TRITON_INTERPRET"] = "1"

import offload_passes  # noqa: E402,F401  (registers the ops)

import pytest  # noqa: E402

from npu_doubles import (npugraph_ex_capture, npugraph_ex_pkg, reinplace_registered, stub_torch_npu,  # noqa: E402,F401
                         torch_npu_double, torchair, torchair_core_double, torchair_site)
from hypothesis import HealthCheck, settings  # noqa: E402

from offload_passes.tools.torchair_env import NO_TORCH_NPU, no_torch_npu_reason  # noqa: E402

# Hypothesis profiles (tests/ops/test_properties.py): "ci" (default) is fast and derandomized, so CI runs
# the same examples every time; "long" digs deeper: `pytest --hypothesis-profile=long tests/ops/test_properties.py`.
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True, database=None,
                          suppress_health_check=_SLOW_OK)
settings.register_profile("long", max_examples=2000, deadline=None, suppress_health_check=_SLOW_OK)
settings.load_profile("ci")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With ``OFFLOAD_PASSES_NO_SKIP=1`` (set by .ci/run) a skip is a failure: the skips in this suite are
    platform conditions (no TorchAir sources extracted, no Graphviz ``dot``), which CI must never have. A strict
    xfail is an assertion (it fails once the condition no longer holds), not a skip. One skip stays a skip: the
    NPU tests on a torch that no torch-npu release exists for (``tools/torchair_env.py``
    ``no_torch_npu_reason``, torch 2.15), where no set-up can provide TorchAir; the run's summary counts them."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and os.environ.get("OFFLOAD_PASSES_NO_SKIP") == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if NO_TORCH_NPU in reason and no_torch_npu_reason() is not None:
            return
        report.outcome = "failed"
        report.longrepr = f"skipped, but OFFLOAD_PASSES_NO_SKIP=1 forbids skips: {reason}"


@pytest.fixture(autouse=True)
def no_plan_observer_outlives_its_test():
    """A ``dsa_plan`` observer (a trace recorder) is process-wide: one a test leaves registered turns the C++
    entry's shortcut off for every later test of its worker (custom_ops/dsa_plan.py). Removed here, and the
    test that left it fails, so a leak is found where it happens."""
    from offload_passes.custom_ops import dsa_plan

    yield
    left = list(dsa_plan.PLAN_OBSERVERS)
    for fn in left:
        dsa_plan.remove_plan_observer(fn)
    assert not left, f"the test left dsa_plan observers registered: {left} (stop the recorder in a finally)"


@pytest.fixture(scope="session")
def triton_interpreted():
    """triton imported in interpreter mode (the kernels then run on CPU tensors)."""
    triton = pytest.importorskip("triton", reason="the [cuda] extra (triton) is not installed")
    from triton.runtime.interpreter import InterpretedFunction

    from offload_passes.custom_ops.cuda import dsa_serve

    assert isinstance(dsa_serve._serve_kernel, InterpretedFunction), (
        "triton was imported before TRITON_INTERPRET=1 was set; the kernels would need a GPU")
    return triton

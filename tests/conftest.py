"""Shared pytest configuration. Sub-folders keep their own fixtures in their own conftest.py."""
import os

# Never let an installed torch_npu autoload into a CPU test run (docs/platform.md §6).
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# tests/cuda runs the Triton kernels on CPU tensors through Triton's interpreter, which triton only
# sets up if this is set when triton is first imported (torch._inductor imports it, e.g. while other
# test modules are collected); CPU Inductor never uses triton, so nothing else changes.
os.environ["TRITON_INTERPRET"] = "1"

import offload_passes  # noqa: E402,F401  (registers the ops)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

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
    platform conditions (no TorchAir sources extracted, no Graphviz ``dot``), which CI must never have."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("OFFLOAD_PASSES_NO_SKIP") == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, but OFFLOAD_PASSES_NO_SKIP=1 forbids skips: {reason}"

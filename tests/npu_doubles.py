"""Fixtures for the TorchAir / npugraph_ex tests.

They run against the real Python code of TorchAir and npugraph_ex from the ``torch-npu`` wheel that
matches our torch, prepared (without installing torch_npu) by
``python -m offload_passes.tools.torchair_env``. Only the CANN-linked compiled modules are replaced, by
the labelled test doubles in ``testdoubles/``. The tests skip, naming the command, when that copy is not
prepared, or, naming the version, when no torch-npu release exists for the installed torch
(``torchair_env.no_torch_npu_reason``); everything else is a failure.
"""
from __future__ import annotations

import contextlib
import importlib.util
import signal
import sys
import types
from pathlib import Path

import pytest

from offload_passes.tools import torchair_env

STANDINS = Path(__file__).resolve().parent / "testdoubles"
SKIP_REASON = (
    "TorchAir/npugraph_ex test copy not prepared; run `python -m offload_passes.tools.torchair_env` "
    "(pip-downloads the torch-npu wheel and extracts its pure-Python torchair/npugraph_ex)"
)


def _load_standin(name: str) -> types.ModuleType:
    qual = f"offload_passes_test_standins.{name}"
    if qual in sys.modules:
        return sys.modules[qual]
    spec = importlib.util.spec_from_file_location(qual, STANDINS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[qual] = mod
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _keep_signal_handlers():
    """TorchAir and npugraph_ex install SIGINT/SIGTERM handlers on import that end up ignoring the
    signal; keep the test runner's own handlers so Ctrl-C and CI timeouts still stop the run."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in saved.items():
            if h is not None:
                signal.signal(s, h)


def _install_torchair_standins() -> types.ModuleType:
    """Put the test doubles of the CANN-linked modules in place, then import TorchAir."""
    if "torchair" in sys.modules and not getattr(sys.modules.get("torchair.core._torchair"), "TEST_DOUBLE", False):
        raise RuntimeError("a real torchair is already imported in this process; the CPU converter tests "
                           "need the test copy with its stand-ins")
    core = sys.modules.get("torchair.core._torchair")
    if core is None:
        core = _load_standin("torchair_core").make_module()
        sys.modules["torchair.core._torchair"] = core
        sys.modules.update(_load_standin("empty_modules").make_modules())
    with _keep_signal_handlers():
        import torchair  # noqa: F401
        import torchair.core

    for name, mod in list(sys.modules.items()):  # bind the doubles as attributes of torchair.core too
        if name.startswith("torchair.core._") and getattr(mod, "TEST_DOUBLE", False):
            setattr(torchair.core, name.rsplit(".", 1)[1], mod)
    return core


def torchair_site_or_skip() -> Path:
    """The prepared TorchAir / npugraph_ex copy, or a skip naming why there is none."""
    if torchair_env.default_torch_npu_version() is None:
        # a fact of this torch version (torch 2.15), not a missing set-up step
        pytest.skip(torchair_env.no_torch_npu_reason())
    site = torchair_env.site_dir()
    if site is None:
        pytest.skip(SKIP_REASON)
    return site


@pytest.fixture(scope="session")
def torchair_site() -> Path:
    site = torchair_site_or_skip()
    missing = torchair_env.missing_requirements()
    assert not missing, f"TorchAir needs: pip install {' '.join(missing)}"
    torchair_env.activate(site)
    return site


@pytest.fixture(scope="session")
def torchair(torchair_site):
    """The real TorchAir package (test copy) with the ``_torchair`` double, our converters registered."""
    _install_torchair_standins()
    import torchair as ta

    from offload_passes import converters

    converters.register_all(ge=True, npugraph_ex=False)
    return ta


@pytest.fixture(scope="session")
def torchair_core_double(torchair):
    return sys.modules["torchair.core._torchair"]


@pytest.fixture(scope="session")
def torch_npu_double(torchair_site) -> types.ModuleType:
    """The module holding the ``torch_npu`` test double (use ``.installed()`` around npugraph_ex code)."""
    return _load_standin("torch_npu_stub")


@pytest.fixture()
def stub_torch_npu(torchair_site):
    """The ``torch_npu`` / ``torch.npu`` double, installed for one test (npugraph_ex / ACL tests)."""
    stub = _load_standin("torch_npu_stub")
    with stub.installed() as mod:
        yield mod


@pytest.fixture(scope="session")
def npugraph_ex_pkg(torchair_site):
    """npugraph_ex (test copy). Its modules that import torch_npu are imported under the double."""
    stub = _load_standin("torch_npu_stub")
    with stub.installed(), _keep_signal_handlers():
        import npugraph_ex
        import npugraph_ex._acl_concrete_graph.acl_graph  # noqa: F401
        import npugraph_ex._acl_concrete_graph.fx2acl_converter  # noqa: F401
        import npugraph_ex._acl_concrete_graph.graph_pass  # noqa: F401
        import npugraph_ex._acl_concrete_graph.static_kernel  # noqa: F401
        import npugraph_ex.ops._tagged_event  # noqa: F401
        import npugraph_ex.scope  # noqa: F401
    return npugraph_ex


@pytest.fixture(scope="session")
def reinplace_registered(torchair, npugraph_ex_pkg):
    """Our pairs registered in both ``inplaceable_npu_ops`` registries."""
    from offload_passes import converters

    return converters.register_all(ge=False, npugraph_ex=True)["reinplace"]


@pytest.fixture()
def npugraph_ex_capture(npugraph_ex_pkg):
    from npu_capture import captured_npugraph_ex_graph  # tests/npu_capture.py

    return captured_npugraph_ex_graph

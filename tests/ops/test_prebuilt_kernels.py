"""The C++ kernels come from the extensions ``pip install`` built (setup.py), not from a JIT build; the
JIT build is only the fallback when the prebuilt library is missing or ``OFFLOAD_PASSES_JIT_KERNELS=1``.

The fallback tests replace the compiler run (``torch.utils.cpp_extension.load``) with a recording TEST
DOUBLE: they check which path is chosen and what would be compiled, without compiling."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload_passes import _extensions
from offload_passes.custom_ops import OP_SPECS
from offload_passes.custom_ops import _library as Lib
from offload_passes.trace import _native

CSRC = Path(Lib.__file__).resolve().parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
OPS = [p.stem for p in SOURCES if not p.stem.startswith("_")]  # _entry.cpp: the ops' CPU entry, not an op

_PROBE = """
import json, os, torch
import offload_passes.custom_ops._library as L
from offload_passes.trace import _native
ops = json.loads(os.environ["PROBE_OPS"])
kernels = [str(L.cpu_op(op).default) for op in ops]
_native.module()
from offload_passes.custom_ops import cann_library_status
status = cann_library_status()
from offload_passes.custom_ops import OP_SPECS
entries = sorted(s.qualname for s in OP_SPECS if L.has_cpu_entry(s))
print(json.dumps({"origin": L.cpu_kernels_origin(), "library": str(L.prebuilt_library()), "entries": entries,
                  "kernels": kernels, "trace": _native.origin(),
                  "cann": [status.loaded, status.path], "ours": sorted(L.defined_ops())}))
"""


def test_torch_tag_names_the_abi():
    assert _extensions.torch_tag("2.13.0+cpu") == "torch2_13_0_cpu"
    assert _extensions.torch_tag("2.8.0+cu128") == "torch2_8_0_cu128"
    assert _extensions.cpu_kernels_name("2.8.0") == "_C_torch2_8_0"
    assert _extensions.trace_sim_name("2.13.0+cpu") == "_trace_sim_torch2_13_0_cpu"


def test_installed_environment_has_prebuilt_kernels(tmp_path):
    """In a fresh process with no compiler reachable (CC/CXX point nowhere) and an empty extensions
    folder, every op's kernel and the offload-sim core load from the libraries built at install."""
    assert len(OPS) >= 5, OPS
    lib = Lib.prebuilt_library()
    assert lib is not None, (
        f"no prebuilt CPU kernels {_extensions.ext_filename(_extensions.cpu_kernels_name(torch.__version__))} "
        f"next to {Lib.__file__}: run `bash scripts/setup.sh` (pip builds them)"
    )
    ext_dir = tmp_path / "torch_extensions"
    ext_dir.mkdir()
    missing = str(tmp_path / "no-such-compiler")
    env = {k: v for k, v in os.environ.items() if k != _extensions.FORCE_JIT_ENV}
    env.update(TORCH_DEVICE_BACKEND_AUTOLOAD="0", TORCH_EXTENSIONS_DIR=str(ext_dir), CC=missing, CXX=missing,
               PROBE_OPS=json.dumps(OPS))
    res = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["origin"] == "prebuilt"
    assert out["trace"] == "prebuilt"
    assert out["library"] == str(lib)
    assert out["kernels"] == [f"offload_cpu.{op}.default" for op in OPS]  # one library holds every op
    assert out["entries"] == sorted(s.qualname for s in OP_SPECS if s.name in OPS)  # the ops' CPU kernels are C++
    assert list(ext_dir.iterdir()) == []  # nothing was JIT-built
    # Loading our library is not mistaken for a late CANN load (which would hand our schemas over to it)
    assert out["cann"] == [False, None]
    assert "dsa_plan" in out["ours"]


def test_this_process_uses_the_prebuilt_kernels():
    Lib.cpu_op("dsa_plan")
    expected = "jit" if _extensions.jit_forced(os.environ) else "prebuilt"
    assert Lib.cpu_kernels_origin() == expected


@pytest.fixture
def fresh_loader(monkeypatch):
    """The loader as if no kernel library were loaded yet (restored afterwards)."""
    monkeypatch.setattr(Lib, "_kernels_origin", None)
    monkeypatch.delenv(_extensions.FORCE_JIT_ENV, raising=False)
    return monkeypatch


def test_prebuilt_is_chosen_when_present(fresh_loader, tmp_path):
    fake = tmp_path / "lib.so"
    fresh_loader.setattr(Lib, "prebuilt_library", lambda: fake)
    assert Lib._choose_origin() == ("prebuilt", fake)
    assert Lib.cpu_kernels_origin() == "prebuilt"


def test_missing_prebuilt_falls_back_to_jit(fresh_loader, caplog):
    calls = []
    from torch.utils import cpp_extension

    fresh_loader.setattr(Lib, "prebuilt_library", lambda: None)
    fresh_loader.setattr(cpp_extension, "load", lambda **kw: calls.append(kw))  # TEST DOUBLE: no compiler run
    assert Lib.cpu_kernels_origin() == "jit"
    with caplog.at_level(logging.WARNING, logger="offload_passes.custom_ops"):
        assert Lib.load_cpu_kernels() == "jit"
        assert Lib.load_cpu_kernels() == "jit"  # once per process
    assert len(calls) == 1
    kw = calls[0]
    assert kw["name"] == "offload_passes" + _extensions.cpu_kernels_name(torch.__version__)
    assert kw["sources"] == [str(p) for p in SOURCES]  # all ops and their entry, one library
    assert kw["extra_cflags"] == ["-O3", "-fopenmp"]
    assert kw["extra_ldflags"] == ["-fopenmp"]
    assert kw["is_python_module"] is False
    assert "JIT build (no prebuilt" in caplog.text


def test_env_var_forces_jit_even_with_prebuilt(fresh_loader, tmp_path, caplog):
    calls = []
    from torch.utils import cpp_extension

    fresh_loader.setattr(Lib, "prebuilt_library", lambda: tmp_path / "lib.so")
    fresh_loader.setattr(cpp_extension, "load", lambda **kw: calls.append(kw))  # TEST DOUBLE: no compiler run
    fresh_loader.setenv(_extensions.FORCE_JIT_ENV, "1")
    assert Lib._choose_origin() == ("jit", None)
    with caplog.at_level(logging.WARNING, logger="offload_passes.custom_ops"):
        assert Lib.load_cpu_kernels() == "jit"
    assert len(calls) == 1
    assert f"forced by {_extensions.FORCE_JIT_ENV}" in caplog.text
    fresh_loader.setenv(_extensions.FORCE_JIT_ENV, "0")
    assert Lib._choose_origin() == ("prebuilt", tmp_path / "lib.so")


def test_trace_core_falls_back_to_jit(monkeypatch):
    calls = []
    from torch.utils import cpp_extension

    monkeypatch.setattr(_native, "_mod", None)
    monkeypatch.setattr(_native, "_origin", None)
    monkeypatch.setattr(_native, "prebuilt_path", lambda: None)
    monkeypatch.delenv(_extensions.FORCE_JIT_ENV, raising=False)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw) or "jit-module")  # TEST DOUBLE
    assert _native.origin() == "jit"
    assert _native.module() == "jit-module"
    assert [c["sources"] for c in calls] == [[str(Path(_native.__file__).parent / "csrc" / "trace_sim.cpp")]]
    assert _native.origin() == "jit"


def test_functionalization_takes_at_most_one_leading_output():
    with pytest.raises(ValueError, match="num_leading_outputs must be 0 or 1, got 2"):
        Lib.register_functionalization("dsa_serve", "dsa_serve_functional", ["selection_kv_cache"],
                                       num_leading_outputs=2)

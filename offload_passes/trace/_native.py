"""The simulator's C++ core (``csrc/trace_sim.cpp``, a pybind11 module with ``simulate``).

``pip install`` builds it (``setup.py``, next to this file, named for the torch version it was built
against; see ``offload_passes/_extensions.py``). Only when that build is missing, or
``OFFLOAD_PASSES_JIT_KERNELS=1`` is set, is it JIT-built through torch's cpp_extension + ninja and cached
under ``TORCH_EXTENSIONS_DIR``, like the custom-op CPU kernels. Importing never compiles or loads it."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import threading
from pathlib import Path
from types import ModuleType
from typing import Optional

from offload_passes import _extensions

log = logging.getLogger("offload_passes.trace.native")

_SRC = Path(__file__).resolve().parent / "csrc" / "trace_sim.cpp"
_lock = threading.Lock()
_mod: Optional[ModuleType] = None
_origin: Optional[str] = None


def _name() -> str:
    import torch

    return _extensions.trace_sim_name(torch.__version__)


def prebuilt_path() -> Optional[Path]:
    """The extension ``pip install`` built for the running torch, or None if there is none."""
    path = Path(__file__).resolve().parent / _extensions.ext_filename(_name())
    return path if path.is_file() else None


def origin() -> str:
    """``"prebuilt"`` or ``"jit"``: how ``module()`` loaded (or will load) the core in this process."""
    if _origin is not None:
        return _origin
    return "prebuilt" if prebuilt_path() is not None and not _extensions.jit_forced(os.environ) else "jit"


def _load_prebuilt(path: Path) -> ModuleType:
    # The module name must match the PyInit symbol BuildExtension compiled in (the extension's last name).
    fullname = f"{__package__}.{_name()}"
    loader = importlib.machinery.ExtensionFileLoader(fullname, str(path))
    spec = importlib.util.spec_from_file_location(fullname, str(path), loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def module() -> ModuleType:
    """The compiled ``simulate`` module (loaded, or JIT-built, on first use)."""
    global _mod, _origin
    if _mod is None:
        with _lock:
            if _mod is None:
                import torch  # noqa: F401  (the extension links against libtorch)

                path = None if _extensions.jit_forced(os.environ) else prebuilt_path()
                if path is not None:
                    log.info("offload-sim C++ core: prebuilt %s", path)
                    _mod, _origin = _load_prebuilt(path), "prebuilt"
                else:
                    from torch.utils import cpp_extension

                    log.warning("offload-sim C++ core: JIT build (%s), cached in TORCH_EXTENSIONS_DIR",
                                f"forced by {_extensions.FORCE_JIT_ENV}" if _extensions.jit_forced(os.environ)
                                else "no prebuilt extension for this torch; `pip install -e .` builds it")
                    _mod = cpp_extension.load(
                        name="offload_passes" + _name(), sources=[str(_SRC)],
                        extra_cflags=list(_extensions.TRACE_SIM_CFLAGS), verbose=False,
                    )
                    _origin = "jit"
    return _mod

"""Builder for the TEST DOUBLE of CANN's custom-op torch extension (``cann_custom_ops.cpp``).

The real extension (the ``custom_ops`` wheel of the reference's ``ops/ascendc/torch_ops_extension``) links
against torch_npu and CANN and cannot load here. The stand-in defines the same seven ``custom::`` schemas
with ``TORCH_LIBRARY(custom, m)``, CANN's Meta kernels (output shapes) and throwing PrivateUse1 kernels.

* :func:`build` compiles it with ``torch.utils.cpp_extension`` **in a child process** (so the calling
  process never loads it by accident) and returns the path of ``custom_ops_lib.so`` (cached; ninja skips
  the compile when nothing changed).
* :func:`wheel_layout` lays out an importable ``custom_ops`` package (``custom_ops/__init__.py`` +
  ``custom_ops/custom_ops_lib.so``) the way CANN's wheel installs it, for the discovery tests.

Command line: ``python tests/testdoubles/cann_standin.py`` builds and prints the library path.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "cann_custom_ops.cpp"
NAME = "custom_ops_lib"

_BUILD = f"""
import sys
from torch.utils import cpp_extension
cpp_extension.load(name={NAME!r}, sources=[sys.argv[1]], build_directory=sys.argv[2],
                   extra_cflags=["-O1"], is_python_module=True, verbose=False)
"""


def build_dir() -> Path:
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    return root / "offload_passes_cann_standin"


def build(timeout: float = 900) -> Path:
    """Compile (or reuse) the stand-in; return the path of its shared library."""
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    res = subprocess.run(
        [sys.executable, "-c", _BUILD, str(SOURCE), str(out)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    if res.returncode != 0:
        raise RuntimeError(f"building the CANN stand-in failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")
    lib = out / f"{NAME}.so"
    if not lib.exists():
        raise RuntimeError(f"the CANN stand-in build did not produce {lib}")
    return lib


_INIT = '''"""TEST DOUBLE of CANN's ``custom_ops`` wheel: importing it loads the extension, as the real one does
(the real ``__init__`` also imports torch_npu and mounts the ops on it; there is no torch_npu here)."""
from . import custom_ops_lib  # noqa: F401
'''


def wheel_layout(site: Path, lib: Path) -> Path:
    """Create ``site/custom_ops/{__init__.py, custom_ops_lib.so}``; return the package directory."""
    pkg = Path(site) / "custom_ops"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(_INIT)
    shutil.copy2(lib, pkg / f"{NAME}.so")
    return pkg


if __name__ == "__main__":
    print(build())

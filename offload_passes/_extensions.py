"""The two C++ extensions: names, sources and compiler flags, shared by ``setup.py`` (build at install)
and the run-time loaders (``custom_ops/_library.py``, ``trace/_native.py``) with their JIT fallback.

Standard library only: ``setup.py`` loads this file by path, before the package is importable.

* ``custom_ops`` CPU kernels: every ``custom_ops/csrc/*.cpp`` in one shared library that registers
  ``offload_cpu::<op>`` with ``TORCH_LIBRARY_FRAGMENT`` (no Python module init; loaded with
  ``torch.ops.load_library``).
* ``trace`` simulator core: ``trace/csrc/trace_sim.cpp``, a pybind11 module (``simulate``).
* the serving loop's KV transfer ``glm_serve::copy_blocks_`` (``models/glm/csrc/kv_transfer.cpp``, loaded by
  ``models/glm/serve.py::load_transfer_op`` with ``torch.ops.load_library``).

A JIT fallback builds into a folder per torch build (``torch_tag``), and :func:`wait_for_build_lock` keeps
it from waiting forever on the lock file of a build that was stopped.

The file names carry the torch version (``_C_torch2_13_0_cpu.cpython-311-x86_64-linux-gnu.so``): an
editable install builds into the source folders, which one checkout shares between venvs of different
torch versions (``scripts/test_matrix.sh``); a library built for another torch ABI is never picked up,
and each venv's build leaves the others' in place.
"""
from __future__ import annotations

import importlib.machinery
import logging
import re
import time
from pathlib import Path
from typing import Callable, Mapping, Optional

log = logging.getLogger("offload_passes.extensions")

#: -O3, OpenMP for at::parallel_for. No -std: torch adds the standard its headers need (C++17 up to
#: torch 2.10, C++20 from 2.13; 2.14's headers refuse C++17) — see offload_passes/_compat.py.
CPU_KERNELS_CFLAGS = ["-O3", "-fopenmp"]
CPU_KERNELS_LDFLAGS = ["-fopenmp"]
TRACE_SIM_CFLAGS = ["-O3"]
KV_TRANSFER_CFLAGS = ["-O1"]

#: Environment variable forcing the JIT build (``torch.utils.cpp_extension.load``) even when a prebuilt
#: extension is installed (developers editing ``csrc/`` without reinstalling).
FORCE_JIT_ENV = "OFFLOAD_PASSES_JIT_KERNELS"


def jit_forced(environ: Mapping[str, str]) -> bool:
    """True if ``OFFLOAD_PASSES_JIT_KERNELS`` is set to anything but ``""`` / ``"0"``."""
    return environ.get(FORCE_JIT_ENV, "0") not in ("", "0")


def torch_tag(torch_version: str) -> str:
    """``"2.13.0+cpu"`` -> ``"torch2_13_0_cpu"``."""
    return "torch" + re.sub(r"[^0-9A-Za-z]+", "_", torch_version).strip("_")


def cpu_kernels_name(torch_version: str) -> str:
    """Last component of the CPU-kernel extension's module name (``offload_passes.custom_ops.<this>``)."""
    return f"_C_{torch_tag(torch_version)}"


def trace_sim_name(torch_version: str) -> str:
    """Last component of the simulator extension's module name (``offload_passes.trace.<this>``)."""
    return f"_trace_sim_{torch_tag(torch_version)}"


def kv_transfer_name(torch_version: str) -> str:
    """Last component of the KV-transfer library's module name (``offload_passes.models.glm.<this>``)."""
    return f"_kv_transfer_{torch_tag(torch_version)}"


def ext_filename(module_name: str) -> str:
    """File name of a compiled extension for this interpreter (``<name>.cpython-311-x86_64-linux-gnu.so``)."""
    return module_name + importlib.machinery.EXTENSION_SUFFIXES[0]


def cpu_kernel_sources(csrc: Path) -> list[Path]:
    """All CPU-kernel translation units, sorted (one per op)."""
    return sorted(csrc.glob("*.cpp"))



#: The torch versions an editable install or an sdist accepts: its kernels are compiled at install, or
#: JIT-built at run time (``custom_ops/_library.py``), against whichever torch the environment holds.
#: Tested versions: ``scripts/test_matrix.sh``, docs/versions.md.
TORCH_RANGE = ">=2.8,<2.15"


def torch_requirement(torch_version: str, *, binary_wheel: bool) -> str:
    """The ``torch`` requirement of the package metadata.

    A binary wheel carries ``_C_<torch_tag>`` libraries compiled against one torch build, and the loader
    takes them only for that exact build, local part included (``torch_tag``: ``2.13.0+cpu`` and
    ``2.13.0+cu130`` are different libraries). So a wheel pins ``torch==<that version>``: installed into a
    fresh venv it brings the torch its kernels match instead of the newest one in the range, which would
    make the first CPU call JIT-compile the kernels. Source and editable installs keep ``TORCH_RANGE``.
    """
    if binary_wheel:
        return f"torch=={torch_version}"
    return f"torch{TORCH_RANGE}"


def pin_torch_in_metadata(metadata: str, torch_version: str) -> str:
    """A wheel's ``METADATA`` text with its ``Requires-Dist: torch...`` line (the one without an extra
    marker) replaced by the pin of :func:`torch_requirement`; ValueError if there is not exactly one."""
    lines = metadata.split("\n")
    hits = [i for i, line in enumerate(lines)
            if re.match(r"Requires-Dist:\s*torch\s*(?:[<>=!~;(]|$)", line) and "extra ==" not in line]
    if len(hits) != 1:
        raise ValueError(f"wheel METADATA: expected one 'Requires-Dist: torch' line, found {len(hits)}")
    lines[hits[0]] = "Requires-Dist: " + torch_requirement(torch_version, binary_wheel=True)
    return "\n".join(lines)


#: A JIT build's lock file (``torch.utils.cpp_extension``'s ``<build folder>/lock``, created when a build
#: starts and removed when it ends) older than this was left by a build that was stopped (Ctrl-C, a killed
#: worker): a build of these sources takes about a minute on two loaded cores.
STALE_LOCK_S = 300.0


def wait_for_build_lock(build_dir: Path, stale_after: float = STALE_LOCK_S, poll_s: float = 0.5,
                        clock: Callable[[], float] = time.time,
                        sleep: Callable[[float], None] = time.sleep) -> Optional[Path]:
    """Before a JIT build into ``build_dir``: wait while another process's build holds the folder's lock
    file, and remove a lock older than ``stale_after`` seconds (by its modification time; a build never
    touches it), which torch's builder would otherwise wait on forever. Returns the path of a stale lock it
    removed (the caller names it), else None."""
    lock = Path(build_dir) / "lock"
    announced = False
    while True:
        try:
            age = clock() - lock.stat().st_mtime
        except FileNotFoundError:
            return None
        if age >= stale_after:
            lock.unlink(missing_ok=True)
            log.warning("removed the stale build lock %s (%.0f s old, more than %.0f s: left by a build that was "
                        "stopped); building again", lock, age, stale_after)
            return lock
        if not announced:
            log.warning("waiting for another process's build in %s (its lock file %s is %.0f s old; one older than "
                        "%.0f s is taken as left by a stopped build and removed)", build_dir, lock, age, stale_after)
            announced = True
        sleep(poll_s)

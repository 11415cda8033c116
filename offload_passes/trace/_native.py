"""Lazy build of the simulator's C++ core (``csrc/trace_sim.cpp``) through torch's cpp_extension + ninja,
cached under ``TORCH_EXTENSIONS_DIR`` like the custom-op CPU kernels. Importing never compiles."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

log = logging.getLogger("offload_passes.trace.native")

_SRC = Path(__file__).resolve().parent / "csrc" / "trace_sim.cpp"
_lock = threading.Lock()
_mod = None


def module():
    """The compiled ``simulate`` module (built on first use)."""
    global _mod
    if _mod is None:
        with _lock:
            if _mod is None:
                from torch.utils import cpp_extension

                log.info("building the offload-sim C++ core (cached after the first build)")
                _mod = cpp_extension.load(
                    name="offload_passes_trace_sim", sources=[str(_SRC)],
                    extra_cflags=["-O3"], verbose=False,
                )
    return _mod

"""One backend core for every exe_mode (docs/design.md §2): the NPU modes are the core with the NPU lowering, and
``lowering/npu.py`` (the NPU glue) never imports ``backend.py`` (no import cycle)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from offload_passes.backend import make_offload_backend

PS = 64


def test_npu_modes_do_not_import_the_backend():
    """No import cycle: the NPU glue never imports the backend core (it only provides lowerings)."""
    code = ("import sys, offload_passes.lowering.npu\n"
            "assert 'offload_passes.backend' not in sys.modules, 'npu_modes imported the backend'\n"
            "import offload_passes.backend as b\n"
            "assert 'offload_passes.lowering.npu' in sys.modules\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_npu_modes_source_names_no_backend_import():
    """The same, statically: no ``import`` statement of lowering/npu.py (lazy ones included) names backend."""
    import offload_passes.lowering.npu as nm

    tree = ast.parse(Path(nm.__file__).read_text())
    names = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            names += [n.module or ""] + [f"{n.module or ''}.{a.name}" for a in n.names]
        elif isinstance(n, ast.Import):
            names += [a.name for a in n.names]
    assert len(names) > 5 and not [m for m in names if m.split(".")[-1] == "backend"], names


@pytest.mark.parametrize("mode", ["ge_graph", "npugraph_ex"])
def test_npu_modes_run_in_the_one_core(mode):
    from offload_passes.backend import NpuOffloadBackend, OffloadBackend
    from offload_passes.modes import MODES

    be = make_offload_backend(exe_mode=mode, pool_size=PS, side_stream=False)
    assert isinstance(be, OffloadBackend) and type(be) is NpuOffloadBackend
    assert type(be.lowering).__name__ == "NpuLowering" and not be.lowering.state_from_caches
    assert be.lowering.side_stream is False and MODES[mode].lowering == "offload_passes.lowering.npu:NpuLowering"
    with pytest.raises(ValueError, match=r"\['npu_options'\] only apply to the NPU exe_modes"):
        make_offload_backend(exe_mode="eager", npu_options={"x": 1})

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


def test_a_compile_is_the_core_passes_then_the_lowerings():
    """``OffloadBackend.compile``: the lowering configures the context (its options reach the passes and the
    report; its install hook gets each layer's installs), then its passes run after the core's on the
    rewritten pre-AOT graph; a graph the core leaves unmodified still reaches them."""
    import torch

    from offload_passes import models
    from offload_passes.passes._fx import count_ops
    from offload_passes.passes.manager import StepPass

    be = make_offload_backend(exe_mode="eager", pool_size=PS)
    seen: list = []
    placed: list[int] = []

    def configure(ctx):
        ctx.use_options(ctx.options.replace(update_ledger=False))
        ctx.install_hook = lambda graph, installs, layer: placed.append(layer)

    def after_core(ctx):
        seen.append((ctx.stopped, list(ctx.reports), count_ops(ctx.gm.graph)["dsa_plan"]))

    be.lowering.configure = configure
    be.lowering.passes = lambda ctx: [StepPass("after_core", after_core)]
    torch._dynamo.reset()
    built = models.build("tiny", enable_offload=True)
    built.driver.run(steps=1, step_fn=torch.compile(built.model, backend=be))
    rep = be.reports[-1]
    assert rep["rewritten"] and rep["options"]["update_ledger"] is False
    assert seen[-1] == (None, ["detect", "group", "screen", "specialise", "preconditions", "decide", "build_state",
                               "rewrite"], 2)
    # every layer but a group's owner installs after its attention (groups [0..3], [4..7]); the owners' own
    # install follows the last layer's
    assert placed == [1, 2, 3, 5, 6, 7]
    torch._dynamo.reset()

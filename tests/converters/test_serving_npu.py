"""The serving loop (models/glm/serve.py: continuous batching on an engine's block tables, a C++ KV
transfer that moves no version counter, varying MTP acceptance) in npugraph_ex, through the CPU set-up
of tests/converters (``force_eager``: our kernels, exact; the NPU default bookkeeping, off): every step
equals the unmodified model, and each layer's installs start after the gather a paged group keeps."""
from __future__ import annotations

import operator
import sys
from pathlib import Path

from offload_passes import _compat

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))


def test_npugraph_ex_serving_loop_matches_the_unmodified_model(torchair, npugraph_ex_pkg, torch_npu_double,
                                                               npugraph_ex_capture):
    import test_serving as T  # tests/backend/test_serving.py: the same loop, eager
    from offload_passes import make_offload_backend

    cfg = npugraph_ex_pkg.CompilerConfig()
    _compat.set_npugraph_ex_option(cfg, "force_eager", True)
    _compat.set_npugraph_ex_option(cfg, "pattern_fusion_pass", False)  # traces torch.ops.npu kernels, absent on CPU
    with npugraph_ex_capture() as captured, torch_npu_double.installed():
        be = make_offload_backend(pool_size=256, exe_mode="npugraph_ex", compiler_config=cfg)
        srv, diffs, _ = T._serve(10, be)
    assert srv.batch_changes >= 3 and max(diffs) == 0.0, diffs
    # no per-step statistics without npu_bookkeeping (the NPU default): warm = rows resident in the pools
    st = T.module_state(srv.lanes[1].model)
    assert st.groups and sum(int((g.pool_ids >= 0).sum()) for g in st.groups) > 0
    rep = be.reports[-1]
    assert rep["rewritten"] and all(g["paged"] for g in rep["groups"])
    nodes = list(captured["graph"].nodes)
    gathers = [n for n in nodes if "npu_gather_selection_kv_cache" in str(n.target)]
    installs = [n for n in nodes if "dsa_install" in str(n.target)]
    assert len(gathers) == len(installs) == srv.lanes[1].model.config.num_hidden_layers
    # every install reads the selection buffer its layer's gather finished: the gather's output (functional
    # form) or, in place, the buffer the gather wrote before it (selection_kv_cache is argument 1 of both)
    for i in installs:
        sel = i.args[1]
        src = sel.args[0] if sel.op == "call_function" and sel.target is operator.getitem else sel
        if src in gathers:
            continue
        writer = [g for g in gathers if g.args[1] is sel]
        assert len(writer) == 1 and nodes.index(writer[0]) < nodes.index(i), (i.name, sel.name)

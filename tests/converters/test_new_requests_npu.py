"""New requests in the NPU modes (docs/new-requests.md) through the CPU set-ups of tests/converters:
npugraph_ex runs (``force_eager``: our kernels, exact) with the default bookkeeping (off: no ledger, the
configuration an Atlas user gets) and with it on; ge_graph stops where CANN would compile, so it is
checked on the graph it hands to TorchAir: the outside-write flag and the length window feed the
invalidation before each plan."""
from __future__ import annotations

import os

import pytest
import torch

import new_request_cases as N
from offload_passes import _compat

CI_CELLS = [N.Cell("tiny", "npugraph_ex", False, 0)]
CELLS = N.full_matrix(("npugraph_ex",)) if os.environ.get("OFFLOAD_PASSES_LONG") == "1" else CI_CELLS


def test_ge_graph_invalidation_reads_the_outside_write_flag_before_every_plan(torchair, tmp_path):
    from offload_passes.backend import NpuOffloadBackend

    torch._dynamo.reset()
    from offload_passes import models

    b = models.build("tiny", enable_offload=True, prefill_len=128)
    b.driver.prefill()
    graphs = []
    be = NpuOffloadBackend(exe_mode="ge_graph", pool_size=256)

    def capture(gm, ex):
        fn = be(gm, ex)
        graphs.append(gm)
        return fn

    with pytest.raises(RuntimeError, match="GE graphs cannot be compiled without CANN"):
        b.driver.step(torch.compile(b.model, backend=capture))
    (gm,) = graphs
    rep = be.reports[-1]
    assert rep["rewritten"] and rep["side_stream"]
    nodes = list(gm.graph.nodes)
    plans = [n for n in nodes if "dsa_plan" in str(n.target)]
    flags = [n for n in nodes if n.op == "get_attr" and "external_write" in str(n.target)]
    assert len(plans) == len(b.model.config.index_groups()) == len(flags)
    for plan, flag in zip(plans, flags):
        # the flag is read (ne 0) and the result reaches the plan's pool_ids through the masked update
        assert any(u.target is torch.ops.aten.ne.Scalar for u in flag.users)
        assert nodes.index(flag) < nodes.index(plan)
    # the ledger signal without the ledger update (ge_graph's default bookkeeping): before every plan the
    # owner layer's count column is compared with -1 (an engine's / the model's reset), and every layer's
    # ledger is written "served" (ids -1, count LEDGER_SERVED), not -1
    from offload_passes.passes.emit import LEDGER_SERVED

    assert not rep["bookkeeping"]
    resets = [n for n in nodes if n.target is torch.ops.aten.eq.Scalar and n.args[1] == -1]
    assert len(resets) == len(plans) and all(nodes.index(r) < nodes.index(p) for r, p in zip(resets, plans))
    marks = [n for n in nodes if n.target is torch.ops.aten.full.default and n.args[1] == LEDGER_SERVED]
    assert len(marks) == len(b.model.model.layers), len(marks)


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_npugraph_ex_refill_paths_match_the_unmodified_model(cell, torchair, npugraph_ex_pkg, torch_npu_double):
    # (torchair first: importing npugraph_ex before TorchAir's test copy breaks TorchAir's own imports)
    cfg = npugraph_ex_pkg.CompilerConfig()
    _compat.set_npugraph_ex_option(cfg, "force_eager", True)
    _compat.set_npugraph_ex_option(cfg, "pattern_fusion_pass", False)  # traces torch.ops.npu kernels, absent on CPU
    if cell.frontend.startswith("hf"):
        _import_transformers_before_the_double()
    with torch_npu_double.installed():
        out = N.run_matrix_cell(cell, cfg)
    assert out["_rewritten"] == [1.0] and out["_resident"][0] > 0, out
    bad = {k: v for k, v in out.items() if not k.startswith("_") and max(v) > N.tolerance(cell)}
    assert not bad, f"{cell.id}: steps off the unmodified model: {bad}"


def test_hf_graph_in_npugraph_ex_gets_side_stream_installs_after_their_serve(torchair, npugraph_ex_pkg,
                                                                              torch_npu_double, npugraph_ex_capture):
    """The HF front-end goes through the same core as the recipe form: in npugraph_ex each layer's
    installs run in the side-stream scope, after an event recorded right after that layer's serve, and
    the refill paths still match the unmodified model."""
    cfg = npugraph_ex_pkg.CompilerConfig()
    _compat.set_npugraph_ex_option(cfg, "force_eager", True)
    _compat.set_npugraph_ex_option(cfg, "pattern_fusion_pass", False)
    _import_transformers_before_the_double()
    with npugraph_ex_capture() as captured, torch_npu_double.installed():
        out = N.run_matrix_cell(N.Cell("hf-tiny", "npugraph_ex", False, 0), cfg)
    assert out["_rewritten"] == [1.0] and out["_resident"][0] > 0, out
    bad = {k: v for k, v in out.items() if not k.startswith("_") and max(v) > N.HF_REL_TOL}
    assert not bad, bad
    nodes = list(captured["graph"].nodes)
    name = [str(n.target) for n in nodes]
    serves = [i for i, t in enumerate(name) if "dsa_serve" in t]
    installs = [i for i, t in enumerate(name) if "dsa_install" in t]
    assert len(serves) == 8 and len(installs) == 8, (len(serves), len(installs))
    for i in installs:  # every install sits inside a side-stream scope opened after a serve
        enter = max(j for j in range(i) if name[j].endswith("scope_enter.default"))
        exit_ = min(j for j in range(i, len(name)) if name[j].endswith("scope_exit.default"))
        assert any(name[j].endswith("tagged_event_wait.default") for j in range(enter, i))
        assert enter > max(j for j in serves if j < i)
        assert exit_ > i


def _import_transformers_before_the_double() -> None:
    """transformers probes for torch_npu (importlib.util.find_spec) when its modeling code is first
    imported; the torch_npu test double has no spec: import it before the double is in place."""
    from offload_passes.models import hf
    from transformers.utils import import_utils

    hf.build("hf-tiny", dtype="bfloat16")
    import_utils.is_torch_npu_available()


def test_npugraph_ex_random_engine_schedules_match_the_unmodified_model(torchair, npugraph_ex_pkg, torch_npu_double):
    """The cut of tests/backend/test_engine_schedules.py that runs in npugraph_ex (``force_eager``: our
    kernels, exact) with its default bookkeeping (off: the rewrite does not keep the ledger): random engine
    schedules on the project's scheduler, the lane glued by the engine adapter and the lane told nothing
    both equal to the unmodified model at every step."""
    from hypothesis import HealthCheck, given, settings

    import engine_world as W

    cfg = npugraph_ex_pkg.CompilerConfig()
    _compat.set_npugraph_ex_option(cfg, "force_eager", True)
    _compat.set_npugraph_ex_option(cfg, "pattern_fusion_pass", False)
    with torch_npu_double.installed():
        world = W.World(W.Cell(2, False, mode="npugraph_ex"), compiler_config=cfg)

        @settings(max_examples=6 if os.environ.get("OFFLOAD_PASSES_LONG") == "1" else 2, deadline=None,
                  derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
        @given(sched=W.SCHEDULES)
        def run(sched):
            out = world.run(sched)
            assert max(out["told"]) == 0.0 and max(out["blind"]) == 0.0, (sched, out)

        run()
    reps = [be.reports[-1] for be in world.backends]
    assert all(r["rewritten"] and r["mode"] == "npugraph_ex" and not r["bookkeeping"] for r in reps), reps

"""The compile flow as one pass list (``pipeline.CORE_PASSES`` then a lowering's passes): which passes run,
in which order, what a stopped flow skips, and the ops counted before and after (``count_ops``)."""
from __future__ import annotations

import pytest
import torch
from torch import fx

import offload_passes  # noqa: F401  (registers the ops)
from offload_passes.options import OffloadOptions
from offload_passes.passes._fx import count_ops
from offload_passes.passes.manager import CORE_TIMINGS, CompileContext, StepPass, run_passes
from offload_passes.pipeline import CORE_PASSES, rewrite_for_offload
from test_rewrite_pass import recipe_graph

ALL_CORE = ["detect", "group", "screen", "specialise", "preconditions", "decide", "build_state", "rewrite"]


def _ctx(gm: fx.GraphModule, inputs: list, **opts) -> CompileContext:
    return CompileContext.start(gm, inputs, "graph_pipeline_test", OffloadOptions(pool_size=64, **opts))


def test_the_core_passes_in_order_and_what_they_report():
    assert [p.name for p in CORE_PASSES] == ALL_CORE
    gm, inputs = recipe_graph("FSSFS")
    before = count_ops(gm.graph)
    seen: list[str] = []
    lowering = [StepPass("after_core", lambda ctx: seen.append(ctx.stopped or "rewritten"))]
    ctx = run_passes(_ctx(gm, inputs), [*CORE_PASSES, *lowering])
    assert list(ctx.reports) == ALL_CORE + ["after_core"] and seen == ["rewritten"]
    assert ctx.frontend.name == "recipe" and [g.layers for g in ctx.groups.groups] == [[0, 1, 2], [3, 4]]
    assert ctx.outcome.verdict.value == "rewritten" and ctx.outcome.offload_groups == (0, 1)
    after = count_ops(gm.graph)
    assert (before["dsa_plan"], before["dsa_serve"], before["npu_gather_selection_kv_cache"]) == (0, 0, 5)
    assert (after["dsa_plan"], after["dsa_serve"], after["npu_gather_selection_kv_cache"]) == (2, 5, 0)
    assert ctx.report.ops == {"before": before, "after": after}
    assert set(CORE_TIMINGS) | {"alloc_s"} <= set(ctx.report.timings)


def test_a_graph_without_a_site_stops_after_detect_and_the_lowering_passes_still_run():
    gm = fx.symbolic_trace(lambda x: torch.topk(x.relu(), 2, dim=-1)[1])
    seen: list[str] = []
    ctx = run_passes(_ctx(gm, [torch.randn(3, 4)]),
                     [*CORE_PASSES, StepPass("after_core", lambda ctx: seen.append(ctx.stopped))])
    assert list(ctx.reports) == ["detect", "after_core"]
    assert seen == ["no DSA site in the graph; passing it through"]
    assert ctx.report.ops["before"] == ctx.report.ops["after"] and not ctx.report.rewritten
    # the core's timings are in every report, 0.0 for a pass that did not run; no state was built
    assert {k: ctx.report.timings[k] for k in CORE_TIMINGS[1:]} == {"group_s": 0.0, "plan_s": 0.0, "rewrite_s": 0.0}
    assert "alloc_s" not in ctx.report.timings


def test_offload_off_skips_the_preconditions_and_refuses_the_recipe_form():
    gm, inputs = recipe_graph("FS")
    before = count_ops(gm.graph)
    ctx = run_passes(_ctx(gm, inputs, enable_offload=False), CORE_PASSES)
    assert list(ctx.reports) == ["detect", "group", "screen", "specialise", "decide"]
    assert ctx.stopped == "refused" and [r["reason"] for r in ctx.report.refusals] == ["disabled"]
    assert count_ops(gm.graph) == before  # unmodified


def test_a_lowering_configures_the_context_before_the_passes():
    """``use_options``: what the passes read and the report records; the rewrite reads the install hook."""
    gm, inputs = recipe_graph("FS")
    ctx = _ctx(gm, inputs)
    ctx.use_options(ctx.options.replace(update_ledger=False))
    placed: list[tuple[int, int]] = []
    ctx.install_hook = lambda graph, installs, layer: placed.append((layer, len(installs)))
    run_passes(ctx, CORE_PASSES)
    # the owner (layer 0) installs nothing of its own; after layer 1: its install, then the owner's
    assert ctx.report.options["update_ledger"] is False and placed == [(1, 2)]


@pytest.mark.parametrize("guards, n", [(True, 4), (False, 0)])
def test_rewrite_for_offload_runs_the_core_passes(guards, n):
    """The public entry without a lowering; the mode's guards unless told (two identity tables and one
    lengths input of a two-layer group: lengths, full table, and each layer's selection table)."""
    gm, inputs = recipe_graph("FS")
    gm, state, report = rewrite_for_offload(gm, inputs, OffloadOptions(pool_size=64), in_graph_guards=guards)
    assert state is not None and report.rewritten and len(report.guards) == n
    assert count_ops(gm.graph)["dsa_install"] == 2

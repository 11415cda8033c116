"""Module buffers as graph inputs or as attributes: ``inline_inbuilt_nn_modules`` True and False.

The reference compiles with ``torch._dynamo.config.inline_inbuilt_nn_modules = False``. torch 2.8
honours it: caches, block tables and ledgers then reach the graph as ``get_attr`` nodes (emitted where
first used) instead of placeholders. torch 2.13 ignores the flag (always inlined). Either way the
``tiny`` model is rewritten and bit-exact against the unmodified model.
"""
from __future__ import annotations

import pytest
import torch
from torch import fx

from offload_passes import _compat, models
from offload_passes.backend import make_offload_backend
from offload_passes.passes import _fx

STEPS = 4
PS = 64


@pytest.mark.filterwarnings("ignore:.*inline_inbuilt_nn_modules.*:FutureWarning")
@pytest.mark.parametrize("inline", [True, False], ids=["inline", "no-inline"])
def test_tiny_rewritten_and_exact(inline):
    over = dict(enable_offload=True, decode_steps=STEPS)
    base, comp = models.build("tiny", **over), models.build("tiny", **over)
    be = make_offload_backend(pool_size=PS, pa_block_size=comp.runner.pa_block_size)
    forms = []

    def backend(gm, example_inputs):  # records how the caches reached the graph, then compiles
        attrs = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
        forms.append(any("sel_kv" in str(t) for t in attrs))
        return be(gm, example_inputs)

    ref = base.driver.run(steps=STEPS, collect=True)
    comp.model.return_internals = True  # per-layer attention outputs, as Driver.run(collect=True)
    with torch._dynamo.config.patch(inline_inbuilt_nn_modules=inline):
        step = torch.compile(comp.model, backend=backend)
        comp.driver.prefill()
        outs = [comp.driver.step(step) for _ in range(STEPS)]
    # torch 2.8 honours the flag; 2.13 always inlines (buffers are placeholders)
    assert forms == [not inline and _compat.TORCH_VERSION < (2, 13)]
    rep = be.reports[-1]
    assert rep["rewritten"] and rep["refusals"] == [] and rep["reinplace"]["kept_functional"] == []
    assert [g["layers"] for g in rep["groups"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    after = rep["ops"]["after"]
    assert (after["dsa_plan"], after["dsa_serve"], after["dsa_install"]) == (2, 8, 8)
    for a, b in zip(ref.steps, outs):
        assert (a.logits.float() - b.logits.float()).abs().max().item() == 0
        assert len(a.attn) == len(b.attn) == 8 and all(torch.equal(x, y) for x, y in zip(a.attn, b.attn))


def _graph_with_late_attr() -> fx.GraphModule:
    root = torch.nn.Module()
    root.register_buffer("cache", torch.arange(6.0))
    root.register_buffer("table", torch.arange(3))
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.add, (x, 1))
    c = g.get_attr("cache")  # emitted where first used, as Dynamo does without inlining
    z = g.call_function(torch.mul, (y, c))
    t = g.get_attr("table")
    g.output((z, t))
    return fx.GraphModule(root, g)


def test_hoist_attrs_moves_attributes_after_placeholders():
    gm = _graph_with_late_attr()
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_function", "get_attr", "call_function",
                                              "get_attr", "output"]
    assert _fx.hoist_attrs(gm.graph) == 2
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "get_attr", "get_attr", "call_function",
                                              "call_function", "output"]
    assert _fx.hoist_attrs(gm.graph) == 0  # already in place
    gm.graph.lint()
    gm.recompile()
    z, t = gm(torch.ones(6))
    assert torch.equal(z, 2 * torch.arange(6.0)) and torch.equal(t, torch.arange(3))


def test_input_values_and_graph_input_or_attr():
    gm = _graph_with_late_attr()
    x = torch.zeros(6)
    vals = _fx.input_values(gm, [x])
    by_name = {n.name: v for n, v in vals.items()}
    assert set(by_name) == {"x", "cache", "table"}
    assert by_name["x"] is x and by_name["cache"] is gm.cache and by_name["table"] is gm.table
    kinds = {n.op: _fx.is_graph_input_or_attr(n) for n in gm.graph.nodes}
    assert kinds == {"placeholder": True, "get_attr": True, "call_function": False, "output": False}
    assert not _fx.is_graph_input_or_attr(3)

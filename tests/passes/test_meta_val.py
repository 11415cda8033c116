"""Every node the passes create carries ``meta["val"]``: a fake value with the shape and dtype of what the
node really produces (checked by running the graph on real inputs with an ``fx.Interpreter``).

* after the pre-AOT rewrite (``rewrite_for_offload``) of the recipe ``tiny`` model and of the Hugging
  Face front-end (plan / serve / install, guards, bookkeeping, sparse attention, state attributes);
* after the post-AOT reinplace (the final eager graph, every ``call_function`` node).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

from offload_passes import _compat, models
from offload_passes.backend import make_offload_backend, rewrite_for_offload
from offload_passes.options import OffloadOptions

PS = 64


class _Recorder(fx.Interpreter):
    """Runs the graph and keeps every ``call_function`` node's result."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.results: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op == "call_function":
            self.results[n] = out
        return out


def _mismatch(val: Any, real: Any) -> str:
    """'' when the fake ``val`` describes ``real`` (shapes, dtypes, structure), else what differs."""
    if isinstance(real, torch.Tensor):
        if not isinstance(val, torch.Tensor):
            return f"val {type(val).__name__}, produced a tensor"
        if tuple(val.shape) != tuple(real.shape) or val.dtype != real.dtype:
            return f"val {tuple(val.shape)} {val.dtype}, produced {tuple(real.shape)} {real.dtype}"
        return ""
    if isinstance(real, (tuple, list)):
        if not isinstance(val, (tuple, list)) or len(val) != len(real):
            return f"val {val!r}, produced a sequence of {len(real)}"
        return next((m for m in (_mismatch(v, r) for v, r in zip(val, real)) if m), "")
    if real is None:
        return "" if val is None else f"val {val!r}, produced None"
    return ""  # python scalars (sizes): nothing to compare


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


def _check(gm: fx.GraphModule, args: list, only: set | None = None, none_unset: bool = False) -> int:
    """Run ``gm`` on ``args``; every call_function node (of ``only`` if given) must have a matching
    ``meta["val"]`` (``none_unset``: a node producing None may have none, AOT's convention for its own
    side-effect-only nodes such as ``_assert_async``). Returns the number of nodes checked."""
    rec = _Recorder(gm)
    rec.run(*args)
    checked = 0
    for n, real in rec.results.items():
        if only is not None and n.name not in only:
            continue
        if none_unset and real is None and "val" not in n.meta:
            continue
        assert "val" in n.meta, f"{n.name} ({n.target}) has no meta['val']"
        why = _mismatch(n.meta["val"], real)
        assert not why, f"{n.name} ({n.target}): {why}"
        checked += 1
    return checked


def _rewrite_capture(model: torch.nn.Module, step, **opts: Any) -> dict:
    """Compile with a backend that runs the rewrite core, then checks the rewritten graph on a clone of
    the real inputs, and runs it unmodified (eager, the pre-AOT graph is runnable as it is)."""
    out: dict = {}

    def backend(gm: fx.GraphModule, example_inputs: list) -> Any:
        before = {n.name for n in gm.graph.nodes}
        gm, state, report = rewrite_for_offload(gm, example_inputs, OffloadOptions(**opts))
        new = {n.name for n in gm.graph.nodes if n.op in ("call_function", "get_attr")} - before
        out.update(report=report, new=new, checked=_check(gm, [_clone(x) for x in example_inputs], new),
                   kinds={str(n.target) for n in gm.graph.nodes if n.name in new})
        for n in gm.graph.nodes:
            if n.name in new and n.op == "get_attr":  # the state buffers: fakes of the real tensors
                real = _attr_of(gm, n)
                assert not _mismatch(n.meta.get("val"), real), n.name
        return gm.forward

    step(torch.compile(model, backend=backend))
    return out


def _attr_of(gm: fx.GraphModule, n: fx.Node) -> torch.Tensor:
    obj: Any = gm
    for part in str(n.target).split("."):
        obj = getattr(obj, part)
    return obj


def test_rewrite_gives_every_new_node_a_fake_value_tiny():
    torch._dynamo.reset()
    b = models.build("tiny", enable_offload=True, decode_steps=2)
    b.driver.prefill()
    out = _rewrite_capture(b.model, b.driver.step, pool_size=PS, pa_block_size=b.runner.pa_block_size)
    assert out["report"]["rewritten"], out["report"]["refusals"]
    kinds = out["kinds"]
    for op in ("custom.dsa_plan.default", "custom.dsa_serve.default", "custom.dsa_install.default",
               "aten._assert_async.msg", "aten.copy_.default"):
        assert op in kinds, (op, sorted(kinds))
    # 2 groups x (plan + stats + invalidation) + 8 x (serve + ledger) + 8 installs + guards: well over 100
    assert out["checked"] > 100, out["checked"]


def test_rewrite_gives_every_new_node_a_fake_value_hf():
    from models import hf

    torch._dynamo.reset()
    over = dict(num_hidden_layers=4, index_topk_pattern="FSSS", dtype="bfloat16", decode_steps=2)
    comp = hf.build("hf-tiny", attn="eager", **over)
    out = _rewrite_capture(comp.model, lambda fn: comp.run(fn, steps=1))
    rep = out["report"]
    assert rep["rewritten"] and rep["hf"]["offload"], rep["hf"]
    assert {"custom.dsa_plan.default", "custom.dsa_serve.default", "custom.dsa_install.default"} <= out["kinds"]
    assert any("hf_sparse_attention_rows" in k for k in out["kinds"]), sorted(out["kinds"])
    assert out["checked"] > 20, out["checked"]


def test_reinplaced_graph_keeps_fake_values(monkeypatch):
    """The final (post-AOT, reinplaced) eager graph: every call_function node, the in-place ops our
    reinplace made included, has a ``val`` matching what it produces on the real call's inputs."""
    calls: list = []
    make = _compat.make_boxed_func

    def recording_make_boxed_func():
        boxed = make()

        def wrap(f):
            def run(*args):
                calls.append([_clone(a) for a in args])  # the inputs before the graph mutates them
                return f(*args)
            return boxed(run)
        return wrap

    monkeypatch.setattr(_compat, "make_boxed_func", recording_make_boxed_func)
    torch._dynamo.reset()
    b = models.build("tiny", enable_offload=True, decode_steps=2)
    b.driver.prefill()
    be = make_offload_backend(pool_size=PS, pa_block_size=b.runner.pa_block_size)
    b.driver.step(torch.compile(b.model, backend=be))
    rep = be.reports[-1]
    assert rep["rewritten"] and rep["reinplace"]["reinplaced"], rep.get("reinplace")
    graph = be.final_graph()
    assert calls and graph is not None
    checked = _check(graph.owning_module, calls[-1], none_unset=True)
    # the in-place ops our reinplace made (they return nothing: val None, set explicitly)
    ours = [n for n in graph.nodes if n.op == "call_function" and str(n.target) in (
        "custom.dsa_install.default", "custom.dsa_serve.default", "custom.dsa_plan.default")]
    assert len(ours) == 8 + 8 + 2 and all("val" in n.meta for n in ours), [n.name for n in ours]
    unset = [n for n in graph.nodes if n.op == "call_function" and "val" not in n.meta]
    assert {str(n.target) for n in unset} <= {"aten._assert_async.msg"}, unset
    assert checked == sum(1 for n in graph.nodes if n.op == "call_function") - len(unset) > 100

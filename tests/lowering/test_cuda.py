"""Structure of the exe_mode="cuda" graph, built on CPU tensors (no GPU here).

The ``tiny`` recipe model (8 layers ``FSSSFSSS``, groups {0..3}, {4..7}) is compiled by the offload
backend with :class:`CudaLowering` in place of the CPU lowering. TEST ARRANGEMENT: the backend is built
as ``exe_mode="eager"`` and its ``lowering`` attribute replaced, because the ``cuda`` mode name is
registered by ``offload_passes/modes.py`` (not in this change); on CPU tensors the stream ops' runtime
(:class:`StreamRuntime`) is a no-op that only logs its calls, a test double of the CUDA streams.

Checked on the rewritten (pre-AOT) graph and on the final (post-reinplace) graph that runs:
each installing layer's installs sit right after its own serve inside one scope_enter/scope_exit pair,
the plan's install records (a main-stream intermediate) get record_stream, the main stream joins every
scope exactly once and after the scope; the host-resident full caches are graph inputs; the schedule
runs and gives the unmodified model's logits bit for bit.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import fx

from offload_passes import models
from offload_passes.backend import OffloadBackend, backend_for_options, make_offload_backend
from offload_passes.lowering.cuda import (CUDA_MODE, RUNTIME, STREAM_OPS, UNSUPPORTED_COMPILE_MODES, CudaInstallHook,
                                          CudaLowering)
from offload_passes.options import OffloadOptions
from offload_passes.passes.manager import CompileContext, StepPass

STEPS = 3


def _name(n) -> str:
    return str(n.target)


def _is(n, op: str) -> bool:
    return n.op == "call_function" and n.target is STREAM_OPS[op]


def _custom(n, op: str) -> bool:
    return n.op == "call_function" and f"custom.{op}" in _name(n)


@pytest.fixture(scope="module")
def compiled():
    torch._dynamo.reset()
    base, comp = models.build("tiny", enable_offload=True), models.build("tiny", enable_offload=True)
    be = OffloadBackend(exe_mode="eager", pool_size=64)
    be.lowering = CudaLowering(CUDA_MODE)
    graphs = {}
    orig_passes = be.lowering.passes
    # after the lowering's passes: the pre-AOT graph with the hook's nodes and the joins
    keep = StepPass("keep", lambda ctx: graphs.__setitem__("rewrite", ctx.gm.graph))
    be.lowering.passes = lambda ctx: [*orig_passes(ctx), keep]
    RUNTIME.calls.clear()
    res0 = base.driver.run(steps=STEPS)
    res1 = comp.driver.run(steps=STEPS, step_fn=torch.compile(comp.model, backend=be))
    rep = be.reports[-1]
    assert rep["rewritten"], rep["refusals"]
    yield dict(be=be, rep=rep, rewrite=graphs["rewrite"], final=be.final_graph(), res0=res0, res1=res1,
               calls=list(RUNTIME.calls))
    torch._dynamo.reset()


def _scopes(graph):
    """tag -> dict(enter, exit, join indices; installs inside; records) from one graph."""
    nodes = list(graph.nodes)
    out: dict = {}
    for i, n in enumerate(nodes):
        for op in ("scope_enter", "scope_exit", "stream_join"):
            if _is(n, op):
                out.setdefault(n.args[0], {}).setdefault(op, []).append(i)
        if _is(n, "record_stream"):
            out.setdefault(n.args[1], {}).setdefault("records", []).append(n.args[0])
    for tag, d in out.items():
        (a,), (b,) = d["scope_enter"], d["scope_exit"]
        d["inside"] = nodes[a + 1:b]
        d["installs"] = [n for n in d["inside"] if _custom(n, "dsa_install")]
    return nodes, out


@pytest.mark.parametrize("which", ["rewrite", "final"])
def test_each_layer_installs_on_the_side_stream_after_its_serve(compiled, which):
    graph = compiled[which]
    nodes, scopes = _scopes(graph)
    n_layers = 8
    groups = [g["layers"] for g in compiled["rep"]["groups"]]
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # one scope per layer that installs: the shared layers (md=0; the group's last one also carries the
    # owner's md=1 install), or the owner of a one-layer group
    scoped = sum(max(len(g) - 1, 1) for g in groups)
    assert scoped == 6 and len(scopes) == scoped
    serves = [i for i, n in enumerate(nodes) if _custom(n, "dsa_serve")]
    assert len(serves) == n_layers
    installs_seen = 0
    for tag, d in scopes.items():
        (a,), (b,), joins = d["scope_enter"], d["scope_exit"], d["stream_join"]
        assert len(joins) == 1 and joins[0] > b, f"tag {tag}: one join, after the scope"
        # nothing but the stream bookkeeping and the installs inside the scope
        assert all(_custom(n, "dsa_install") or _is(n, "record_stream") for n in d["inside"]), d["inside"]
        assert 1 <= len(d["installs"]) <= 2  # md=0 (shared layer) [+ the owner's md=1 on the group's last layer]
        installs_seen += len(d["installs"])
        # the scope opens right after a serve (the side stream waits for it, not for the attention)
        prev = [i for i in serves if i < a]
        assert prev and all(not _custom(nodes[j], "npu_sparse_flash_attention") for j in range(prev[-1], a))
        assert any("dsa_plan" in _name(r) or "getitem" in _name(r) for r in d.get("records", [])), \
            "the plan's install records must be recorded on the side stream"
    assert installs_seen == sum(len(g) for g in groups)  # md=0 per shared layer + one md=1 per group
    if which == "final":
        assert not any("functional" in _name(n) for n in nodes), "a functional twin survived reinplace"


def test_joins_are_before_the_output_and_reported(compiled):
    nodes, scopes = _scopes(compiled["final"])
    out = next(i for i, n in enumerate(nodes) if n.op == "output")
    assert all(d["stream_join"][0] < out for d in scopes.values())
    assert compiled["rep"]["side_stream"] is True
    assert len(compiled["rep"]["joins_before"]) == 6


def test_full_caches_are_graph_inputs_and_never_copied(compiled):
    """The full latent/rope caches (host-resident on a GPU) reach dsa_serve as graph inputs, unchanged."""
    graph = compiled["final"]
    placeholders = {n for n in graph.nodes if n.op == "placeholder"}
    serves = [n for n in graph.nodes if _custom(n, "dsa_serve")]
    for s in serves:
        full_kv, full_rope = s.args[1], s.args[2]
        for t in (full_kv, full_rope):
            base = t
            while base.op == "call_function" and base.args and "view" in _name(base):
                base = base.args[0]
            assert base in placeholders, f"{s.name}: full cache {t} is not a graph input"
    copied = [n for n in graph.nodes if "copy" in _name(n) and any(a in placeholders for a in n.all_input_nodes)
              and any(_custom(u, "dsa_serve") for a in n.all_input_nodes for u in a.users)]
    assert not copied, copied


def test_schedule_runs_and_is_bit_exact(compiled):
    r0, r1 = compiled["res0"], compiled["res1"]
    assert len(r1.logits) == STEPS
    for a, b in zip(r0.logits, r1.logits):
        assert torch.equal(a, b)
    # the runtime saw, per step, every scope entered, exited and joined (in that order per tag)
    calls = compiled["calls"]
    per_tag: dict = {}
    for op, tag in calls:
        per_tag.setdefault(tag, []).append(op)
    assert len(per_tag) == 6
    for ops in per_tag.values():
        seq = [o for o in ops if o != "record_stream"]
        assert seq == ["scope_enter", "scope_exit", "stream_join"] * STEPS


def test_lowering_refuses_what_it_does_not_support():
    with pytest.raises(ValueError, match="exe_mode must be 'cuda'"):
        CudaLowering("eager")
    with pytest.raises(ValueError, match=r"\['compiler_config'\] only apply to the NPU exe_modes"):
        CudaLowering(CUDA_MODE, compiler_config=object())

    class Ctx:
        compile_mode = "reduce-overhead"

    for mode in UNSUPPORTED_COMPILE_MODES:
        Ctx.compile_mode = mode
        with pytest.raises(RuntimeError, match=f"does not support torch.compile\\(mode='{mode}'\\)"):
            CudaLowering(CUDA_MODE).lower(None, [], Ctx())


def test_torch_compile_mode_reaches_the_cuda_lowering_and_is_refused():
    """``torch.compile(model, backend=make_offload_backend(exe_mode="cuda"), mode="max-autotune")``: the mode
    reaches the lowering through Dynamo, and the CUDA lowering refuses it by name at the first call."""
    torch._dynamo.reset()
    built = models.build("tiny", enable_offload=True, decode_steps=1)
    step = torch.compile(built.model, backend=make_offload_backend(exe_mode="cuda", pool_size=64), mode="max-autotune")
    with pytest.raises(Exception, match=r"exe_mode='cuda' does not support torch.compile\(mode='max-autotune'\)"):
        built.driver.run(steps=1, step_fn=step)
    torch._dynamo.reset()


@pytest.mark.parametrize("entry", ["instance", "named"])
def test_a_cpu_mode_accepts_torch_compile_modes_with_no_effect(entry, caplog):
    """The CPU lowerings accept every torch.compile mode and say once per graph that it has no effect: the
    graph is the one a compile without ``mode`` gives (same report, same logits). ``named``: the
    ``dsa_offload`` backend (HF's ``CompileConfig(backend="dsa_offload")`` passes mode="reduce-overhead")."""
    torch._dynamo.reset()
    outs, reports = [], []
    for mode in (None, "reduce-overhead"):
        built = models.build("tiny", enable_offload=True, decode_steps=2)
        be = make_offload_backend(pool_size=8192) if entry == "instance" else backend_for_options({})
        with caplog.at_level(logging.INFO, logger="offload_passes.lowering"):
            caplog.clear()
            step = torch.compile(built.model, backend=be if entry == "instance" else "dsa_offload", mode=mode)
            outs.append(built.driver.run(steps=2, step_fn=step).logits)
        said = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
        assert said == ([] if mode is None else [f"{be.reports[-1]['graph_id']}: torch.compile mode='reduce-overhead' "
                                                 "has no effect (the lowering is exe_mode='eager')"])
        reports.append({k: be.reports[-1][k] for k in ("rewritten", "groups", "sites", "ops")})
        torch._dynamo.reset()
    assert reports[0]["rewritten"] and reports[0] == reports[1]
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_second_chance_compiles_and_runs_in_the_cuda_mode():
    """``make_offload_backend(exe_mode="cuda", replacement_policy="second_chance")``: the side-stream schedule
    reads the installs' arguments by role (``offload_ref::dsa_install_sc`` takes the plan first), so every
    second-chance install runs in its layer's scope after its serve, and the logits are the unmodified
    model's, bit for bit."""
    torch._dynamo.reset()
    base, comp = models.build("tiny", enable_offload=True), models.build("tiny", enable_offload=True)
    be = make_offload_backend(exe_mode="cuda", replacement_policy="second_chance", pool_size=64)
    r0 = base.driver.run(steps=STEPS)
    r1 = comp.driver.run(steps=STEPS, step_fn=torch.compile(comp.model, backend=be))
    rep = be.reports[-1]
    assert rep["rewritten"] and rep["side_stream"] and len(rep["joins_before"]) == 6
    nodes, scopes = _scopes(be.final_graph())
    sc = [n for n in nodes if "offload_ref.dsa_install_sc" in _name(n)]
    assert len(sc) == 8 and not any(_custom(n, "dsa_install") for n in nodes)
    inside = [n for d in scopes.values() for n in d["inside"] if "dsa_install_sc" in _name(n)]
    assert sorted(n.name for n in inside) == sorted(n.name for n in sc) and len(scopes) == 6
    assert all(torch.equal(a, b) for a, b in zip(r0.logits, r1.logits)) and len(r1.logits) == STEPS
    assert sum(c["total"]["hits"] for c in be.state.counters()) > 0
    torch._dynamo.reset()


def test_the_default_policy_is_second_chance_on_cuda_fifo_elsewhere():
    """``replacement_policy=None`` (the default) resolves per mode (``modes.Mode.default_policy``): second chance
    in the cuda mode (the best policy the trace study measures within the per-set state word, docs/cuda.md),
    FIFO in the CPU modes (the reference's) and the NPU modes (CANN's op); a policy given explicitly stays."""
    from offload_passes.options import OffloadOptions

    assert OffloadOptions(exe_mode="cuda").resolved_replacement_policy == "second_chance"
    assert OffloadOptions(exe_mode="cuda", replacement_policy="fifo").resolved_replacement_policy == "fifo"
    for mode in ("eager", "inductor", "ge_graph", "npugraph_ex"):
        assert OffloadOptions(exe_mode=mode).resolved_replacement_policy == "fifo"
    o = OffloadOptions(exe_mode="cuda")
    assert o.replacement_policy is None and o.to_dict()["resolved_replacement_policy"] == "second_chance"
    assert o.replace(exe_mode="ge_graph").resolved_replacement_policy == "fifo"  # the default follows the mode
    with pytest.raises(ValueError, match=r"replacement_policy='second_chance' needs exe_mode in \('eager', "
                                         r"'inductor', 'cuda'\)"):
        OffloadOptions(exe_mode="ge_graph", replacement_policy="second_chance")
    with pytest.raises(ValueError, match=r"option replacement_policy must be one of \('fifo', 'second_chance'\), "
                                         r"got 'gclock'"):
        OffloadOptions(exe_mode="cuda", replacement_policy="gclock")


def test_side_stream_off_keeps_the_cpu_schedule():
    def configured(lo: CudaLowering, graph_id: str) -> CompileContext:
        opts = OffloadOptions(exe_mode="cuda")
        ctx = CompileContext.start(fx.GraphModule(torch.nn.Module(), fx.Graph()), [], graph_id, opts)
        lo.configure(ctx)
        assert ctx.options is opts  # the options as given
        return ctx

    assert configured(CudaLowering(CUDA_MODE, side_stream=False), "g1").install_hook is None
    lo2 = CudaLowering(CUDA_MODE)
    hook = configured(lo2, "g2").install_hook
    assert isinstance(hook, CudaInstallHook) and hook.graph_id == "g2"
    assert [p.name for p in lo2.passes(None)] == ["side_stream_joins", "host_cache_writes", "device_safe_guards"]
    assert lo2.state_from_caches is True


# ------------------------------------------------------------------------------ device-safe guards

def test_guards_are_device_safe_in_the_cuda_mode(compiled):
    """Every in-graph guard of the rewrite (``aten._assert_async.msg``: a device-side assert on CUDA, which
    loses the context) is ``offload_cuda::guard`` in the graph that runs, with the same message."""
    from offload_passes.lowering.cuda import GUARD_OP

    be, rep = compiled["be"], compiled["rep"]
    replaced = be.lowering.guards[rep["graph_id"]]
    assert len(replaced) == len(rep["guards"]) > 0
    final = list(compiled["final"].nodes)
    assert [n for n in final if n.target is torch.ops.aten._assert_async.msg] == []
    guards = [n for n in final if n.target is GUARD_OP]
    assert len(guards) == len(replaced)
    assert all(isinstance(n.args[1], str) and n.args[1].startswith("offload guard:") for n in guards)


def test_guard_raises_on_the_host_now_and_on_the_device_at_the_next_step(compiled, triton_interpreted):
    """On a host tensor the guard raises at once; on the device it sets a pinned error word (the kernel of
    custom_ops/cuda/guard.py, run here by the interpreter on a host tensor) and the lowered step raises
    before its next call, then runs again normally."""
    from offload_passes import cuda
    from offload_passes.custom_ops.cuda import guard as G
    from offload_passes.lowering.cuda import GUARD_OP

    GUARD_OP(torch.tensor(True), "offload guard: fine")
    with pytest.raises(RuntimeError, match="^offload guard: broken$"):
        GUARD_OP(torch.tensor(False), "offload guard: broken")
    cuda.raise_device_errors()  # nothing pending
    G.flag(torch.tensor(True), "offload guard: holds")
    cuda.raise_device_errors()
    G.flag(torch.tensor(False), "offload guard: lengths out of range")  # no exception: a device cannot raise
    with pytest.raises(RuntimeError, match=r"^device-side check failed: offload guard: lengths out of range \(on cpu"):
        cuda.raise_device_errors()
    cuda.raise_device_errors()  # cleared
    step = compiled["be"].lowering.steps[compiled["rep"]["graph_id"]]
    G.flag(torch.tensor(False), "offload guard: seen by the next step")
    with pytest.raises(RuntimeError, match="offload guard: seen by the next step"):
        step()  # raises before it runs: the arguments are never read

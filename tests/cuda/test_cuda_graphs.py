"""CUDA graphs of the ``cuda`` lowering (``offload_passes/lowering/cuda_graphs.py``), on a CPU-only machine.

* :func:`capture_problems` over hand-built FX graphs with fake ``cuda:0`` values (a deliberate ``.item()``,
  a device-side assert, a host copy, a pageable host input) and over the lowered decode graph of the tiny
  recipe model on fake CUDA tensors (the session fixture ``flow`` of ``conftest.py``);
* :class:`GraphReplay`'s static-buffer logic with ``torch.cuda.CUDAGraph`` replaced by a TEST DOUBLE
  (:class:`RecordingGraph`): capture records the step's kernel launches, replay re-runs them on the
  addresses captured, writing the captured outputs in place; host Python code of the step is not replayed,
  as on a GPU;
* the lowering's wiring: ``cuda_graphs=True`` refuses a graph with a host synchronisation by node name and
  wraps a clean one.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import fx

import _fake_cuda as F
from offload_passes.custom_ops.cuda import guard as G
from offload_passes.custom_ops.cuda._common import raise_device_errors
from offload_passes.lowering import LowerContext
from offload_passes.lowering.cuda import CudaLowering
from offload_passes.lowering.cuda_graphs import (CaptureRefused, GraphReplay, InputSpec, capture_problems,
                                                 input_specs)
from offload_passes.options import OffloadOptions

aten = torch.ops.aten
CACHE_WRITE = torch.ops.offload_ref.npu_mla_prolog_cache_write_.default


# ------------------------------------------------------------------------------------ structural check

def _graph(build) -> fx.Graph:
    """An FX graph with fake values: ``build(g, ph)`` adds nodes; ``ph(name, shape, device)`` a placeholder."""
    mode = F.new_mode()
    g = fx.Graph()

    def ph(name, shape, device="cuda", dtype=torch.float32):
        n = g.placeholder(name)
        with mode:
            n.meta["val"] = torch.empty(shape, dtype=dtype, device=device)
        return n

    def call(target, args, val_of, name=None):
        n = g.call_function(target, args, name=name)
        with mode:
            n.meta["val"] = val_of()
        return n

    out = build(g, ph, call, mode)
    g.output(out)
    return g


def test_clean_graph_with_a_host_cache_write_has_no_problem():
    def build(g, ph, call, mode):
        kvc, krc = ph("kv_cache", (4, 2, 1, 8), "cpu"), ph("kr_cache", (4, 2, 1, 4), "cpu")
        idx = ph("idx", (3,), dtype=torch.int64)
        kv, kr = ph("kv", (3, 8)), ph("kr", (3, 4))
        g.call_function(CACHE_WRITE, (kvc, krc, idx, kv, kr))
        return call(aten.mul.Tensor, (kv, kv), lambda: torch.empty(3, 8, device="cuda"))

    assert capture_problems(_graph(build)) == []


def test_a_deliberate_sync_is_reported_with_the_node_named():
    def build(g, ph, call, mode):
        x = ph("x", (4,))
        s = call(aten.sum.default, (x,), lambda: torch.empty((), device="cuda"))
        item = g.call_function(aten._local_scalar_dense.default, (s,), name="the_item")
        ok = call(aten.ge.Scalar, (x, 0), lambda: torch.empty(4, dtype=torch.bool, device="cuda"))
        g.call_function(aten._assert_async.msg, (ok, "x must be >= 0"), name="the_assert")
        nz = g.call_function(aten.nonzero.default, (x,), name="the_nonzero")
        return (x, item, nz)

    problems = capture_problems(_graph(build))
    assert problems == [
        "the_item: aten._local_scalar_dense.default: reads a device value on the host (.item())",
        "the_assert: aten._assert_async.msg: device-side assert (fatal to the CUDA context; use offload_cuda::guard)",
        "the_nonzero: aten.nonzero.default: output shape depends on the data (a host synchronisation)",
    ]


def test_host_tensors_other_than_a_pinned_cache_operand_are_reported():
    def build(g, ph, call, mode):
        kvc, krc = ph("kv_cache", (4, 2, 1, 8), "cpu"), ph("kr_cache", (4, 2, 1, 4), "cpu")
        idx, kv, kr = ph("idx", (3,), dtype=torch.int64), ph("kv", (3, 8)), ph("kr", (3, 4))
        g.call_function(CACHE_WRITE, (kvc, krc, idx, kv, kr))
        other = ph("host_scale", (8,), "cpu")  # a pageable host tensor used by an ATen op
        y = call(aten.mul.Tensor, (kv, other), lambda: torch.empty(3, 8, device="cuda"))
        back = call(aten._to_copy.default, (y,), lambda: torch.empty(3, 8), "to_host")  # a copy to the host
        back.kwargs = {"device": torch.device("cpu")}
        return (y, back)

    problems = capture_problems(_graph(build))
    assert [p.split(":")[0] for p in problems] == ["host_scale", "to_host"]
    assert "a host input other than a full cache" in problems[0]
    assert "a host tensor other than a full cache" in problems[1]


def test_the_cache_itself_read_by_an_aten_op_is_reported():
    """A host cache is allowed only at the pinned-address operands; any other use (here a host read by
    ``aten.sum``) puts the whole cache in question."""
    def build(g, ph, call, mode):
        kvc, krc = ph("kv_cache", (4, 2, 1, 8), "cpu"), ph("kr_cache", (4, 2, 1, 4), "cpu")
        idx, kv, kr = ph("idx", (3,), dtype=torch.int64), ph("kv", (3, 8)), ph("kr", (3, 4))
        g.call_function(CACHE_WRITE, (kvc, krc, idx, kv, kr))
        return call(aten.sum.default, (kvc,), lambda: torch.empty(()), "host_sum")

    problems = capture_problems(_graph(build))
    assert [p.split(":")[0] for p in problems] == ["kv_cache", "host_sum"]


def test_tiny_decode_graph_is_capturable(flow):
    """The lowered decode step of the tiny recipe model on fake CUDA: plan, serve, install, the host cache
    writes, the side-stream scope, the guards and the model's own indexer and sparse attention (device
    kernels, custom_ops/cuda/) raise no capture problem; tiny-w8a8 with in-place cache writes:
    tests/cuda/test_decode_ops_on_device.py."""
    g = flow["be"].final_graph()
    assert capture_problems(g) == []
    assert sum(1 for n in g.nodes if str(n.target) in ("offload_ref.npu_lightning_indexer.default",
                                                       "offload_ref.npu_sparse_flash_attention.default")) == 10


def test_an_op_without_a_cuda_kernel_is_reported():
    """An op of ours whose OpSpec names no CUDA kernel (here the MoE dispatch reference) cannot run on the
    device: a capture problem naming it."""
    dispatch = torch.ops.offload_ref.npu_moe_distribute_dispatch_v2.default

    def build(g, ph, call, mode):
        x = ph("x", (4, 8))
        return g.call_function(dispatch, (x,))

    problems = capture_problems(_graph(build))
    assert len(problems) == 1 and "has no CUDA kernel (its OpSpec.cuda_kernel is None)" in problems[0]


# ------------------------------------------------------------------------------------ replay (TEST DOUBLE)

class RecordingGraph:
    """TEST DOUBLE of ``torch.cuda.CUDAGraph`` behind ``TorchCudaGraph``'s interface: ``capture(fn)`` runs
    ``fn`` once, recording every :func:`launch` it makes (the kernel and its tensor arguments: fixed
    addresses), then restores the arguments those launches wrote (a capture records, it does not execute);
    ``replay()`` re-runs the recorded kernels on the same tensors and writes their results into the tensors
    captured as results. Python code between launches is not replayed (as on a GPU)."""

    active = None

    def __init__(self):
        self.launches = []
        self.replays = 0
        self.before = {}  # id -> (tensor, its value before the capture)

    def capture(self, fn):
        RecordingGraph.active = self
        try:
            return fn()
        finally:
            RecordingGraph.active = None
            for t, value in self.before.values():
                t.copy_(value)

    def replay(self):
        self.replays += 1
        for kernel, args, result in self.launches:
            new = kernel(*args)
            if result is not None:
                result.copy_(new)


def launch(kernel, *args):
    """A kernel launch of the test step: recorded when a :class:`RecordingGraph` is capturing."""
    rec = RecordingGraph.active
    if rec is not None:
        for a in args:
            rec.before.setdefault(id(a), (a, a.clone()))
    result = kernel(*args)
    if rec is not None:
        rec.launches.append((kernel, args, result))
    return result


def _accumulate(acc, x):
    acc.add_(x)  # in place; no result to write back


class Step:
    """A lowered step stand-in: host checks in Python (counted), then device work as launches: a guard
    (x >= 0, ``custom_ops/cuda/guard.py`` under the interpreter), ``y = x * w + n``, an in-place ``acc += x``."""

    def __init__(self):
        self.host_checks = 0

    def __call__(self, x, w, acc, n):
        self.host_checks += 1
        if x.shape != w.shape:
            raise RuntimeError("x and w must have one shape")
        launch(lambda t: G.flag((t >= 0).all(), "test step: x must be >= 0"), x)
        y = launch(lambda a, b: a * b + n, x, w)
        launch(_accumulate, acc, x)
        return [y]


SPECS = [InputSpec("x", "copy"), InputSpec("w", "fixed"), InputSpec("acc", "copy"), InputSpec("n", "value")]


@pytest.fixture
def replay():
    raise_device_errors()  # no flag left over from another test
    step = Step()
    r = GraphReplay(step, SPECS, mutated=[2], graph_factory=RecordingGraph)
    yield r, step
    try:
        raise_device_errors()
    except RuntimeError:
        pass


def test_replay_copies_inputs_into_static_buffers_and_outputs_alias(replay):
    r, step = replay
    w = torch.tensor([1.0, 2.0, 3.0])
    acc = torch.zeros(3)
    out0 = r(torch.tensor([1.0, 1.0, 1.0]), w, acc, 10)  # warm-up: eager
    assert r.graph is None and out0[0].tolist() == [11.0, 12.0, 13.0]
    out1 = r(torch.tensor([2.0, 0.0, 1.0]), w, acc, 10)  # capture (+ one replay for this call's result)
    assert r.graph is not None and r.graph.replays == 1
    assert out1[0].tolist() == [12.0, 10.0, 13.0]
    x2 = torch.tensor([0.5, 0.5, 4.0])
    out2 = r(x2, w, acc, 10)
    assert out2 is out1 and out2[0].data_ptr() == out1[0].data_ptr()  # the captured static outputs
    assert out2[0].tolist() == [10.5, 11.0, 22.0]
    assert r._static[0].tolist() == x2.tolist() and r._static[0].data_ptr() != x2.data_ptr()
    # the in-place acc update of every call reached the caller's tensor (a copied, mutated input)
    assert acc.tolist() == [1 + 2 + 0.5, 1 + 0 + 0.5, 1 + 1 + 4.0]
    assert r.replays == 1 and r.graph.replays == 2


def test_host_checks_run_once_outside_replay(replay):
    r, step = replay
    w, acc = torch.ones(4), torch.zeros(4)
    for i in range(6):
        r(torch.full((4,), float(i)), w, acc, 0)
    assert step.host_checks == 2  # the warm-up call and the capture; never in the 4 replays
    assert r.replays == 4


def test_a_new_signature_gets_its_own_capture_a_moved_fixed_input_a_new_one(replay):
    """A call with another shape, dtype or value is another signature: warmed up eagerly once, then captured
    on its own; the first signature still replays its own graph. A fixed input at another address drops its
    signature's capture (eager call, then a new capture on the new allocation); another number of inputs or
    a non-tensor where a tensor was traced is refused by name."""
    r, step = replay
    w, acc = torch.ones(4), torch.zeros(4)
    r(torch.ones(4), w, acc, 0)
    r(torch.ones(4), w, acc, 0)
    assert len(r.captures) == 1 and step.host_checks == 2
    w5, acc5 = torch.ones(5), torch.zeros(5)
    assert r(torch.ones(5), w5, acc5, 0)[0].tolist() == [1.0] * 5  # eager warm-up of (5,)
    assert len(r.captures) == 1 and r.eager_calls == 2
    assert r(torch.full((5,), 2.0), w5, acc5, 0)[0].tolist() == [2.0] * 5  # its capture
    assert len(r.captures) == 2 and step.host_checks == 4
    assert r(torch.full((4,), 3.0), w, acc, 0)[0].tolist() == [3.0] * 4  # the (4,) graph replays
    assert r(torch.full((4,), 3.0), w, acc, 7)[0].tolist() == [10.0] * 4  # value 7: a new signature (warm-up)
    assert step.host_checks == 5 and r.replays == 1
    w2 = torch.full((4,), 2.0)
    assert r(torch.ones(4), w2, acc, 0)[0].tolist() == [2.0] * 4  # w moved: eager, the (4,) capture dropped
    assert (r.recaptures, len(r.captures), step.host_checks) == (1, 1, 6)
    assert r(torch.ones(4), w2, acc, 0)[0].tolist() == [2.0] * 4  # captured on w2
    assert r(torch.full((4,), 5.0), w2, acc, 0)[0].tolist() == [10.0] * 4 and r.replays == 2
    assert (len(r.captures), step.host_checks) == (2, 7)
    with pytest.raises(CaptureRefused, match=r"called with 3 inputs, captured with 4"):
        r(torch.ones(4), w, acc)
    with pytest.raises(CaptureRefused, match=r"input w is a float, traced as a tensor"):
        r(torch.ones(4), 1.0, acc, 0)
    assert step.host_checks == 7 and r.replays == 2


def test_signatures_beyond_the_bound_run_eagerly():
    raise_device_errors()
    step = Step()
    r = GraphReplay(step, SPECS, mutated=[2], graph_factory=RecordingGraph, max_captures=1)
    w, acc = torch.ones(2), torch.zeros(2)
    for n in (0, 0, 1, 1, 1):
        out = r(torch.ones(2), w, acc, n)
        assert out[0].tolist() == [1.0 + n] * 2
    assert len(r.captures) == 1 and r.eager_calls == 4 and step.host_checks == 5


def test_a_guard_flagged_in_a_replay_raises_on_the_next_call(replay):
    r, step = replay
    w, acc = torch.ones(2), torch.zeros(2)
    r(torch.ones(2), w, acc, 0)
    r(torch.ones(2), w, acc, 0)
    r(torch.tensor([1.0, -1.0]), w, acc, 0)  # the replayed guard kernel sets the pinned word; no raise yet
    with pytest.raises(RuntimeError, match="test step: x must be >= 0"):
        r(torch.ones(2), w, acc, 0)
    out = r(torch.ones(2), w, acc, 0)  # the word was cleared: the next call replays again
    assert out[0].tolist() == [1.0, 1.0] and r.replays == 2


def test_warmup_must_be_positive():
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        GraphReplay(Step(), SPECS, warmup=0)


# ------------------------------------------------------------------------------------ the lowering's wiring

def _ctx(gid, cuda_graphs=True, compile_mode=None):
    report = SimpleNamespace(rewritten=False, timings={})
    return LowerContext(gid, OffloadOptions(exe_mode="cuda", cuda_graphs=cuda_graphs), None, report, None,
                        compile_mode=compile_mode)


@pytest.fixture
def double(monkeypatch):
    """The lowering captures with the TEST DOUBLE (tests/cuda/_capture_double.py), which captures host graphs."""
    import _capture_double

    return _capture_double.install(monkeypatch)


def test_lowering_refuses_a_graph_with_a_sync_by_node_name(double):
    def build(g, ph, call, mode):
        x = ph("x", (3,))
        s = call(aten.sum.default, (x,), lambda: torch.empty((), device="cuda"))
        return g.call_function(aten._local_scalar_dense.default, (s,), name="the_item")

    gm = fx.GraphModule(torch.nn.Module(), _graph(build))
    low = CudaLowering()
    with pytest.raises(RuntimeError, match=r"cuda_graphs=True: graph g1 cannot be captured in one CUDA graph \(1 "
                                           r"problems\): the_item: .*reads a device value on the host"):
        low.lower(gm, [torch.ones(3)], _ctx("g1"))
    assert low.capture_problems["g1"] == [
        "the_item: aten._local_scalar_dense.default: reads a device value on the host (.item())"]
    with pytest.raises(RuntimeError, match=r"mode='reduce-overhead': graph g3 cannot be captured in one CUDA graph"):
        low.lower(gm, [torch.ones(3)], _ctx("g3", cuda_graphs=False, compile_mode="reduce-overhead"))


@pytest.mark.parametrize("how", [dict(cuda_graphs=True), dict(cuda_graphs=False, compile_mode="reduce-overhead")])
def test_lowering_wraps_a_clean_graph_in_a_replay(double, how):
    def build(g, ph, call, mode):
        x, w = ph("x", (3,)), ph("w", (3,))
        return (call(aten.mul.Tensor, (x, w), lambda: torch.empty(3, device="cuda")),)

    gm = fx.GraphModule(torch.nn.Module(), _graph(build))
    low = CudaLowering()
    step = low.lower(gm, [torch.ones(3), torch.ones(3)], _ctx("g2", **how))
    assert isinstance(step, GraphReplay) and low.replays["g2"] is step and low.capture_problems["g2"] == []
    # no Dynamo source on these placeholders: both are fixed inputs
    assert [s.kind for s in step.specs] == ["fixed", "fixed"]
    x, w = torch.ones(3), torch.full((3,), 2.0)
    assert step(x, w)[0].tolist() == [2.0, 2.0, 2.0]  # the eager warm-up
    assert step(x, w)[0].tolist() == [2.0, 2.0, 2.0] and len(double.made) == 1  # captured, replayed once
    x.fill_(3.0)
    assert step(x, w)[0].tolist() == [6.0, 6.0, 6.0] and step.replays == 1 and double.made[0].ops == ["aten::mul"]


@pytest.mark.parametrize("how", [dict(cuda_graphs=True), dict(cuda_graphs=False, compile_mode="reduce-overhead")])
def test_a_graph_without_cuda_tensors_runs_op_by_op(how):
    """With torch.cuda.CUDAGraph (no test double), a graph whose inputs are all host tensors has nothing to
    capture (as cudagraph trees skip a CPU graph): the lowered step runs op by op, no replay is made."""
    def build(g, ph, call, mode):
        x, w = ph("x", (3,), "cpu"), ph("w", (3,), "cpu")
        return (call(aten.mul.Tensor, (x, w), lambda: torch.empty(3)),)

    gm = fx.GraphModule(torch.nn.Module(), _graph(build))
    low = CudaLowering()
    step = low.lower(gm, [torch.ones(3), torch.ones(3)], _ctx("g4", **how))
    assert not isinstance(step, GraphReplay) and low.replays == {}
    for _ in range(3):
        assert step(torch.ones(3), torch.full((3,), 2.0))[0].tolist() == [2.0, 2.0, 2.0]


def test_input_specs_sort_dynamo_inputs():
    g = fx.Graph()
    names = ["tokens", "weight", "cache", "n", "pool"]
    nodes = [g.placeholder(n) for n in names]
    g.output(nodes[0])
    gm = fx.GraphModule(torch.nn.Module(), g)
    src = SimpleNamespace
    nodes[0].meta["grapharg"] = src(source="L['input_ids']", example=None)
    nodes[1].meta["grapharg"] = src(source="L['self']._modules['lin']._parameters['weight']", example=None)
    nodes[2].meta["grapharg"] = src(source="L['self']._modules['attn']._buffers['kv_cache']", example=None)
    nodes[3].meta["grapharg"] = src(source="L['n']", example=None)
    dev = [torch.ones(2, device="meta") for _ in range(3)]
    specs = input_specs(gm, [*dev, 7, torch.ones(2, device="meta")])
    assert [(s.name, s.kind) for s in specs] == [("tokens", "copy"), ("weight", "fixed"), ("cache", "fixed"),
                                                 ("n", "value"), ("pool", "fixed")]
    # in a graph with CUDA tensors a host tensor is a full cache (capture_problems allows no other): fixed;
    # on host tensors only (the cuda mode on a CPU) the call's arguments are copied all the same
    with F.new_mode():
        cuda_w = torch.ones(2, device="cuda")
    assert input_specs(gm, [torch.ones(2), cuda_w, torch.ones(2), 7, torch.ones(2)])[0].kind == "fixed"
    assert input_specs(gm, [torch.ones(2)] * 3 + [7, torch.ones(2)])[0].kind == "copy"
    with pytest.raises(ValueError, match="the graph has 5 inputs, example_inputs 4"):
        input_specs(gm, [torch.ones(2)] * 4)


def test_cuda_graphs_option_needs_the_cuda_mode():
    with pytest.raises(ValueError, match="option cuda_graphs applies to exe_mode='cuda' only, got exe_mode='eager'"):
        OffloadOptions(cuda_graphs=True)

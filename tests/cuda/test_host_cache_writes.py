"""passes/host_cache_writes.py: the decode graph's own cache writes made to land in host-resident caches.

No GPU here. The graphs are built by hand in the pre-AOT (Dynamo, torch IR) form the CUDA lowering
sees, with *fake* example values: FakeTensorMode creates fake CUDA tensors on a CPU-only torch (it needs
no device), so the placeholders say exactly what a CUDA run's would: the full caches ``cpu`` (pinned host
memory is a cpu tensor), everything the step computes ``cuda:0``. Checked: the exact rewritten structure
for every write form of the recipe model (``index_put_`` on a cache view; the ``cache_write: inplace``
ops) and of HF ``StaticCache.update`` (``index_copy_``; its ``setitem`` fallback), the new nodes' fake
values, that fake propagation of the graph (which checks devices as a CUDA run would) fails before the
pass and passes after it, that the rewritten graph still runs and writes the rows (real CPU tensors),
and that the pass changes nothing where the devices agree: every CPU graph, the real ``tiny`` model
compiled by the ``cuda`` lowering on CPU, writes into device buffers.
"""
from __future__ import annotations

import operator

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from offload_passes.passes._fx import example, strip_views
from offload_passes.passes.host_cache_writes import HostCacheWritesReport, host_cache_writes

aten = torch.ops.aten
CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
R, C, RD, N = 32, 8, 4, 3  # cache rows, latent width, rope width, rows written this step


@pytest.fixture
def mode():
    return FakeTensorMode()


def _ph(g: fx.Graph, name: str, val: torch.Tensor) -> fx.Node:
    n = g.placeholder(name)
    n.meta["example_value"] = val
    return n


def _structure(gm: fx.GraphModule) -> list:
    """(op, target, args) of every node, nodes by name: what the assertions compare exactly."""
    def arg(a):
        return fx.node.map_arg(a, lambda n: n.name)

    out = []
    for n in gm.graph.nodes:
        tgt = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        out.append((n.op, str(tgt), arg(n.args), dict(arg(n.kwargs))))
    return out


def _recipe_graph(mode, dev=CUDA, inputs=None):
    """``models/glm`` write_kv_cache (index_put_ form): kv_cache / k_rope_cache on the host, the rest on dev."""
    with mode:
        vals = inputs or dict(kv=torch.zeros(R, 1, C), rope=torch.zeros(R, 1, RD),
                              slots=torch.zeros(N, dtype=torch.long, device=dev),
                              c=torch.zeros(N, C, device=dev), k_pe=torch.zeros(N, RD, device=dev))
    g = fx.Graph()
    kv, rope, slots, c, k_pe = (_ph(g, k, vals[k]) for k in ("kv", "rope", "slots", "c", "k_pe"))
    v = g.call_method("view", (kv, -1, C))
    g.call_method("index_put_", (v, (slots,), c))
    v1 = g.call_method("view", (rope, -1, RD))
    g.call_method("index_put_", (v1, (slots,), k_pe))
    out = g.call_method("sum", (c,))
    g.output((out,))
    return fx.GraphModule(torch.nn.Module(), g), vals


def _fake_run(gm, vals, mode):
    with mode:
        return fx.Interpreter(gm).run(*vals.values())


def test_recipe_index_put_writes_get_host_operands(mode):
    gm, vals = _recipe_graph(mode)
    rep = host_cache_writes(gm)
    assert rep == HostCacheWritesReport(rewritten=2, nodes=["index_put_", "index_put__1"],
                                        copies=["slots_host", "c_host", "k_pe_host"], skipped=[])
    dev = {"device": CPU}
    assert _structure(gm) == [
        ("placeholder", "kv", (), {}), ("placeholder", "rope", (), {}), ("placeholder", "slots", (), {}),
        ("placeholder", "c", (), {}), ("placeholder", "k_pe", (), {}),
        ("call_method", "view", ("kv", -1, C), {}),
        ("call_function", "_to_copy.default", ("slots",), dev),
        ("call_function", "_to_copy.default", ("c",), dev),
        ("call_method", "index_put_", ("view", ("slots_host",), "c_host"), {}),  # still in place, on the cache
        ("call_method", "view", ("rope", -1, RD), {}),
        ("call_function", "_to_copy.default", ("k_pe",), dev),  # slots' host copy is shared, not repeated
        ("call_method", "index_put_", ("view_1", ("slots_host",), "k_pe_host"), {}),
        ("call_method", "sum", ("c",), {}),  # the device computation keeps its device operand
        ("output", "output", (("sum_1",),), {}),
    ]
    got = {n.name: n.meta["val"] for n in gm.graph.nodes if n.name.endswith("_host")}
    assert {k: (v.device, v.dtype, tuple(v.shape)) for k, v in got.items()} == {
        "slots_host": (CPU, torch.long, (N,)), "c_host": (CPU, torch.float32, (N, C)),
        "k_pe_host": (CPU, torch.float32, (N, RD))}
    assert all(v.fake_mode is mode for v in got.values())


def test_fake_propagation_fails_before_and_passes_after(mode):
    """Fake tensors check devices as a CUDA run would: the unmodified writes are refused, the rewritten run."""
    gm, vals = _recipe_graph(mode)
    with pytest.raises(RuntimeError, match=r"Mismatching aten\.index_put_\.default device between self \(cpu\) "
                                           r"and values \(cuda:0\)"):
        _fake_run(gm, vals, mode)
    host_cache_writes(gm)
    out = _fake_run(gm, vals, mode)
    assert out[0].device == CUDA


def test_rewritten_graph_runs_and_writes_the_rows(mode):
    """Run with real CPU tensors (the decisions were made from the fake CUDA values): the copies are
    plain copies here and the rows land in the very cache tensors passed in."""
    gm, _ = _recipe_graph(mode)
    assert host_cache_writes(gm).rewritten == 2
    kv, rope = torch.zeros(R, 1, C), torch.zeros(R, 1, RD)
    slots = torch.tensor([5, 0, 31])
    c, k_pe = torch.randn(N, C), torch.randn(N, RD)
    ptr = kv.data_ptr()
    (s,) = gm(kv, rope, slots, c, k_pe)
    assert kv.data_ptr() == ptr
    assert torch.equal(kv[slots, 0], c) and torch.equal(rope[slots, 0], k_pe)
    assert kv.abs().sum() == c.abs().sum() and torch.equal(s, c.sum())


def _lower(gm, inputs):
    """The CPU ``eager`` lowering the cuda lowering delegates to (AOT, our reinplace); the final graph."""
    from offload_passes.lowering.cpu import _lower_eager
    from offload_passes.passes.reinplace import reinplace

    out = {}

    def on_graph(graph, stage):
        if stage == "reinplace":
            out["reinplace"], out["graph"] = reinplace(graph), graph

    return _lower_eager(gm, inputs, on_graph, {}), out


def test_aot_and_reinplace_keep_the_host_write_in_place(mode):
    """AOT functionalises the host write (``index_put`` + ``copy_`` back) and our reinplace puts it back in
    place on the cache input, with the host copies as operands; the device computation keeps reading the
    device value. AOT needs real example inputs and none can be CUDA here, so the accelerator's operands are
    ``meta`` tensors (a stand-in: traced, never run)."""
    gm, _ = _recipe_graph(mode)
    host_cache_writes(gm)
    kv, rope = torch.zeros(R, 1, C), torch.zeros(R, 1, RD)
    dev = [torch.zeros(N, dtype=torch.long, device="meta"), torch.zeros(N, C, device="meta"),
           torch.zeros(N, RD, device="meta")]
    _, out = _lower(gm, [kv, rope, *dev])
    assert out["reinplace"].reinplaced == {"aten.index_put_.default": 2} and out["reinplace"].kept_functional == []
    g = out["graph"]
    calls = [(str(n.target), fx.node.map_arg((n.args, n.kwargs), lambda a: a.name)) for n in g.nodes
             if n.op == "call_function" and str(n.target) != "aten.view.default"]
    assert calls == [
        ("aten._to_copy.default", (("arg2_1",), {"device": CPU})),
        ("aten._to_copy.default", (("arg3_1",), {"device": CPU})),
        ("aten.index_put_.default", (("view", ["_to_copy"], "_to_copy_1"), {})),
        ("aten._to_copy.default", (("arg4_1",), {"device": CPU})),
        ("aten.index_put_.default", (("view_3", ["_to_copy"], "_to_copy_2"), {})),
        ("aten.sum.default", (("arg3_1",), {})),  # not the host copy: no copy_ of the cache, no staging
    ]
    by = {n.name: n for n in g.nodes}
    assert [strip_views(by[v]).name for v in ("view", "view_3")] == ["arg0_1", "arg1_1"]  # the cache inputs


def test_lowered_on_cpu_tensors_writes_the_rows_in_place(mode):
    gm, _ = _recipe_graph(mode)
    host_cache_writes(gm)
    kv, rope = torch.zeros(R, 1, C), torch.zeros(R, 1, RD)
    slots, c, k_pe = torch.tensor([3, 30, 17]), torch.randn(N, C), torch.randn(N, RD)
    fn, out = _lower(gm, [kv.clone(), rope.clone(), slots, c, k_pe])
    assert out["reinplace"].reinplaced == {"aten.index_put_.default": 2}
    (s,) = fn(kv, rope, slots, c, k_pe)
    assert torch.equal(kv[slots, 0], c) and torch.equal(rope[slots, 0], k_pe) and torch.equal(s, c.sum())
    rest = torch.ones(R, dtype=torch.bool)
    rest[slots] = False
    assert not kv[rest].any() and not rope[rest].any()  # nothing else written


def test_a_host_copy_is_not_reused_after_its_source_changes(mode):
    """slots written in place between the two cache writes: the second write gets a fresh copy."""
    gm, _ = _recipe_graph(mode)
    slots = next(n for n in gm.graph.nodes if n.name == "slots")
    second = [n for n in gm.graph.nodes if n.target == "index_put_"][1]
    with gm.graph.inserting_before(second.args[0]):
        gm.graph.call_method("add_", (slots, 1))
    rep = host_cache_writes(gm)
    assert rep.copies == ["slots_host", "c_host", "slots_host_1", "k_pe_host"]
    by = {n.name: n for n in gm.graph.nodes}
    assert by["index_put__1"].args[1] == (by["slots_host_1"],) and by["slots_host_1"].args == (slots,)
    assert by["slots_host_1"].prev.name == "view_1" and by["add_"].next.name == "view_1"


def test_no_op_when_every_value_is_on_the_host(mode):
    gm, _ = _recipe_graph(mode, dev=CPU)
    before = _structure(gm)
    assert host_cache_writes(gm) == HostCacheWritesReport()
    assert _structure(gm) == before


def test_no_op_without_example_values():
    gm = fx.symbolic_trace(lambda kv, slots, c: kv.view(-1, C).index_put_((slots,), c))
    before = _structure(gm)
    assert host_cache_writes(gm) == HostCacheWritesReport()
    assert _structure(gm) == before


def test_writes_into_device_tensors_and_host_intermediates_are_left_alone(mode):
    """A device buffer filled from the host caches (what dsa_serve / dsa_install do, zero-copy) is not a
    host write; a host tensor the graph allocates itself is not a cache."""
    with mode:
        vals = dict(kv=torch.zeros(R, C), sel=torch.zeros(N, C, device=CUDA),
                    idx=torch.zeros(N, dtype=torch.long), c=torch.zeros(N, C, device=CUDA))
    g = fx.Graph()
    kv, sel, idx, c = (_ph(g, k, v) for k, v in vals.items())
    rows = g.call_function(aten.index_select.default, (kv, 0, idx))
    g.call_method("copy_", (sel, rows))
    tmp = g.call_method("clone", (kv,))
    g.call_method("index_put_", (tmp, (idx,), c))
    g.output((tmp,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    before = _structure(gm)
    assert host_cache_writes(gm) == HostCacheWritesReport()
    assert _structure(gm) == before


def test_hf_static_cache_index_copy_and_setitem(mode):
    """transformers StaticCache.update: keys.index_copy_(2, cache_position, k); values[:, :, pos] = v."""
    B, T = 2, 16
    with mode:
        vals = dict(keys=torch.zeros(B, 1, T, C), values=torch.zeros(B, 1, T, RD),
                    pos=torch.zeros(1, dtype=torch.long, device=CUDA), k=torch.zeros(B, 1, 1, C, device=CUDA),
                    v=torch.zeros(B, 1, 1, RD, device=CUDA))
    g = fx.Graph()
    keys, values, pos, k, v = (_ph(g, n, t) for n, t in vals.items())
    g.call_method("index_copy_", (keys, 2, pos, k))
    g.call_function(operator.setitem, (values, (slice(None), slice(None), pos), v))
    g.output((keys, values))
    gm = fx.GraphModule(torch.nn.Module(), g)
    rep = host_cache_writes(gm)
    assert rep == HostCacheWritesReport(2, ["index_copy_", "setitem"], ["pos_host", "k_host", "v_host"])
    dev = {"device": CPU}
    assert _structure(gm)[5:] == [
        ("call_function", "_to_copy.default", ("pos",), dev),
        ("call_function", "_to_copy.default", ("k",), dev),
        ("call_method", "index_copy_", ("keys", 2, "pos_host", "k_host"), {}),
        ("call_function", "_to_copy.default", ("v",), dev),
        ("call_function", "setitem", ("values", (slice(None), slice(None), "pos_host"), "v_host"), {}),
        ("output", "output", (("keys", "values"),), {}),
    ]
    assert _fake_run(gm, vals, mode)[0].device == CPU
    keys_r, values_r = torch.zeros(B, 1, T, C), torch.zeros(B, 1, T, RD)
    k_r, v_r = torch.randn(B, 1, 1, C), torch.randn(B, 1, 1, RD)
    gm(keys_r, values_r, torch.tensor([7]), k_r, v_r)
    assert torch.equal(keys_r[:, :, 7:8], k_r) and torch.equal(values_r[:, :, 7:8], v_r)
    assert keys_r.abs().sum() == k_r.abs().sum()


def test_recipe_inplace_cache_write_ops_and_get_attr_caches(mode):
    """``cache_write: inplace``: offload_ref::npu_mla_prolog_cache_write_ (two written caches) and
    npu_scatter_nd_update_, with the caches as get_attr (Dynamo without inlining built-in modules)."""
    BS = 8
    root = torch.nn.Module()
    root.register_buffer("kv_cache", torch.zeros(R // BS, BS, 1, C))
    root.register_buffer("kr_cache", torch.zeros(R // BS, BS, 1, RD))
    with mode:
        fk = {a: mode.from_tensor(getattr(root, a), static_shapes=True) for a in ("kv_cache", "kr_cache")}
        vals = dict(slots=torch.zeros(N, dtype=torch.long, device=CUDA), c=torch.zeros(N, C, device=CUDA),
                    k_pe=torch.zeros(N, RD, device=CUDA), nd=torch.zeros(N, 2, dtype=torch.long, device=CUDA))
    g = fx.Graph()
    slots, c, k_pe, nd = (_ph(g, n, t) for n, t in vals.items())
    kv, kr = g.get_attr("kv_cache"), g.get_attr("kr_cache")
    kv.meta["example_value"], kr.meta["example_value"] = fk["kv_cache"], fk["kr_cache"]
    g.call_function(torch.ops.offload_ref.npu_mla_prolog_cache_write_.default, (kv, kr, slots, c, k_pe))
    up = g.call_method("unsqueeze", (k_pe, 1))
    g.call_function(torch.ops.offload_ref.npu_scatter_nd_update_.default, (kr, nd, up))
    g.output((c,))
    gm = fx.GraphModule(root, g)
    rep = host_cache_writes(gm)
    # the prolog write is left alone: its CUDA kernel stores into the pinned cache (custom_ops/cuda/cache_write.py)
    assert rep.rewritten == 1 and rep.skipped == []
    assert rep.nodes == ["npu_scatter_nd_update__default"]
    dev = {"device": CPU}
    assert _structure(gm)[4:] == [
        ("get_attr", "kv_cache", (), {}), ("get_attr", "kr_cache", (), {}),
        ("call_function", "npu_mla_prolog_cache_write_.default", ("kv_cache", "kr_cache", "slots", "c", "k_pe"), {}),
        ("call_method", "unsqueeze", ("k_pe", 1), {}),
        ("call_function", "_to_copy.default", ("nd",), dev),
        ("call_function", "_to_copy.default", ("unsqueeze",), dev),
        ("call_function", "npu_scatter_nd_update_.default", ("kr_cache", "nd_host", "unsqueeze_host"), {}),
        ("output", "output", (("c",),), {}),
    ]
    slots_r = torch.tensor([0, 9, 31])
    c_r, k_r = torch.randn(N, C), torch.randn(N, RD)
    nd_r = torch.tensor([[1, 2], [3, 7], [0, 0]])
    gm(slots_r, c_r, k_r, nd_r)
    assert torch.equal(root.kv_cache.view(-1, C)[slots_r], c_r)
    assert torch.equal(root.kr_cache[nd_r[:, 0], nd_r[:, 1], 0], k_r)


def test_the_host_write_op_is_left_alone_whatever_its_caches_devices(mode):
    """offload_ref::npu_mla_prolog_cache_write_ has a CUDA kernel that stores into a pinned host cache or a
    device cache (custom_ops/cuda/cache_write.py): the pass never touches it, caches on two devices included."""
    with mode:
        vals = dict(kv=torch.zeros(R, 1, C), kr=torch.zeros(R, 1, RD, device=CUDA),
                    slots=torch.zeros(N, dtype=torch.long, device=CUDA), c=torch.zeros(N, C, device=CUDA),
                    k_pe=torch.zeros(N, RD, device=CUDA))
    g = fx.Graph()
    nodes = [_ph(g, n, t) for n, t in vals.items()]
    g.call_function(torch.ops.offload_ref.npu_mla_prolog_cache_write_.default, tuple(nodes))
    g.output(())
    gm = fx.GraphModule(torch.nn.Module(), g)
    before = _structure(gm)
    rep = host_cache_writes(gm)
    assert rep == HostCacheWritesReport()
    assert _structure(gm) == before


@pytest.fixture(scope="module")
def tiny():
    """The real ``tiny`` decode graph (every tensor on the CPU) compiled by the cuda lowering, with a copy
    of its rewritten pre-AOT graph as the lowering left it (what the pass saw)."""
    from offload_passes import models
    from offload_passes.backend import OffloadBackend
    from offload_passes.lowering.cuda import CUDA_MODE, CudaLowering
    from offload_passes.passes.manager import StepPass

    torch._dynamo.reset()
    built = models.build("tiny", enable_offload=True)
    be = OffloadBackend(exe_mode="eager", pool_size=64)  # test arrangement of test_cuda_lowering.py
    be.lowering = lo = CudaLowering(CUDA_MODE)
    seen = {}
    orig = lo.passes

    def keep(ctx):  # after the lowering's passes
        g = fx.Graph()
        g.output(g.graph_copy(ctx.gm.graph, {}))  # nodes and (shallow-copied) meta; the compile keeps gm
        seen[ctx.graph_id] = fx.GraphModule(ctx.gm, g)

    lo.passes = lambda ctx: [*orig(ctx), StepPass("keep", keep)]
    built.driver.run(steps=1, step_fn=torch.compile(built.model, backend=be))
    rep = be.reports[-1]
    assert rep["rewritten"], rep["refusals"]
    yield dict(lowering=lo, rep=rep, graphs=seen)
    torch._dynamo.reset()


def _writes(gm):
    return [(n.args[0].name, n.args[2].name) for n in gm.graph.nodes
            if n.op == "call_method" and n.target == "index_put_"]


def test_tiny_model_on_cpu_through_the_cuda_lowering_changes_nothing(tiny):
    """The pass runs on every graph the cuda lowering compiles (a report per graph) and rewrites nothing
    on CPU tensors: the model's cache writes keep their own operands."""
    lo, gid = tiny["lowering"], tiny["rep"]["graph_id"]
    assert list(lo.host_cache_writes) == [gid] == list(tiny["graphs"])
    assert lo.host_cache_writes[gid] == HostCacheWritesReport()
    gm = tiny["graphs"][gid]
    assert [n for n in gm.graph.nodes if n.target is aten._to_copy.default] == []
    writes = _writes(gm)
    assert len(writes) == 18  # 8 layers x (kv_cache, k_rope_cache) + the 2 indexer key caches
    # the model's own operands: a cache view, the rows it computed (c / k_pe / the indexer's cast keys)
    assert all(v.startswith("view") and r.startswith(("c_", "k_pe_", "to_")) for v, r in writes)


HOST_CACHES = ("_buffers_kv_cache_", "_buffers_k_rope_cache_")


def _as_cuda_run(gm: fx.GraphModule, mode) -> tuple[fx.GraphModule, list]:
    """A copy of ``gm`` whose example values say what a CUDA run's would after place_full_caches: the
    full latent / rope caches (and views of them) on the host, every other tensor on cuda:0. (Fake CUDA
    tensors cannot be *propagated* through the whole model on a CPU-only torch, so they are relabelled.)"""
    g = fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    hosts = []
    for n in g.nodes:
        root = strip_views(n)
        host = root.op == "placeholder" and root.name.endswith(HOST_CACHES)
        for key in ("example_value", "val"):  # Dynamo's nodes / the rewrite's nodes (set_fake_val)
            v = n.meta.get(key)
            if isinstance(v, torch.Tensor):
                with mode:
                    n.meta[key] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=CPU if host else CUDA)
        if host and n is root:
            hosts.append(n.name)
    return fx.GraphModule(gm, g), hosts


def test_tiny_rewritten_graph_under_the_cuda_placement(tiny, mode):
    """The real rewritten ``tiny`` graph with the CUDA placement's devices: exactly the 16 writes of the new
    token into the full caches get host operands (slots copied once for all layers); the indexer key-cache
    writes (device caches) and the offload ops that read the host caches and write device buffers
    (dsa_serve / dsa_install) are untouched."""
    gm, hosts = _as_cuda_run(tiny["graphs"][tiny["rep"]["graph_id"]], mode)
    assert len(hosts) == 16

    def named(skip=(), back=None):
        back = back or {}
        return [(n.name, n.op, str(n.target), fx.node.map_arg((n.args, n.kwargs), lambda a: back.get(a.name, a.name)))
                for n in gm.graph.nodes if n.name not in skip]

    host_writes = [(n.name, n.args[2].name) for n in gm.graph.nodes if n.op == "call_method"
                   and n.target == "index_put_" and strip_views(n.args[0]).name in hosts]
    assert len(host_writes) == 16
    before = named()
    rep = host_cache_writes(gm)
    assert rep.rewritten == 16 and rep.skipped == []
    assert rep.nodes == [w for w, _ in host_writes]
    by_name = {n.name: n for n in gm.graph.nodes}
    assert len(rep.copies) == 17 and rep.copies[0] == "slots_host"  # one copy of slots for all layers
    assert [by_name[c].args[0].name for c in rep.copies[1:]] == [v for _, v in host_writes]
    for (w, _), c in zip(host_writes, rep.copies[1:]):  # every operand of a host write is on the host now
        (idx,), val = by_name[w].args[1], by_name[w].args[2]
        assert idx is by_name["slots_host"] and val is by_name[c]
        assert example(val).device == CPU == example(idx).device
    # without the copies the graph is the one before, node for node: nothing else was touched
    assert named(skip=rep.copies, back={c: by_name[c].args[0].name for c in rep.copies}) == before

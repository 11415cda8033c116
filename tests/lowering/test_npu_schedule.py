"""The NPU schedule on the lowered graphs of ``tiny`` and ``glm-5.2-78l`` (cut to its first 10 layers:
groups {0}, {1}, {2..5}, {6..9} — a singleton owner, a one-layer group and two full groups; the full 78
layers run through ``benchmarks/bench_npu_schedule.py``, which sets ``OFFLOAD_PASSES_SCHEDULE_LAYERS=78``).

* ``ge_graph``: TorchAir's real pipeline up to the GE graph it would hand to CANN (the ``_torchair``
  TEST DOUBLE stops there): each install waits (control edge) on its own layer's serve, never on SFA;
  no TensorMove, no Assign, the KV-cache writes are in-place ``ScatterNdUpdate`` on the cache inputs.
* ``npugraph_ex``: npugraph_ex's real compile (all of ``optimize_graph_without_runtime``, not
  ``force_eager``) up to where ACL capture begins — the ``torch_npu`` TEST DOUBLE raises in
  ``torch_npu.npu.graph`` — and the final FX graph is inspected: events/streams, joins, records identity,
  no functional twin, no copy of a full cache, pool, selection buffer or metadata.
"""
from __future__ import annotations

import operator
import os

import pytest
import torch

from offload_passes import _compat, models
from offload_passes.backend import NpuOffloadBackend
from offload_passes.lowering.side_stream import SIDE_STREAM_LABEL
from offload_passes.passes.emit import LEDGER_SERVED

PS = {"tiny": 64, "glm-5.2-78l": 256}  # a multiple of the selection block size (16 / 128)
#: 10 layers in the suite; ``benchmarks/bench_npu_schedule.py`` sets 78 (the whole preset) through this env var
CUT = {"num_hidden_layers": int(os.environ.get("OFFLOAD_PASSES_SCHEDULE_LAYERS", "10"))}


def _build(preset):
    over = CUT if preset == "glm-5.2-78l" else {}
    return models.build(preset, enable_offload=True, shared_indexer_offload=True, **over)


# ------------------------------------------------------------------------------------------ GE


def _ge_graph(preset, tmp_path_factory):
    from google.protobuf import text_format
    from torchair._ge_concrete_graph.ge_ir_pb2 import GraphDef

    torch._dynamo.reset()
    dump = tmp_path_factory.mktemp("ge_sched")
    b = _build(preset)
    be = NpuOffloadBackend(exe_mode="ge_graph", pool_size=PS[preset], dump_dir=str(dump))
    step = torch.compile(b.model, backend=be)
    with pytest.raises(RuntimeError, match="GE graphs cannot be compiled without CANN"):
        b.driver.step(step)
    assert be.reports[-1]["rewritten"], be.reports[-1]["refusals"]
    gid = be.reports[-1]["graph_id"]
    (txt,) = (dump / gid).glob("dynamo_optimized_*.txt")
    return text_format.Parse(txt.read_text(), GraphDef()), be, b


@pytest.fixture(scope="module", params=["tiny", "glm-5.2-78l"])
def ge_sched(request, torchair, tmp_path_factory):
    return request.param, *_ge_graph(request.param, tmp_path_factory)


def _ops(proto, t):
    return [op for op in proto.op if op.type == t]


def _producer(t):
    return t.rsplit(":", 1)[0]


def test_ge_install_waits_on_its_serve_not_on_attention(ge_sched):
    preset, proto, be, b = ge_sched
    rep = be.reports[-1]
    groups = [g["layers"] for g in rep["groups"]]
    serves = {op.name: op for op in _ops(proto, "DsaServe")}
    sfas = {op.name for op in _ops(proto, "SparseFlashAttention")}
    installs = _ops(proto, "DsaInstall")
    n_layers = b.config.num_hidden_layers
    assert len(serves) == n_layers and len(sfas) == n_layers
    # md=0 per shared layer, plus the owner's md=1 (a singleton group has only that one)
    assert len(installs) == sum(len(g) for g in groups)
    waited = 0
    for inst in installs:
        assert inst.attr["_user_stream_label"].s.decode() == SIDE_STREAM_LABEL
        ctrl = {_producer(t) for t in inst.input if t.endswith(":-1")}
        assert not ctrl & sfas, f"{inst.name} waits on attention {ctrl & sfas}"
        own = _producer(inst.input[1])  # the serve that filled the selection buffer it installs
        assert own in serves and inst.input[1:3] == [f"{own}:0", f"{own}:1"]
        if ctrl:  # the first install of each scope: record after serve -> wait in the scope
            assert ctrl == {own} or inst.attr["metadata_update"].i == 1 and len(ctrl) == 1 and ctrl <= set(serves)
            waited += 1
        else:  # the owner's md=1 install after the last md=0 install of its group, same stream
            assert inst.attr["metadata_update"].i == 1
    assert waited == sum(max(len(g) - 1, 1) for g in groups)  # one wait per side-stream scope
    for op in list(serves.values()) + _ops(proto, "SparseFlashAttention") + _ops(proto, "DsaPlan"):
        assert "_user_stream_label" not in op.attr


def test_ge_joins_and_no_copies(ge_sched):
    preset, proto, be, _ = ge_sched
    (out,) = _ops(proto, "NetOutput")
    outs = set(out.input)
    installs = _ops(proto, "DsaInstall")
    for inst in installs:  # the graph's outputs depend on every install: GE finishes the side stream first
        assert {f"{inst.name}:0", f"{inst.name}:1"} <= outs, inst.name
        if inst.attr["metadata_update"].i == 1:
            assert {f"{inst.name}:{i}" for i in (2, 3, 4)} <= outs
    assert not _ops(proto, "TensorMove") and not _ops(proto, "Assign")
    data = {op.name for op in _ops(proto, "Data")}
    by_name = {op.name: op for op in proto.op}
    # KV-cache writes: ScatterNdUpdate straight on the cache input (GE runs it in place), nothing else
    full = set()
    for serve in _ops(proto, "DsaServe"):
        for i in (1, 2):
            src = by_name[_producer(serve.input[i])]
            while src.type == "Reshape":
                src = by_name[_producer(src.input[0])]
            assert src.type == "ScatterNdUpdate", (serve.name, src.type)
            assert _producer(src.input[0]) in data
            full.add(src.input[0])
    n_layers = len(_ops(proto, "DsaServe"))
    assert len(full) == 2 * n_layers
    writers = [op for op in proto.op if op.type != "NetOutput" and set(op.input) & full]
    assert {op.type for op in writers} == {"ScatterNdUpdate"} and len(writers) == 2 * n_layers
    assert not [op for op in _ops(proto, "ScatterElements") if _producer(op.input[0]) in data]
    assert be.reports[-1]["bookkeeping"] is False and be.reports[-1]["bookkeeping_nodes_removed"] > 0


# ----------------------------------------------------------------------------------- npugraph_ex


def _ngx_graph(preset, npugraph_ex_pkg, stub):
    """Compile without force_eager; npugraph_ex's passes run, capture raises in the test double."""
    from npu_capture import captured_npugraph_ex_graph  # tests/npu_capture.py

    with captured_npugraph_ex_graph() as captured:
        with stub.installed():
            torch._dynamo.reset()
            b = _build(preset)
            cfg = npugraph_ex_pkg.CompilerConfig()
            _compat.set_npugraph_ex_option(cfg, "pattern_fusion_pass", False)  # traces torch.ops.npu kernels, absent on CPU
            be = NpuOffloadBackend(exe_mode="npugraph_ex", pool_size=PS[preset], compiler_config=cfg)
            step = torch.compile(b.model, backend=be)
            with pytest.raises(RuntimeError, match=stub.CAPTURE_UNAVAILABLE):
                b.driver.step(step)
            assert "graph" in stub.CALLS  # it got as far as the capture context
    assert be.reports[-1]["rewritten"], be.reports[-1]["refusals"]
    return captured["gm"].graph, be, b


@pytest.fixture(scope="module", params=["tiny", "glm-5.2-78l"])
def ngx_sched(request, npugraph_ex_pkg, torch_npu_double, reinplace_registered):
    return request.param, *_ngx_graph(request.param, npugraph_ex_pkg, torch_npu_double)


def _t(n):
    return str(n.target)


def _is(n, suffix):
    return _t(n).endswith(suffix)


def test_ngx_every_install_reads_the_plans_own_records(ngx_sched):
    _, graph, _, _ = ngx_sched
    installs = [n for n in graph.nodes if _is(n, "dsa_install.default")]
    assert installs
    for inst in installs:
        rec = inst.args[0]
        assert rec.target is operator.getitem and rec.args[1] == 1, inst.name
        assert _is(rec.args[0], "dsa_plan.default"), (inst.name, rec.args[0].name)


def test_ngx_event_and_stream_topology(ngx_sched):
    preset, graph, be, b = ngx_sched
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    installs = [n for n in nodes if _is(n, "dsa_install.default")]
    serves = [n for n in nodes if _is(n, "dsa_serve.default")]
    sfas = [n for n in nodes if "sparse_flash_attention" in _t(n)]
    n_layers = b.config.num_hidden_layers
    assert len(serves) == n_layers == len(sfas)
    serve_of = {}
    for s in serves:
        serve_of[s.args[5]] = s
    groups = [g["layers"] for g in be.reports[-1]["groups"]]
    scopes = [n for n in nodes if _is(n, "scope_enter.default") and n.args[1] == [SIDE_STREAM_LABEL]]
    assert len(scopes) == sum(max(len(g) - 1, 1) for g in groups)  # one per layer that installs
    covered = []
    for enter in scopes:
        exit_ = next(n for n in nodes[pos[enter]:] if _is(n, "scope_exit.default"))
        inside = nodes[pos[enter] + 1: pos[exit_]]
        mine = [n for n in inside if n in installs]
        covered += mine
        waits = [n.args[0] for n in inside if _is(n, "tagged_event_wait.default")
                 and str(n.args[0]).startswith("dsa_offload_")]
        (ready,) = waits
        done = ready.replace("_ready", "_done")
        layer_serves = [serve_of[i.args[1]] for i in mine]
        last_serve = max(layer_serves, key=pos.get)
        # main stream: serve -> record(ready) with nothing else of the main stream in between but the
        # stream registration of what the side stream reads
        (rec_ready,) = [n for n in nodes if _is(n, "tagged_event_record.default") and n.args[0] == ready]
        between = nodes[pos[last_serve] + 1: pos[rec_ready]]
        assert all(_is(n, "record_tagged_stream.default") for n in between), [n.name for n in between]
        assert {n.args[0] for n in between} == {mine[0].args[0]}  # the plan's records, on our stream
        assert all(n.args[1] == SIDE_STREAM_LABEL for n in between)
        # the layer's attention comes after the ready record: installs overlap SFA and MoE
        layer_sfa = next(n for n in nodes[pos[last_serve]:] if "sparse_flash_attention" in _t(n))
        assert pos[rec_ready] < pos[enter] < pos[exit_] < pos[layer_sfa]
        # side stream: wait(ready) before every install, record(done) after the last one
        w = next(n for n in inside if _is(n, "tagged_event_wait.default") and n.args[0] == ready)
        (rec_done,) = [n for n in inside if _is(n, "tagged_event_record.default") and n.args[0] == done]
        assert pos[w] < min(pos[i] for i in mine) and pos[rec_done] > max(pos[i] for i in mine)
        # join: the main stream waits on done after the scope; nothing on the main stream between the
        # scope and the join touches the pools / metadata these installs write
        (join,) = [n for n in nodes if _is(n, "tagged_event_wait.default") and n.args[0] == done]
        assert pos[join] > pos[exit_]
        written = {i.args[k] for i in mine for k in range(4, 9)}
        for n in nodes[pos[exit_] + 1: pos[join]]:
            if n.op == "call_function" and not _t(n).startswith("npugraph_ex."):
                assert not (set(n.all_input_nodes) & written) or n in installs, (n.name, done)
    assert sorted(covered, key=pos.get) == installs
    # per group: the shared layers' md=0 installs, then the owner's md=1 install, in side-stream order
    mus = [n.kwargs.get("metadata_update", n.args[12] if len(n.args) > 12 else 1) for n in installs]
    assert mus == [m for g in groups for m in [0] * (len(g) - 1) + [1]]


def test_ngx_no_functional_twin_and_no_copies(ngx_sched):
    _, graph, _, _ = ngx_sched
    nodes = list(graph.nodes)
    assert not [n.name for n in nodes if _t(n).startswith("custom.") and "_functional" in _t(n)]
    guarded = set()
    for n in nodes:
        if _is(n, "dsa_serve.default"):
            guarded |= {n.args[i] for i in (1, 2, 3, 4, 5, 6)}
        elif _is(n, "dsa_install.default"):
            guarded |= {n.args[i] for i in range(1, 9)}
        elif _is(n, "dsa_plan.default"):
            guarded |= {n.args[i] for i in (2, 3, 4)}

    def base(x):
        while isinstance(x, torch.fx.Node) and x.op == "call_function" and (
                _is(x, "view.default") or _is(x, "_unsafe_view.default") or _is(x, "reshape.default")):
            x = x.args[0]
        return x

    roots = {base(g) for g in guarded}
    assert all(r.op == "placeholder" for r in roots), [r.name for r in roots if r.op != "placeholder"]
    copies = [n.name for n in nodes if _is(n, "copy_.default") and base(n.args[0]) in roots]
    clones = [n.name for n in nodes if (_is(n, "clone.default") or _is(n, "index_put.default"))
              and base(n.args[0]) in roots]
    assert not copies and not clones
    # the model's KV-cache writes run in place on the full caches
    writes = [n for n in nodes if _is(n, "index_put_.default")]
    assert writes and all(base(n.args[0]).op == "placeholder" for n in writes)


# ------------------------------------------------------------------------------------ bookkeeping


@pytest.mark.parametrize("keep", [False, True])
def test_bookkeeping_is_off_by_default_in_npu_modes(keep, monkeypatch, reinplace_registered):
    """The rewritten graph (lowering replaced by running it as is: no TorchAir needed) keeps the
    per-step statistics and the ledger update only with ``npu_bookkeeping=True``."""
    from offload_passes.lowering import npu as npu_modes
    from offload_passes.options import OffloadOptions

    assert OffloadOptions().npu_bookkeeping is False
    graphs = []

    def as_is(gm, example_inputs, *a, **k):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(npu_modes, "lower_npugraph_ex", as_is)
    torch._dynamo.reset()
    b = _build("tiny")
    b.driver.prefill()
    status = [m.sel_status for m in b.model.modules() if hasattr(m, "sel_status")]
    before = [s.clone() for s in status]
    be = NpuOffloadBackend(exe_mode="npugraph_ex", pool_size=PS["tiny"], side_stream=False, npu_bookkeeping=keep)
    step = torch.compile(b.model, backend=be)
    b.driver.step(step)
    b.driver.step(step)
    rep = be.reports[-1]
    assert rep["rewritten"] and rep["bookkeeping"] is keep
    (gm,) = graphs
    stats_copies = [n for n in gm.graph.nodes if "copy_" in str(n.target) and n.args[0].op == "get_attr"
                    and "stats" in str(n.args[0].target)]
    totals = be.state.totals()
    if keep:
        assert len(stats_copies) == 2  # one per group
        assert [c["total"]["steps"] for c in be.state.counters()] == [2, 2]
        assert totals["hits"] + totals["misses"] + totals["window"] > 0
        assert any(not torch.equal(s, s0) for s, s0 in zip(status, before))  # the ledger was written
    else:
        assert not stats_copies and rep["bookkeeping_nodes_removed"] > 0
        assert totals == {"hits": 0, "misses": 0, "window": 0, "host_rows_read": 0}
        # no ledger update: each ledger holds the served mark (passes/emit.py::LEDGER_SERVED), every id -1 and
        # the count -2, so the unmodified gather reuses nothing and an engine's -1 still reads as a new request
        assert status and all(bool((s[..., :-1] == -1).all()) and bool((s[..., -1] == LEDGER_SERVED).all())
                              for s in status)
        assert any(not torch.equal(s, s0) for s, s0 in zip(status, before))
        assert int((be.state.groups[0].pool_ids >= 0).sum()) > 0  # the offload itself ran


# ------------------------------------------------------------------------------------ join placement


def test_join_goes_before_the_first_main_stream_hazard():
    """``_join_points`` on a hand-built graph: a later main-stream read of a pool the install writes, or a
    write of the selection buffer it reads, gets the join; reads of what it only reads do not."""
    from torch import fx

    from offload_passes.lowering.side_stream import join_points as _join_points

    g = fx.Graph()
    ph = {n: g.placeholder(n) for n in ("rec", "sel_kv", "sel_rope", "table", "pkv", "prope", "ids", "i2s",
                                        "lru", "other")}
    inst = g.call_function(torch.ops.custom.dsa_install.default, tuple(ph[n] for n in (
        "rec", "sel_kv", "sel_rope", "table", "pkv", "prope", "ids", "i2s", "lru")))
    ex = g.call_function(torch.ops.aten.alias.default, (ph["other"],))  # stands for the scope exit
    read_sel = g.call_function(torch.ops.aten.sum.default, (ph["sel_kv"],))  # SFA-like read: no hazard
    read_pool = g.call_function(torch.ops.aten.sum.default,
                                (g.call_function(torch.ops.aten.view.default, (ph["pkv"], [-1])),))
    out = g.output((read_sel, read_pool))
    points = _join_points(g, [([inst], ex, "a")])
    assert points["a"].target is torch.ops.aten.view.default  # the view of the pool, before the read
    g2 = fx.Graph()
    ph2 = {n: g2.placeholder(n) for n in ph}
    inst2 = g2.call_function(torch.ops.custom.dsa_install.default, tuple(ph2[n] for n in (
        "rec", "sel_kv", "sel_rope", "table", "pkv", "prope", "ids", "i2s", "lru")))
    ex2 = g2.call_function(torch.ops.aten.alias.default, (ph2["other"],))
    g2.call_function(torch.ops.aten.sum.default, (ph2["sel_kv"],))
    w = g2.call_function(torch.ops.aten.fill_.Scalar, (ph2["sel_kv"], 0))  # overwrites what install reads
    out2 = g2.output(None)
    assert _join_points(g2, [([inst2], ex2, "b")])["b"] is w
    g3 = fx.Graph()
    ph3 = {n: g3.placeholder(n) for n in ph}
    inst3 = g3.call_function(torch.ops.custom.dsa_install.default, tuple(ph3[n] for n in (
        "rec", "sel_kv", "sel_rope", "table", "pkv", "prope", "ids", "i2s", "lru")))
    ex3 = g3.call_function(torch.ops.aten.alias.default, (ph3["other"],))
    g3.call_function(torch.ops.aten.sum.default, (ph3["rec"],))
    out3 = g3.output(None)
    assert _join_points(g3, [([inst3], ex3, "c")])["c"] is out3
    assert out is not None and out2 is not None

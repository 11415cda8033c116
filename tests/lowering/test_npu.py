"""The NPU modes end to end on the rewritten ``tiny`` model (8 layers, IndexShare groups {0..3}, {4..7}).

* ``ge_graph``: TorchAir's real pipeline builds the GE graph (captured before it would go to CANN);
* ``npugraph_ex``: npugraph_ex's real pipeline with ``force_eager=True`` (runs op by op on CPU under the
  torch_npu double; streams and events are inert there, program order is what executes).
"""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from offload_passes import _compat, models
from offload_passes.backend import NpuOffloadBackend
from offload_passes.lowering.side_stream import SIDE_STREAM_LABEL

GROUPS = [[0, 1, 2, 3], [4, 5, 6, 7]]
PS = 64
STEPS = 3


_PREFILLED = []


def _tiny():
    """A prefilled ``tiny`` (built and prefilled once per process, then deep-copied: prefill is slow)."""
    if not _PREFILLED:
        b = models.build("tiny", enable_offload=True, shared_indexer_offload=True)
        b.driver.prefill()
        _PREFILLED.append(b)
    return copy.deepcopy(_PREFILLED[0])


def test_npu_modes_and_converters_import_without_torchair():
    code = (
        "import sys, offload_passes.lowering.npu, offload_passes.converters as c\n"
        "assert not {'torchair', 'npugraph_ex', 'torch_npu'} & set(sys.modules), sorted(sys.modules)\n"
        "if c.torchair_available():\n"
        "    print('TORCHAIR INSTALLED'); sys.exit(0)\n"
        "try:\n"
        "    c.register_ge()\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if "TORCHAIR INSTALLED" in out.stdout:
        pytest.skip("torchair is installed in this environment (a torch_npu machine)")
    assert "offload_passes.converters needs 'torchair'" in out.stdout
    assert "python -m offload_passes.tools.torchair_env" in out.stdout


def test_recipe_compiler_configs(torchair, npugraph_ex_pkg):
    from offload_passes.lowering.npu import recipe_compiler_config

    def on(opt):  # TorchAir stores booleans as "1"/"0"
        return str(opt.value) in ("True", "1")

    ge = recipe_compiler_config("ge_graph")
    assert on(ge.experimental_config.frozen_parameter) and on(ge.experimental_config.tiling_schedule_optimize)
    assert ge.experimental_config.topology_sorting_strategy.value == "StableRDFS"
    assert on(_compat.get_npugraph_ex_option(recipe_compiler_config("npugraph_ex"), "frozen_parameter"))
    assert not on(type(ge)().experimental_config.frozen_parameter)
    with pytest.raises(ValueError, match="mode must be one of"):
        recipe_compiler_config("eager")


def test_npu_backend_rejects_cpu_modes():
    with pytest.raises(ValueError, match=r"exe_mode must be one of \('ge_graph', 'npugraph_ex'\).*'eager'"):
        NpuOffloadBackend(exe_mode="eager")


# -------------------------------------------------------------------------------------------- GE


@pytest.fixture(scope="module")
def ge_tiny(torchair, tmp_path_factory):
    """Compile tiny in ge_graph mode with a dump folder; the first call dumps the GE graph (TorchAir's
    own ``debug.graph_dump``) and then stops where CANN would compile it (the ``_torchair`` double)."""
    from google.protobuf import text_format
    from torchair._ge_concrete_graph.ge_ir_pb2 import GraphDef

    torch._dynamo.reset()
    dump = tmp_path_factory.mktemp("ge_dump")
    b = _tiny()
    be = NpuOffloadBackend(exe_mode="ge_graph", pool_size=PS, dump_dir=str(dump))
    step = torch.compile(b.model, backend=be)
    with pytest.raises(RuntimeError, match="GE graphs cannot be compiled without CANN"):
        b.driver.step(step)
    gid = be.reports[-1]["graph_id"]
    (txt,) = (dump / gid).glob("dynamo_optimized_*.txt")
    proto = text_format.Parse(txt.read_text(), GraphDef())
    files = sorted(p.name for p in (dump / gid).iterdir())
    assert "01_rewrite.py" in files and (dump / "report.json").is_file(), (files, be.reports)
    return proto, be


def _ops(proto, t):
    return [op for op in proto.op if op.type == t]


def _source_data(proto, tensor):
    """The Data node a tensor comes from through reshapes (None if it is computed)."""
    by_name = {op.name: op for op in proto.op}
    op = by_name.get(tensor.split(":")[0])
    while op is not None and op.type in ("Reshape", "Identity", "Unsqueeze", "Squeeze"):
        op = by_name.get(op.input[0].split(":")[0])
    return op if op is not None and op.type == "Data" else None


def test_ge_graph_has_one_plan_per_group_and_serve_install_per_layer(ge_tiny):
    proto, be = ge_tiny
    rep = be.reports[-1]
    assert rep["rewritten"] and rep["mode"] == "ge_graph" and rep["side_stream"]
    assert [g["layers"] for g in rep["groups"]] == GROUPS
    assert len(_ops(proto, "DsaPlan")) == len(GROUPS)
    assert len(_ops(proto, "DsaServe")) == 8 and len(_ops(proto, "DsaInstall")) == 8
    assert len(_ops(proto, "SparseFlashAttention")) == 8 and len(_ops(proto, "LightningIndexer")) == 2
    assert not _ops(proto, "GatherSelectionKvCache")


def test_ge_graph_never_copies_pools_selection_buffers_or_full_caches(ge_tiny):
    proto, _ = ge_tiny
    by_name = {op.name: op for op in proto.op}
    state = set()  # pools, selection buffers, metadata: graph inputs read/written in place by DSA ops
    for serve in _ops(proto, "DsaServe"):
        for i in range(3, 7):
            d = _source_data(proto, serve.input[i])
            assert d is not None, f"{serve.name} input {i} is not a graph input"
            state.add(f"{d.name}:0")
        for i in (1, 2):  # full caches: the graph input, or the model's own write of this step into it
            src = by_name[serve.input[i].split(":")[0]]
            while src.type == "Reshape":
                src = by_name[src.input[0].split(":")[0]]
            if src.type != "Data":  # the model's KV write of this step, in place on the cache input
                assert src.type == "ScatterNdUpdate" and by_name[src.input[0].split(":")[0]].type == "Data"
    for inst in _ops(proto, "DsaInstall"):
        state |= {inst.input[i] for i in (4, 5)}
    assert len(state) == 8 * 4
    assert not _ops(proto, "TensorMove")  # no copy anywhere: not of state, not of a full cache
    dsa = {"DsaPlan", "DsaServe", "DsaInstall", "NetOutput"}
    readers = {op.type for op in proto.op for t in op.input if t in state}
    assert readers <= dsa, readers  # only the DSA ops touch the state buffers


def test_ge_installs_run_on_the_side_stream_after_their_serve(ge_tiny):
    proto, _ = ge_tiny
    order = {op.name: i for i, op in enumerate(proto.op)}
    serves, sfas, installs = _ops(proto, "DsaServe"), _ops(proto, "SparseFlashAttention"), _ops(proto, "DsaInstall")
    plans = _ops(proto, "DsaPlan")
    for op in serves + sfas + plans:
        assert "_user_stream_label" not in op.attr
    for inst in installs:
        assert inst.attr["_user_stream_label"].s.decode() == SIDE_STREAM_LABEL
    # installs in graph order: per group the shared layers' (metadata_update=0), then the owner's (=1)
    per_group = [installs[:4], installs[4:]]
    for g, (layers, group_installs) in enumerate(zip(GROUPS, per_group)):
        plan = plans[g]
        mus = [i.attr["metadata_update"].i for i in group_installs]
        assert mus == [0, 0, 0, 1]
        install_layers = layers[1:] + [layers[0]]
        for k, (inst, layer) in enumerate(zip(group_installs, install_layers)):
            serve = serves[layer]
            assert inst.input[0] == f"{plan.name}:1"  # the plan's own record buffer, never a copy
            assert list(inst.input[1:3]) == [f"{serve.name}:0", f"{serve.name}:1"]
            assert order[serve.name] < order[inst.name]
            assert f"{sfas[layer].name}:-1" not in inst.input  # overlaps its layer's attention
            if k < 3:  # waits (control edge) for its own layer's serve
                assert f"{serve.name}:-1" in inst.input
            meta = list(inst.input[6:9])
            if k == 0:
                assert meta == list(plan.input[2:5])
            else:  # chained through the previous install's (ref) metadata outputs, same side stream
                prev = group_installs[k - 1]
                assert meta == [f"{prev.name}:{i}" for i in (2, 3, 4)]


def test_ge_graph_compiles_after_npugraph_ex_patched_aten_first(torchair, npugraph_ex_pkg, monkeypatch):
    """A process that compiled in npugraph_ex mode, then compiles in ge_graph mode. Both packages add the
    same python kernels to ``aten.to.other`` / ``type_as`` / ``matmul_backward`` in their once-per-process
    ``_utils.add_npu_patch``; npugraph_ex's checks first, TorchAir's does not and raises on the second
    registration (``_compat.torchair_ready_after_npugraph_ex`` clears the way). The three kernel tables and
    both run-once flags are restored afterwards."""
    import npugraph_ex._utils as ex_utils
    import torchair._utils as ta_utils
    from torch._subclasses import fake_tensor

    ops = (torch.ops.aten.to.other, torch.ops.aten.type_as.default, torch.ops.aten.matmul_backward.default)
    for op in ops:  # work on copies of the kernel tables, so the process is left as it was
        monkeypatch.setattr(op, "py_kernels", {k: v for k, v in op.py_kernels.items()
                                               if k not in (torch._C.DispatchKey.AutogradPrivateUse1,
                                                            torch._C.DispatchKey.CompositeImplicitAutograd)})
        op._dispatch_cache.clear()
    monkeypatch.setattr(fake_tensor, "get_fast_op_impls", fake_tensor.get_fast_op_impls)  # TorchAir wraps it
    # the state npugraph_ex's first compile leaves: its patch ran, TorchAir's has not
    ex_utils.register_matmul_backward_decomp()
    monkeypatch.setattr(ex_utils.add_npu_patch, "has_run", True)
    monkeypatch.setattr(ta_utils.add_npu_patch, "has_run", False)
    with pytest.raises(RuntimeError, match="override a python impl"):  # TorchAir's own patch, unaided
        ta_utils.register_matmul_backward_decomp()

    torch._dynamo.reset()
    b = _tiny()
    be = NpuOffloadBackend(exe_mode="ge_graph", pool_size=PS)
    with pytest.raises(RuntimeError, match="GE graphs cannot be compiled without CANN"):
        b.driver.step(torch.compile(b.model, backend=be))
    assert be.reports[-1]["rewritten"], be.reports[-1]["refusals"]
    assert ta_utils.add_npu_patch.has_run
    assert torch._C.DispatchKey.AutogradPrivateUse1 in torch.ops.aten.to.other.py_kernels
    for op in ops:
        op._dispatch_cache.clear()
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------ npugraph_ex


@pytest.fixture(scope="module")
def ngx_tiny(npugraph_ex_pkg, torch_npu_double):
    from npu_capture import captured_npugraph_ex_graph  # tests/npu_capture.py

    stub = torch_npu_double
    with captured_npugraph_ex_graph() as captured:
        with stub.installed():
            torch._dynamo.reset()
            base, b = _tiny(), _tiny()
            cfg = npugraph_ex_pkg.CompilerConfig()
            _compat.set_npugraph_ex_option(cfg, "force_eager", True)
            _compat.set_npugraph_ex_option(cfg, "pattern_fusion_pass", False)  # traces torch.ops.npu kernels, absent on CPU
            be = NpuOffloadBackend(exe_mode="npugraph_ex", pool_size=PS, compiler_config=cfg)
            step = torch.compile(b.model, backend=be)
            diffs = []
            for _ in range(STEPS):
                got = b.driver.step(step).logits
                want = base.driver.step().logits
                diffs.append((got.float() - want.float()).abs().max().item())
    return captured["graph"], be, diffs


def _name(n):
    # npugraph_ex's stream/event ops live in torch.ops.air in torch-npu 2.8 (torch.ops.npugraph_ex in
    # 2.13; _compat.npugraph_ex_ops): spell them one way
    s = str(n.target)
    return "npugraph_ex." + s[4:] if s.startswith("air.") else s


def test_npugraph_ex_outputs_match_eager(ngx_tiny):
    _, be, diffs = ngx_tiny
    assert be.reports[-1]["rewritten"] and be.reports[-1]["refusals"] == []
    assert max(diffs) == 0, diffs  # force_eager on CPU runs our kernels: exact
    assert be.state is not None and int((be.state.groups[0].pool_ids >= 0).sum()) > 0


def test_npugraph_ex_reinplaces_every_functional_twin_on_graph_inputs(ngx_tiny):
    graph, _, _ = ngx_tiny
    nodes = list(graph.nodes)
    targets = [_name(n) for n in nodes]
    assert not [t for t in targets if t.startswith("custom.") and "_functional" in t]
    assert targets.count("custom.dsa_serve.default") == 8 and targets.count("custom.dsa_install.default") == 8
    guarded = set()
    for n in nodes:
        if _name(n) == "custom.dsa_serve.default":
            guarded |= {n.args[i] for i in (3, 4, 5, 6)}
        elif _name(n) == "custom.dsa_install.default":
            guarded |= {n.args[i] for i in (4, 5, 6, 7, 8)}
    assert all(g.op == "placeholder" for g in guarded)
    assert len(guarded) == 8 * 4 + 2 * 3  # pools + selections per layer, metadata per group
    copies = [n for n in nodes if _name(n) == "aten.copy_.default" and n.args[0] in guarded]
    assert not copies


def test_npugraph_ex_side_stream_scope_and_events_in_spec_order(ngx_tiny):
    """Installs start once their layer's serve is done and run beside its SFA (the reference's schedule)."""
    graph, _, _ = ngx_tiny
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    installs = [n for n in nodes if _name(n) == "custom.dsa_install.default"]
    sfas = [n for n in nodes if "sparse_flash_attention" in _name(n)]
    serves = [n for n in nodes if _name(n) == "custom.dsa_serve.default"]
    output = nodes[-1]
    scope = None
    for inst in installs:
        # the enclosing scope: nearest scope_enter before, nearest scope_exit after
        enter = max((n for n in nodes[: pos[inst]] if _name(n) == "npugraph_ex.scope_enter.default"), key=pos.get)
        exit_ = min((n for n in nodes[pos[inst]:] if _name(n) == "npugraph_ex.scope_exit.default"), key=pos.get)
        assert enter.args[1] == [SIDE_STREAM_LABEL]
        assert not [n for n in nodes[pos[enter] + 1: pos[inst]] if _name(n) == "npugraph_ex.scope_exit.default"]
        inside = nodes[pos[enter] + 1: pos[exit_]]
        waits = [n.args[0] for n in inside if _name(n) == "npugraph_ex.tagged_event_wait.default"
                 and n.args[0].startswith("dsa_offload_")]
        (ready,) = waits
        layer = int(ready.split("_l")[-1].split("_")[0])
        done = ready.replace("_ready", "_done")
        # main stream: serve -> record(ready) -> SFA; side: wait(ready) -> installs -> record(done)
        rec_ready = [n for n in nodes if _name(n) == "npugraph_ex.tagged_event_record.default"
                     and n.args[0] == ready]
        assert len(rec_ready) == 1 and pos[serves[layer]] < pos[rec_ready[0]] < pos[enter] < pos[sfas[layer]]
        rec_done = [n for n in inside if _name(n) == "npugraph_ex.tagged_event_record.default"
                    and n.args[0] == done]
        assert len(rec_done) == 1 and pos[rec_done[0]] > max(pos[i] for i in inside if i in installs)
        # the plan's records (a main-stream allocation) are registered with the side stream first
        regs = [n for n in nodes[: pos[rec_ready[0]]] if _name(n) == "npugraph_ex.record_tagged_stream.default"
                and n.args[1] == SIDE_STREAM_LABEL]
        assert inst.args[0] in {r.args[0] for r in regs}
        # join: the main stream waits for `done` before the graph returns
        joins = [n for n in nodes if _name(n) == "npugraph_ex.tagged_event_wait.default" and n.args[0] == done]
        assert len(joins) == 1 and pos[joins[0]] > pos[exit_] and pos[joins[0]] < pos[output]
        scope = scope or enter
    # the shared layers' installs precede the owner's metadata install of the group, on one stream
    mus = [n.kwargs.get("metadata_update", 1) for n in installs]
    assert mus == [0, 0, 0, 1, 0, 0, 0, 1]


def test_npu_exe_modes_route_to_the_npu_backend_without_importing_torchair():
    code = (
        "import sys\n"
        "from offload_passes import make_offload_backend\n"
        "from offload_passes.backend import backend_for_options, OffloadBackend, NpuOffloadBackend\n"
        "for mode in ('ge_graph', 'npugraph_ex'):\n"
        "    b = make_offload_backend(exe_mode=mode, pool_size=64)\n"
        "    assert type(b) is NpuOffloadBackend and b.options.exe_mode == mode, b\n"
        "    assert type(backend_for_options({'exe_mode': mode})) is NpuOffloadBackend\n"
        "assert type(make_offload_backend(exe_mode='inductor')) is OffloadBackend\n"
        "assert not {'torchair', 'npugraph_ex', 'torch_npu'} & set(sys.modules)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr

"""GE ref-output patch and a full TorchAir ``torch.compile`` (captured GE graph, never executed).

``torch.compile(..., backend=torchair.get_npu_backend())`` runs TorchAir's real pipeline (AOT
functionalization with our Functionalize kernels, converters, GE graph passes). ``GeConcreteGraph``
is only stopped at its first call — where it would hand the graph to CANN — and the optimized GE
graph is inspected there.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

pytestmark = pytest.mark.usefixtures("torchair")

B, S, K, BS, F, PS, D, DR, IR = 2, 1, 64, 16, 128, 32, 32, 8, 256


class _Captured(Exception):
    pass


@contextlib.contextmanager
def capture_ge_graph():
    """Patch ``GeConcreteGraph.__call__`` to record the optimized GE graph and stop."""
    from torchair._ge_concrete_graph.fx2ge_converter import GeConcreteGraph

    graphs = []
    original = GeConcreteGraph.__call__

    def stop(self, *args, **kwargs):
        graphs.append(self._graph._proto)
        raise _Captured()

    GeConcreteGraph.__call__ = stop
    try:
        yield graphs
    finally:
        GeConcreteGraph.__call__ = original


def compile_and_capture(fn, args):
    import torchair

    torch._dynamo.reset()
    backend = torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())
    with capture_ge_graph() as graphs:
        with pytest.raises(_Captured):
            torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    assert len(graphs) == 1
    return graphs[0]


def group_inputs():
    """State of one IndexShare group of two layers (owner A, shared B)."""
    h = torch.float16
    topk = torch.arange(K, dtype=torch.int32).repeat(B, S, 1, 1)
    L = torch.full((B,), 100, dtype=torch.int32)
    meta = (torch.full((B, PS), -1, dtype=torch.int32), torch.full((B, IR), -1, dtype=torch.int32),
            torch.zeros((B, PS // 16), dtype=torch.int32))
    nb = B * S * K // BS
    sbt = torch.arange(nb, dtype=torch.int32).reshape(B * S, K // BS)
    layers = []
    for _ in range(2):
        layers += [torch.randn(B, F, D).to(h), torch.randn(B, F, DR).to(h),          # full kv / rope
                   torch.zeros(B, PS, D, dtype=h), torch.zeros(B, PS, DR, dtype=h),   # pool kv / rope
                   torch.zeros(nb, BS, D, dtype=h), torch.zeros(nb, BS, DR, dtype=h)]  # selection kv / rope
    return (topk, L, *meta, sbt, *layers)


def group_step(topk, L, pool_ids, id_to_slot, lru, sbt, *layers):
    """plan once; serve A, serve B; install B (metadata_update=0) then install A (=1), as docs/ops.md §5."""
    c = torch.ops.custom
    a, b = layers[:6], layers[6:]
    plan, rec, act = c.dsa_plan(topk, L, pool_ids, id_to_slot, lru, raw_seq=S)
    out = act.sum()
    for fkv, fr, pkv, pr, skv, sr in (a, b):
        c.dsa_serve(plan, fkv, fr, pkv, pr, skv, sr, raw_seq=S, topk=K, selection_block_size=BS)
        out = out + skv.float().sum() + sr.float().sum()
    for (fkv, fr, pkv, pr, skv, sr), mu in ((b, 0), (a, 1)):
        c.dsa_install(rec, skv, sr, sbt, pkv, pr, pool_ids, id_to_slot, lru, raw_seq=S, topk=K,
                      selection_block_size=BS, metadata_update=mu)
    return out


def _ops(proto, t):
    return [op for op in proto.op if op.type == t]


def _data_of(proto):
    return {f"{op.name}:0" for op in proto.op if op.type == "Data"}


def test_ref_patch_is_installed_idempotent_and_name_checked():
    from torchair._ge_concrete_graph import graph_pass

    from offload_passes.converters import ge_ref_patch

    fn = ge_ref_patch.patch_ref_idx()
    assert ge_ref_patch.patch_ref_idx() is fn is graph_pass._get_output_to_input_ref_idx
    assert ge_ref_patch.is_patched()

    from torchair.ge._ge_graph import GeGraph

    with GeGraph() as g:
        serve = g._proto.op.add()
        serve.type = "DsaServe"
        for n in ("plan", "full_kv_cache", "full_k_rope", "pool_kv_cache", "pool_k_rope",
                  "selection_kv_cache", "selection_k_rope"):
            serve.input_desc.add().name = n
        for n in ("selection_kv_cache", "selection_k_rope"):
            serve.output_desc.add().name = n
        assert graph_pass._get_output_to_input_ref_idx(serve) == {0: 5, 1: 6}
        serve.output_desc[1].name = "something_else"  # a node that does not name its refs: left alone
        assert graph_pass._get_output_to_input_ref_idx(serve) == {0: 5}
        other = g._proto.op.add()
        other.type = "ScatterPaKvCache"  # TorchAir's own entries are untouched
        assert graph_pass._get_output_to_input_ref_idx(other) == {0: 1, 1: 4}


def test_ref_patch_fails_loudly_without_the_torchair_function(monkeypatch):
    from torchair._ge_concrete_graph import graph_pass

    from offload_passes.converters import ge_ref_patch

    monkeypatch.delattr(graph_pass, "_get_output_to_input_ref_idx")
    with pytest.raises(RuntimeError, match="_get_output_to_input_ref_idx not found"):
        ge_ref_patch.patch_ref_idx()


def test_compiled_group_step_has_no_copies_of_pools_metadata_or_selection_buffers():
    proto = compile_and_capture(group_step, group_inputs())
    (plan,) = _ops(proto, "DsaPlan")
    serve_a, serve_b = _ops(proto, "DsaServe")
    install_b, install_a = _ops(proto, "DsaInstall")
    assert install_b.attr["metadata_update"].i == 0 and install_a.attr["metadata_update"].i == 1
    assert not _ops(proto, "TensorMove") and not _ops(proto, "Identity")
    data = _data_of(proto)
    # serves write the selection graph inputs in place; installs the pools
    for serve in (serve_a, serve_b):
        assert serve.input[5] in data and serve.input[6] in data
        assert serve.input[0] == f"{plan.name}:0"
    for install, serve in ((install_b, serve_b), (install_a, serve_a)):
        assert install.input[4] in data and install.input[5] in data
        # reads this step's served selection (serve's ref outputs) and plan's own records
        assert list(install.input[1:3]) == [f"{serve.name}:0", f"{serve.name}:1"]
        assert install.input[0] == f"{plan.name}:1"
        assert install.input[4] == serve.input[3]  # the pool it refills is the one its layer served from
    # metadata: plan's inputs feed install B in place, whose (unchanged) refs feed install A in place
    assert list(install_b.input[6:9]) == list(plan.input[2:5])
    assert list(install_a.input[6:9]) == [f"{install_b.name}:{i}" for i in (2, 3, 4)]


@pytest.mark.parametrize("unpatch,expected", [("both", 14), ("copy_pass", 10)])
def test_each_patch_is_needed(monkeypatch, unpatch, expected):
    """Plain TorchAir copies every mutated buffer (14 TensorMoves); with the ref table but without the
    copy pass it still copies the install inputs that plan/serve also read (10)."""
    from torchair._ge_concrete_graph import fx2ge_converter, graph_pass

    if unpatch == "both":
        monkeypatch.setattr(graph_pass, "_get_output_to_input_ref_idx",
                            graph_pass._get_output_to_input_ref_idx.__wrapped__)
    monkeypatch.setattr(fx2ge_converter, "optimize_reference_op_redundant_copy",
                        fx2ge_converter.optimize_reference_op_redundant_copy.__wrapped__)
    proto = compile_and_capture(group_step, group_inputs())
    moves = _ops(proto, "TensorMove")
    assert len(moves) == expected
    if unpatch == "copy_pass":
        installs = {op.name for op in _ops(proto, "DsaInstall")}
        users = {op.name for op in proto.op if any(i.split(":")[0] in {m.name for m in moves} for i in op.input)}
        assert users == installs


def _serve_graph(reader_before: bool, return_old: bool = False):
    """Data -> TensorMove -> DsaServe(selection) with one more reader of the selection Data."""
    from torchair._ge_concrete_graph import ge_apis as ge
    from torchair.ge._ge_graph import DataType, GeGraph

    names = ("plan", "full_kv_cache", "full_k_rope", "pool_kv_cache", "pool_k_rope",
             "selection_kv_cache", "selection_k_rope")
    with GeGraph() as g:
        ins = [ge.Data(index=i, dtype=DataType.DT_FLOAT16, shape=[4], placement="NPU", node_name=n)
               for i, n in enumerate(names)]
        if reader_before:  # the reader's value is an input of serve: it certainly runs first
            ins[0] = ge.Add(ins[0], ge.Identity(ins[5]))
        torch.ops.custom.dsa_serve_functional.default._ge_converter(*ins, meta_outputs=None)
        if not reader_before:
            ge.Identity(ins[5])  # unordered w.r.t. serve: may read after the in-place write
        net = g._proto.op.add()
        net.type, net.name = "NetOutput", "NetOutput"
        if return_old:
            net.input.append("selection_kv_cache:0")
    return g._proto


@pytest.mark.parametrize("reader_before,return_old,kept", [(True, False, 0), (False, False, 1), (True, True, 1)])
def test_copy_pass_keeps_copies_it_cannot_prove_safe(reader_before, return_old, kept):
    from offload_passes.converters.ge_ref_patch import drop_dsa_copies

    proto = _serve_graph(reader_before, return_old)
    assert len(_ops(proto, "TensorMove")) == 2
    removed = drop_dsa_copies(proto)
    assert removed == 2 - kept
    (serve,) = _ops(proto, "DsaServe")
    # selection_k_rope has no other reader: always in place
    assert serve.input[6] == "selection_k_rope:0"
    assert len(_ops(proto, "TensorMove")) == kept
    assert (serve.input[5] == "selection_kv_cache:0") == (kept == 0)

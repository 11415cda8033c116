"""The whole recipe flow with the CUDA placement, on fake CUDA tensors (no GPU; ``_fake_cuda.py``).

The ``tiny`` model with its full latent / rope caches on the host (what ``place_full_caches`` pins) and
everything else on ``cuda:0``: the eager prefill, two decode steps compiled by the offload backend in
``exe_mode="cuda"``, a re-fill of one row (``Driver.reset_row``) and one more step. Fake tensors check
devices at every op as a CUDA run's dispatch does, so a host write of device rows (``index_put_`` into
the host cache), a pool allocated beside the host caches or a CPU index tensor meeting a CUDA one fails
here as it would on a GPU. Values are not computed (the CPU suite checks them).

TEST ARRANGEMENT: the MoE layers are made dense (``first_k_dense_replace=8``): the sparse MoE routes tokens
with a data-dependent ``nonzero`` whose sizes fake tensors cannot know; it has no cache and no device
choice of its own.
"""
from __future__ import annotations

import contextlib

import torch

import _fake_cuda as F
from offload_passes import cuda, make_offload_backend, models

aten = torch.ops.aten
CUDA0, CPU = torch.device("cuda", 0), torch.device("cpu")
B_ROWS = 2


def run_flow(preset: str = "tiny", table=None, record=None, reset: bool = True, backend_kw=None, compile_kw=None,
             steps: int = 2, **overrides):
    """The flow (a generator: the session fixture ``flow`` of ``conftest.py`` yields its one value).
    ``table``: a block table ``[B, cache_len]`` set before the prefill (a paged layout; default the model's
    identity table). ``record(model, driver)``: a context manager entered around the re-fill of row 1.
    ``reset=False``: no ``torch._dynamo.reset()`` before and after (it would drop the session flow's graphs);
    Dynamo compiles the new model beside them. ``backend_kw``: more backend options; ``compile_kw``: torch.compile's
    own arguments (``mode=``); ``steps``: decode steps before the re-fill."""
    F.install_fake_cuda_guard()
    if reset:
        torch._dynamo.reset()
    built = models.build(preset, enable_offload=True, decode_steps=steps + 1, first_k_dense_replace=8, **overrides)
    m = built.model
    assert m.batch_size == B_ROWS
    if table is not None:
        m.block_table.copy_(table)
    mode = F.new_mode()
    host = {(id(o), a) for o, a, _, where in cuda._targets(m) if where == cuda.HOST}
    twins = F.fake_cuda_model(m, mode, host)
    be = make_offload_backend(exe_mode="cuda", pool_size=64, **(backend_kw or {}))

    def backend(gm, example_inputs, **kw):  # Dynamo compiles outside the caller's mode: the state is made in it
        with mode:
            return be(gm, example_inputs, **kw)

    out = {}
    with mode, F.values_from_twins(twins), F.sdpa_without_device():
        out["prefill"] = built.driver.prefill()
        step = torch.compile(m, backend=backend, **(compile_kw or {}))
        out["steps"] = [built.driver.step(step) for _ in range(steps)]
        with record(m, built.driver) if record is not None else contextlib.nullcontext():
            out["refill"] = built.driver.reset_row(1, prompt_len=5)
        out["steps"].append(built.driver.step(step))
    # where the offload state lives, read now: the state lives as long as the compiled graphs, which any
    # later torch._dynamo.reset() of another test in this process drops
    out["state_devices"] = {k: t.device for k, t in be.state.tensors().items()}
    yield dict(model=m, be=be, **out)
    if reset:
        torch._dynamo.reset()


def test_caches_stay_where_the_placement_put_them(flow):
    m = flow["model"]
    for name, b in m.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        want = CPU if leaf in cuda.RECIPE_FULL and "indexer" not in name else CUDA0
        assert b.device == want, name


def test_prefill_refill_and_steps_run_on_the_device(flow):
    V = flow["model"].config.vocab_size
    assert flow["prefill"].device == CUDA0 and tuple(flow["prefill"].shape) == (B_ROWS, V)
    assert flow["refill"].device == CUDA0 and tuple(flow["refill"].shape) == (1, V)
    for s in flow["steps"]:
        assert s.logits.device == CUDA0 and tuple(s.logits.shape) == (B_ROWS, 1, V)


def test_pools_and_metadata_are_on_the_device(flow):
    be = flow["be"]
    rep = be.reports[-1]
    assert rep["rewritten"] and rep["refusals"] == []
    devices = flow["state_devices"]
    assert any(k.startswith("pool_kv") for k in devices)
    assert {k: d for k, d in devices.items() if d != CUDA0} == {}


def test_compiled_step_writes_the_host_caches_on_the_device_no_host_copy(flow):
    """The decode graph's cache writes are the cache-write op (its CUDA kernel stores through the pinned
    address) on the host caches with device rows; no device-to-host copy; serve reads the host caches."""
    g = flow["be"].final_graph()
    nodes = [n for n in g.nodes if n.op == "call_function"]

    def val(n):
        return n.meta.get("val")

    writes = [n for n in nodes if n.target is torch.ops.offload_ref.npu_mla_prolog_cache_write_.default]
    assert len(writes) == 8  # one per layer
    for w in writes:
        kvc, krc, idx, kv, kr = (val(a) for a in w.args)
        assert (kvc.device, krc.device) == (CPU, CPU)
        assert (idx.device, kv.device, kr.device) == (CUDA0, CUDA0, CUDA0)
    to_host = [n for n in nodes if n.target in (aten._to_copy.default, aten.copy_.default)
               and isinstance(val(n), torch.Tensor) and val(n).device == CPU]
    assert to_host == []
    serves = [n for n in nodes if n.target is torch.ops.custom.dsa_serve.default]
    assert len(serves) == 8
    assert all(val(s.args[1]).device == CPU and val(s.args[3]).device == CUDA0 for s in serves)
    assert not any(n.target is aten.index_put_.default and val(n.args[0]).device == CPU for n in nodes)
    assert flow["be"].lowering.host_cache_writes[flow["be"].reports[-1]["graph_id"]].rewritten == 0


def test_compiled_step_has_no_host_read_of_a_device_value(flow):
    """What a CUDA graph capture of the step would need from the graph itself: no op that reads a device
    value on the host (a synchronisation): no data-dependent shape, no ``.item()``, no device-side assert
    (the guards are ``offload_cuda::guard``), no copy to the host. The model's own decode ops stay the
    ``offload_ref::`` ops (their device kernels: tests/cuda/test_decode_ops_on_device.py)."""
    from offload_passes.lowering.cuda import GUARD_OP

    g = flow["be"].final_graph()
    nodes = [n for n in g.nodes if n.op == "call_function"]
    syncing = {aten._local_scalar_dense.default, aten.nonzero.default, aten._assert_async.msg, aten.equal.default,
               aten.item.default, aten.masked_select.default}
    assert [n.name for n in nodes if n.target in syncing] == []
    assert len([n for n in nodes if n.target is GUARD_OP]) > 0
    refs = sorted({str(n.target) for n in nodes if str(n.target).startswith("offload_ref.")
                   and "cache_write" not in str(n.target)})
    # dsa_install_sc: the cuda mode's default policy, second chance (offload_passes/modes.py)
    assert refs == ["offload_ref.dsa_install_sc.default", "offload_ref.npu_lightning_indexer.default",
                    "offload_ref.npu_sparse_flash_attention.default"]

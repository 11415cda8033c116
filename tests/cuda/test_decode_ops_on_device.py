"""No op of the recipe model's compiled decode step runs on the host, on fake CUDA (``_fake_cuda.py``).

The ``tiny`` model (bf16 indexer, ``index_put`` cache writes) and ``tiny-w8a8`` with the recipe's in-place
cache writes (int8 indexer, ``npu_scatter_nd_update_`` into the indexer caches, the MLA-prolog KV write),
full caches on the host and everything else on ``cuda:0``, compiled with ``exe_mode="cuda"``
(``test_fake_cuda_flow.run_flow``: prefill, two steps, a re-fill, one more step). On the lowered graph
of the step:

* every op of ours (``custom::``, ``offload_ref::``) has a device kernel (its ``OpSpec.cuda_kernel``,
  registered as the op's CUDA kernel) and at least one CUDA operand, so dispatch picks that kernel: none
  runs a CPU kernel; the remaining ops are ATen ops on device tensors and the ``cuda`` mode's stream and
  guard ops;
* no value of the step lives on the host except the full caches, and those are read or written only by
  kernels through their pinned address: ``dsa_serve`` (the misses) and the cache-write op (the new rows);
* ``capture_problems`` (``offload_passes/lowering/cuda_graphs.py``) finds nothing: the step is one capture.

What the kernels compute is checked on CPU tensors: tests/cuda/test_decode_kernels.py.
"""
from __future__ import annotations

import pytest
import torch

from offload_passes.custom_ops import OP_SPECS
from offload_passes.lowering.cuda import STREAM_NAMESPACE
from offload_passes.lowering.cuda_graphs import capture_problems
from offload_passes.passes import _fx

CPU = torch.device("cpu")
SERVE = torch.ops.custom.dsa_serve.default
CACHE_WRITE = torch.ops.offload_ref.npu_mla_prolog_cache_write_.default
SPECS = {f"{s.namespace}::{n}": s for s in OP_SPECS for n in s.op_names}


@pytest.fixture(scope="module")
def w8a8_flow():
    from test_fake_cuda_flow import run_flow

    yield from run_flow("tiny-w8a8", reset=False, cache_write="inplace")  # the session's tiny flow stays alive


@pytest.fixture(params=["tiny", "tiny-w8a8-inplace"])
def step_graph(request, triton_interpreted):
    from offload_passes.custom_ops import cuda

    cuda.register_all(force=True)  # the CUDA kernels a GPU process registers at import
    f = request.getfixturevalue("flow" if request.param == "tiny" else "w8a8_flow")
    return request.param, f["be"].final_graph()


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _tensors(x) -> list:
    if isinstance(x, torch.fx.Node):
        v = _val(x)
        return [v] if isinstance(v, torch.Tensor) else [t for t in (v or ()) if isinstance(t, torch.Tensor)] \
            if isinstance(v, (list, tuple)) else []
    if isinstance(x, (list, tuple)):
        return [t for a in x for t in _tensors(a)]
    if isinstance(x, dict):
        return [t for a in x.values() for t in _tensors(a)]
    return []


def _ours_on_device(g) -> dict:
    """Asserts every op of ours in ``g`` has a device kernel and a CUDA operand (dispatch picks that kernel; the
    rest are ATen ops and the cuda mode's stream and guard ops); returns how many of each op of ours."""
    ours: dict = {}
    for n in g.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        qual = n.target._schema.name
        ns = qual.split("::")[0]
        if ns == STREAM_NAMESPACE:  # scope / record / join / guard: device-generic (lowering/cuda.py)
            continue
        if ns not in ("custom", "offload_ref"):
            assert ns == "aten", (n.name, qual)
            continue
        spec = SPECS[qual]
        assert spec.cuda_kernel is not None, qual
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CUDA"), qual
        operands = _tensors(n.args) + _tensors(n.kwargs)
        assert any(t.device.type == "cuda" for t in operands), (n.name, qual)  # dispatch picks CUDA
        ours[qual.split("::")[1]] = ours.get(qual.split("::")[1], 0) + 1
    return ours


def _host_caches_only_under_kernels(g, n_host: int) -> set:
    """Asserts ``g`` has ``n_host`` host inputs, used only as operands of ops (through views), and that no op
    computes a host value; returns the ``(op, argument position)`` pairs that use them."""
    uses = set()
    host = [p for p in g.nodes if p.op == "placeholder" and isinstance(_val(p), torch.Tensor) and _val(p).device == CPU]
    assert len(host) == n_host
    for p in host:
        for u in _fx.view_users(p):  # through views of the cache
            at = {i for i, a in enumerate(u.args) if _fx.strip_views(a) is p}
            assert at and not any(_fx.strip_views(a) is p for a in u.kwargs.values()), u
            uses |= {(u.target, i) for i in at}
    on_host = [n.name for n in g.nodes if n.op == "call_function" and not _fx.is_view(n)
               and any(t.device == CPU for t in _tensors(n))]
    assert on_host == []  # no op computes a host value
    return uses


def test_every_op_of_ours_dispatches_to_its_device_kernel(step_graph):
    name, g = step_graph
    ours = _ours_on_device(g)
    indexer = "npu_quant_lightning_indexer" if name == "tiny-w8a8-inplace" else "npu_lightning_indexer"
    assert ours[indexer] == 2 and ours["npu_sparse_flash_attention"] == 8
    assert ours["dsa_plan"] == 2 and ours["dsa_serve"] == 8 and ours["npu_mla_prolog_cache_write_"] == 8
    assert ours.get("npu_scatter_nd_update_", 0) == (4 if name == "tiny-w8a8-inplace" else 0)  # key + scale
    assert "npu_gather_selection_kv_cache" not in ours  # the unmodified gather: replaced by serve


def test_host_caches_are_touched_only_by_kernels(step_graph):
    _, g = step_graph
    # the latent and rope full caches of 8 layers, nothing else on the host
    uses = _host_caches_only_under_kernels(g, 16)
    assert uses == {(SERVE, 1), (SERVE, 2), (CACHE_WRITE, 0), (CACHE_WRITE, 1)}


def test_the_step_has_no_capture_problem(step_graph):
    _, g = step_graph
    assert capture_problems(g) == []


# ------------------------------------------------------------------------------------ the HF path

STATIC_WRITE = torch.ops.offload_ref.static_cache_write_.default


@pytest.fixture(scope="module")
def hf_graph(triton_interpreted):
    """``hf-tiny`` (2 DSA layers, one IndexShare group) with ``HostStaticCache`` on fake CUDA, its decode step
    compiled in ``exe_mode="cuda"`` (``test_fake_cuda_hf._flow``)."""
    from offload_passes.custom_ops import cuda
    from test_fake_cuda_hf import _flow

    cuda.register_all(force=True)
    with torch._dynamo.config.patch(recompile_limit=64):
        return _flow("bfloat16")["graph"]


def test_hf_every_op_of_ours_dispatches_to_its_device_kernel(hf_graph):
    """The HF step's ops of ours (plan, serve, the default policy's installs, the host-KV write) have device
    kernels and CUDA operands; the model's own attention and indexer are ATen ops."""
    assert _ours_on_device(hf_graph) == {"dsa_plan": 1, "dsa_serve": 2, "dsa_install_sc": 2, "static_cache_write_": 2}


def test_hf_host_caches_are_touched_only_by_kernels(hf_graph):
    # the latent (keys) and rope (values) host KV of 2 layers, nothing else on the host
    uses = _host_caches_only_under_kernels(hf_graph, 4)
    assert uses == {(SERVE, 1), (SERVE, 2), (STATIC_WRITE, 0), (STATIC_WRITE, 1)}
    assert capture_problems(hf_graph) == []

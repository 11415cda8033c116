"""A Hugging Face DSA model with host KV (``offload_passes.hf_cache.HostStaticCache``) on fake CUDA tensors (no
GPU; ``_fake_cuda.py``): the model on ``cuda:0``, the cache's latent / rope KV on the host, the eager prefill,
then decode steps compiled in ``exe_mode="cuda"`` — what ``generate()`` runs per step (the model's forward on
the cache with the step's positions). Fake tensors check devices at every op as a CUDA run's dispatch does, so a
host write of device rows, a pool beside the host caches or a whole-cache copy left in the step fails here as
it would on a GPU. Values are not computed: that the same generate() calls give the unmodified model's tokens is
``tests/hf/test_host_kv_cache.py`` (CPU); generate() itself reads token values on the host (its padding check,
its stopping criteria), which fake tensors do not have.

TEST ARRANGEMENT: dense MLP layers (``mlp_layer_types``): transformers' MoE asks the device for its compute
capability (``torch.cuda.get_device_capability``), which needs a driver; the MoE has no cache and no device
choice of its own.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import _fake_cuda as F
from offload_passes import make_offload_backend
from offload_passes.lowering.cuda_graphs import capture_problems

aten = torch.ops.aten
CUDA0, CPU = torch.device("cuda", 0), torch.device("cpu")
B, P, T, STEPS = 2, 72, 80, 3


def _flow(dtype: str, compile_kw=None, backend_kw=None, steps: int = STEPS):
    from offload_passes.hf_cache import HostStaticCache
    from offload_passes.models import hf

    F.install_fake_cuda_guard()
    m = hf.build("hf-tiny", dtype=dtype, num_hidden_layers=2, index_topk_pattern="FS",
                 mlp_layer_types=["dense", "dense"]).model
    mode = F.new_mode()
    twins = F.fake_cuda_model(m, mode, set())  # an HF model's caches are not module buffers: all on cuda:0
    be = make_offload_backend(exe_mode="cuda", pool_size=1024, **(backend_kw or {}))

    moved, watch = [], []

    def backend(gm, example_inputs, **kw):  # Dynamo compiles outside the caller's mode: the state is made in it
        with mode:
            fn = be(gm, example_inputs, **kw)

        def run(*args):  # the compiled step; on the last step every host-to-device copy it makes is recorded
            with _HostToDevice(moved) if watch else contextlib.nullcontext():
                return fn(*args)

        return run

    dt = getattr(torch, dtype)
    with mode, F.values_from_twins(twins), F.sdpa_without_device(), torch.no_grad():
        cache = HostStaticCache(m.config, max_cache_len=T, batch_size=B, device="cuda", dtype=dt)
        ids = torch.randint(2, 256, (B, T), device="cuda")
        prefill = m(ids[:, :P], past_key_values=cache, use_cache=True).logits
        step = torch.compile(m, backend=backend, fullgraph=True, **(compile_kw or {}))
        logits = []
        for s in range(steps):
            pos = torch.full((B, 1), P + s, dtype=torch.long, device="cuda")
            if s == steps - 1:
                watch.append(True)
            logits.append(step(ids[:, P + s:P + s + 1], past_key_values=cache, use_cache=True, position_ids=pos).logits)
    return dict(model=m, cache=cache, be=be, prefill=prefill, logits=logits, graph=be.final_graph(), moved=moved)


class _HostToDevice(TorchDispatchMode):
    """Records the shape of every host-to-device copy (what a step moves over the host link besides serve)."""

    def __init__(self, out: list):
        super().__init__()
        self.out = out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        res = func(*args, **kwargs)
        if func in (aten._to_copy.default, aten.copy_.default) and isinstance(res, torch.Tensor):
            src = args[0] if func is aten._to_copy.default else args[1]
            if isinstance(src, torch.Tensor) and src.device == CPU and res.device == CUDA0:
                self.out.append(tuple(src.shape))
        return res



@pytest.fixture(autouse=True, scope="module")
def _dynamo_beside_the_session_flow():
    """No torch._dynamo.reset() here: it would drop the graphs of the session's fake-CUDA flow
    (``conftest.flow``) other modules read; the HF model compiles beside them."""
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


@pytest.fixture(scope="module")
def bf16():
    return _flow("bfloat16")


def _val(n):
    return n.meta.get("val")


def _calls(g):
    return [n for n in g.nodes if n.op == "call_function"]


def test_the_cache_keeps_kv_on_the_host_and_the_rest_on_the_device(bf16):
    for layer in bf16["cache"].layers:
        assert (layer.keys.device, layer.values.device) == (CPU, CPU)
        assert layer.cumulative_length.device == CUDA0
        assert layer.indexer_keys is None or layer.indexer_keys.device == CUDA0
    assert bf16["cache"].layers[0].indexer_keys is not None  # the group's full layer keeps the indexer keys
    assert bf16["prefill"].device == CUDA0
    assert all(x.device == CUDA0 and tuple(x.shape) == (B, 1, 256) for x in bf16["logits"])


def test_one_decode_graph_rewritten_and_offloaded_pools_on_the_device(bf16):
    be = bf16["be"]
    assert len(be.reports) == 1
    rep = be.reports[-1]
    assert rep["rewritten"] and rep["hf"]["offload"] and rep["refusals"] == []
    assert [g["layers"] for g in rep["groups"]] == [[0, 1]]
    tensors = be.state.tensors()
    assert any(k.startswith("pool_kv") for k in tensors)
    assert {k: t.device for k, t in tensors.items() if t.device != CUDA0} == {}


def test_the_step_writes_through_the_op_and_serves_from_the_host_without_copies(bf16):
    """Per layer one static_cache_write_ of device rows into the host caches, one dsa_serve reading them; no
    device-to-host copy, and no host-to-device copy of a host tensor (the dense path's whole-cache copy went
    with the dense attention)."""
    nodes = _calls(bf16["graph"])
    writes = [n for n in nodes if n.target is torch.ops.offload_ref.static_cache_write_.default]
    assert len(writes) == 2
    for w in writes:
        keys, values, pos, ks, vs = (_val(a) for a in w.args)
        assert (keys.device, values.device) == (CPU, CPU) and tuple(keys.shape) == (B, 1, T, 64)
        assert (pos.device, ks.device, vs.device) == (CUDA0, CUDA0, CUDA0) and tuple(ks.shape) == (B, 1, 1, 64)
    serves = [n for n in nodes if n.target is torch.ops.custom.dsa_serve.default]
    assert len(serves) == 2
    assert all(_val(s.args[1]).device == CPU and _val(s.args[3]).device == CUDA0 for s in serves)
    to_host = [n.name for n in nodes if isinstance(_val(n), torch.Tensor) and _val(n).device == CPU
               and n.target not in (aten.view.default, aten._unsafe_view.default)]
    assert to_host == []
    from_host = [n.name for n in nodes if n.target is aten._to_copy.default and _val(n.args[0]).device == CPU]
    assert from_host == []
    assert bf16["be"].lowering.host_cache_writes[bf16["be"].reports[-1]["graph_id"]].rewritten == 0


def test_the_step_is_capturable(bf16):
    """Nothing in the lowered step keeps it out of one CUDA graph (lowering/cuda_graphs.py): no host read of a
    device value, no device assert, host tensors only at the write and serve operands."""
    assert capture_problems(bf16["graph"]) == []


def test_fp32_sparse_rewrite_moves_only_the_selected_rows(bf16):
    """fp32 caches: the offload is refused (kv_dtype), the sparse attention gathers the K selected rows on the
    host and moves those rows, not the cache, to the device; the offloaded bf16 step moves nothing itself
    (serve reads the host rows in its kernel)."""
    assert bf16["moved"] == []
    r = _flow("float32")
    rep = r["be"].reports[-1]
    assert rep["rewritten"] and not rep["hf"]["offload"]
    assert {x["reason"] for x in rep["hf"]["offload_refusals"]} == {"kv_dtype"}
    K = rep["hf"]["sites"][0]["K"]
    assert sorted(r["moved"]) == sorted([(B, 1, K, 64), (B, 1, K, 16)] * 2)  # latent and rope rows, 2 layers
    assert all(x.device == CUDA0 for x in r["logits"])

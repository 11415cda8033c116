"""offload_passes.cuda on a CPU-only machine: the placement decisions (which buffers go to pinned host
memory, which stay on the device, shapes, dtypes, bytes) for the recipe-form model and a Hugging Face
StaticCache; the clear error where pinning would need CUDA."""
from __future__ import annotations

import pytest
import torch

from offload_passes import cuda as C
from offload_passes import models


@pytest.fixture(scope="module")
def tiny():
    return models.build("tiny", enable_offload=True)


def test_recipe_model_full_caches_go_to_the_host(tiny):
    plan = C.plan_placement(tiny.model)
    cfg = tiny.config
    n_layers = cfg.num_hidden_layers
    host = [p for p in plan if p.where == C.HOST]
    dev = [p for p in plan if p.where == C.DEVICE]
    assert len(host) == 2 * n_layers
    assert {p.role for p in host} == {"full_latent", "full_rope"}
    assert all(p.name.endswith(("self_attn.kv_cache", "self_attn.k_rope_cache")) for p in host), [p.name for p in host]
    assert {p.role for p in dev} >= {"selection", "table", "ledger", "indexer"}
    # one indexer key cache per full layer (the shared layers reuse the full layer's top-k)
    n_full = sum(t == "full" for t in cfg.indexer_types)
    assert sum(p.role == "indexer" for p in dev) == n_full
    bufs = dict(tiny.model.named_buffers())
    for p in plan:
        t = bufs[p.name]
        assert p.shape == tuple(t.shape) and p.dtype == str(t.dtype).replace("torch.", "")
        assert p.nbytes == t.numel() * t.element_size()
    lat = next(p for p in host if p.role == "full_latent")
    assert lat.shape[-1] == cfg.kv_lora_rank and lat.shape[-2] == 1
    rope = next(p for p in host if p.role == "full_rope")
    assert rope.shape[-1] == cfg.qk_rope_head_dim
    b = C.kv_bytes(plan)
    assert b[C.HOST] == sum(p.nbytes for p in host) and b[C.DEVICE] == sum(p.nbytes for p in dev)
    assert b["device_kv"] == sum(p.nbytes for p in dev if p.role in ("selection", "indexer"))
    # the plan moves nothing
    assert all(bufs[p.name].device.type == "cpu" and not bufs[p.name].is_pinned() for p in plan)


def test_model_without_offload_is_refused():
    m = models.build("tiny", enable_offload=False).model
    with pytest.raises(ValueError, match="built without enable_offload"):
        C.plan_placement(m)
    with pytest.raises(ValueError, match="has no attention module with buffers"):
        C.plan_placement(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="expected a recipe-form model .* or a transformers StaticCache, got int"):
        C.plan_placement(3)


def test_hf_static_cache_latent_and_rope_go_to_the_host():
    from offload_passes.models.hf import build

    b = build("hf-tiny")
    dec = b.decoder()
    dec.prefill(4)
    plan = C.plan_placement(dec.cache)
    L = len(dec.cache.layers)
    host = [p for p in plan if p.where == C.HOST]
    assert [p.name for p in host] == [f"cache.layers[{i}].{a}" for i in range(L) for a in ("keys", "values")]
    layer0 = dec.cache.layers[0]
    assert host[0].shape == tuple(layer0.keys.shape) and host[0].shape[1] == 1  # latent [B, 1, T, C]
    assert host[1].shape == tuple(layer0.values.shape) and host[1].role == "full_rope"
    assert all(p.where == C.DEVICE and p.role == "indexer" for p in plan if p.name.endswith("indexer_keys"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error (this machine has CUDA)")
def test_pinning_needs_cuda_clear_error(tiny):
    before = {n: b.data_ptr() for n, b in tiny.model.named_buffers()}
    with pytest.raises(RuntimeError, match=r"offload_passes.cuda.place_full_caches: pinned host memory and CUDA "
                                           r"kernels need a CUDA device \(torch.cuda.is_available\(\) is False"):
        C.place_full_caches(tiny.model)
    assert before == {n: b.data_ptr() for n, b in tiny.model.named_buffers()}  # nothing moved


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error (this machine has CUDA)")
def test_host_pinning_needs_cuda_and_sizes_are_exact():
    t = torch.zeros(3, 5)
    with pytest.raises(RuntimeError, match=r"offload_passes.cuda.host_pinned: pinned host memory and CUDA kernels"):
        C.host_pinned(t)
    assert C._REGISTERED == {}
    # GLM-5: 78 layers x (512 + 64) x bf16 per token of context and batch row; 754 GB at B = 128 and 64K
    assert C.host_bytes_per_token(512, 64, 78) == 89856
    assert 128 * 65536 * C.host_bytes_per_token(512, 64, 78) == 753_766_760_448

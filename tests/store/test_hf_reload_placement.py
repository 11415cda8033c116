"""Where a reload writes (fake CUDA, ``tests/cuda/_fake_cuda.py``: no GPU): into ``HostStaticCache`` the
attention KV stays in host memory and only the indexer keys, which the device reads, cross to the device; into a
device ``StaticCache`` everything crosses (the recorder sees both kinds)."""
from __future__ import annotations

import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "cuda"))
import _fake_cuda as F  # noqa: E402

from offload_passes.store.hf import hf_cache_layout, reload_hf  # noqa: E402

aten = torch.ops.aten
CPU, CUDA0 = torch.device("cpu"), torch.device("cuda", 0)


class _HostToDevice(TorchDispatchMode):
    """Records the shape of every host-to-device copy."""

    def __init__(self, out: list):
        super().__init__()
        self.out = out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        if func in (aten._to_copy.default, aten.copy_.default) and isinstance(res, torch.Tensor):
            src = args[0] if func is aten._to_copy.default else args[1]
            if isinstance(src, torch.Tensor) and src.device == CPU and res.device == CUDA0:
                self.out.append(tuple(src.shape))
        return res


class _Fp:
    def __init__(self, caches):
        self.caches = caches
        self.fields = {"caches": caches}


class _Store:
    """A store double: 32 tokens of chunks (fake host tensors) for any prompt."""

    def __init__(self, layout):
        self.fp = _Fp(layout)
        self.chunks = [{n: torch.zeros((16,) + s, dtype=d) for n, (s, d) in layout.items()} for _ in range(2)]

    def load(self, ids, limit=None, copy=True):
        return 32, self.chunks


def test_reload_into_host_kv_moves_only_indexer_keys_to_the_device():
    from transformers import StaticCache

    from offload_passes.hf_cache import HostStaticCache
    from offload_passes.models import hf

    F.install_fake_cuda_guard()
    m = hf.build("hf-tiny", dtype="bfloat16", num_hidden_layers=2, index_topk_pattern="FS",
                 mlp_layer_types=["dense", "dense"]).model
    mode = F.new_mode()
    twins = F.fake_cuda_model(m, mode, set())
    host, dev = [], []
    with mode, F.values_from_twins(twins), F.sdpa_without_device(), torch.no_grad():
        layout = hf_cache_layout(m)
        store = _Store(layout)
        ids = torch.randint(2, 256, (1, 40))
        cache = HostStaticCache(m.config, max_cache_len=64, batch_size=1, device="cuda", dtype=torch.bfloat16)
        with _HostToDevice(host):
            assert reload_hf(store, m, ids, cache) == 32
        plain = StaticCache(config=m.config, max_cache_len=64)
        with _HostToDevice(dev):
            reload_hf(store, m, ids, plain)
    assert [(n, s) for n, (s, _) in layout.items()] == [("0.k", (1, 64)), ("0.v", (1, 16)), ("0.index_k", (32,)),
                                                        ("1.k", (1, 64)), ("1.v", (1, 16))]
    assert all(layer.keys.device == CPU and layer.values.device == CPU for layer in cache.layers)
    assert cache.layers[0].indexer_keys.device == CUDA0 and cache.layers[1].keys.shape == (1, 1, 64, 64)
    assert host and all(s[-1] == 32 for s in host), host  # indexer keys only (index_head_dim 32)
    assert any(s[-1] == 64 for s in dev) and any(s[-1] == 16 for s in dev), dev  # a device cache: the KV too

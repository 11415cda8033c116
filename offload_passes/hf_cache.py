"""``HostStaticCache``: a ``transformers`` ``StaticCache`` whose DSA layers keep their latent / rope KV in host memory.

``StaticCache`` cannot hold its KV on the host for a CUDA model: its ``index_copy_`` of device rows into a
host tensor is refused (by torch and by Dynamo). This cache is the same ``StaticCache`` except for its
``indexed_attention`` layers, :class:`HostIndexedLayer`: ``keys`` / ``values`` on the host (pinned on CUDA),
indexer keys and counters on the device, and ``update`` writing through ``offload_ref::static_cache_write_``
(``index_copy_`` on the CPU: bit for bit a ``StaticCache``; a Triton store through the pinned address on
CUDA), which the HF front-end reads the step's positions from. ``update`` returns device copies of the
host caches for the dense attention; the offload rewrite removes them with it. Usage and limits:
docs/hf.md, "Host KV".
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Union

import torch

try:
    from transformers import StaticCache
    from transformers.cache_utils import StaticIndexedLayer
except ImportError as e:  # pragma: no cover - the [hf] extra is part of the documented set-up
    raise ImportError("offload_passes.hf_cache needs transformers with StaticIndexedLayer (5.23): "
                      "pip install 'offload_passes[hf]'") from e

from . import _compat
from . import cuda as _cuda

log = logging.getLogger("offload_passes.hf_cache")

__all__ = ["HostStaticCache", "HostIndexedLayer", "host_kv_shapes"]

_write = torch.ops.offload_ref.static_cache_write_


def host_kv_shapes(config: Any, batch_size: int, max_cache_len: int) -> tuple[tuple, tuple]:
    """``(keys shape, values shape)`` of one DSA layer: ``[B, 1, T, kv_lora_rank]`` and ``[B, 1, T,
    qk_rope_head_dim]`` (every MLA family's ``update(k_pass, k_rot)``, transformers 5.23)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    missing = [a for a in ("kv_lora_rank", "qk_rope_head_dim") if not isinstance(getattr(text, a, None), int)]
    if missing:
        raise ValueError(f"HostStaticCache: config {type(text).__name__} has no {missing}: the host KV layout is "
                         "the MLA latent cache [B, 1, T, kv_lora_rank] + rope [B, 1, T, qk_rope_head_dim]")
    return ((batch_size, 1, max_cache_len, text.kv_lora_rank), (batch_size, 1, max_cache_len, text.qk_rope_head_dim))


def _host_zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros in host memory: pinned in place when ``device`` is a CUDA device (its kernels read and write them
    through their address), plain host memory otherwise (the CPU, or a fake CUDA device without a driver)."""
    t = torch.zeros(shape, dtype=dtype, device="cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        t = _cuda.host_pinned(t)
    return t


_NOT_TRACED = ("HostStaticCache: a layer's host KV is allocated on its first update, here inside a compiled call; "
               "pinning host memory is a driver call Dynamo does not trace, so the allocation runs eagerly (a graph "
               "break; refused under fullgraph=True). To keep the call whole, build the cache with batch_size=, "
               "device= and dtype= (allocated at construction)")


@torch.compiler.disable(reason=_NOT_TRACED)
def _allocate(layer: "HostIndexedLayer", keys_shape: tuple, values_shape: tuple, dtype: torch.dtype,
              device: torch.device) -> None:
    layer.dtype, layer.device = dtype, device
    layer.batch_size, layer.num_heads = keys_shape[:2]
    layer.k_head_dim, layer.v_head_dim = keys_shape[-1], values_shape[-1]
    layer.keys = _host_zeros(tuple(keys_shape), dtype, device)
    layer.values = _host_zeros(tuple(values_shape), dtype, device)
    layer.cumulative_length = layer.cumulative_length.to(device)
    # fixed addresses, as StaticLayer marks its own (Dynamo / CUDA graphs keep them as static inputs)
    for t in (layer.keys, layer.values, layer.cumulative_length):
        _compat.mark_static_address(t)
    layer.is_initialized = True
    log.debug("host KV layer: keys %s values %s %s, counters on %s", tuple(keys_shape), tuple(values_shape), dtype,
              device)


class HostIndexedLayer(StaticIndexedLayer):
    """A ``StaticIndexedLayer`` whose latent / rope KV live in host memory (module doc). ``device`` (the
    model's) holds the length counters and the indexer keys."""

    #: what ``offload_passes.cuda`` places and pins (``keys`` / ``values``: host; ``indexer_keys``: device)
    host_kv = True

    def allocate(self, keys_shape: tuple, values_shape: tuple, dtype: torch.dtype,
                 device: Union[str, torch.device]) -> None:
        """The host KV of this layer (zeros) and the counters on ``device``; what ``lazy_initialization``
        does from the first rows, ahead of time (never traced: :data:`_NOT_TRACED`)."""
        _allocate(self, tuple(keys_shape), tuple(values_shape), dtype, torch.device(device))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, Dk = key_states.shape
        shape = (B, H, self.max_cache_len)
        self.allocate(shape + (Dk,), shape + (value_states.shape[-1],), key_states.dtype, key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        kv_length = key_states.shape[-2]
        cache_position = torch.arange(kv_length, device=self.device) + self.cumulative_length
        self.cumulative_length.add_(kv_length)
        _write(self.keys, self.values, cache_position, key_states, value_states)
        if self.keys.device == key_states.device:
            return self.keys, self.values
        # the dense attention of the unmodified model reads every row on the device (a rewritten graph
        # drops this copy with the attention it feeds: passes/frontends/hf/detect.py)
        return self.keys.to(key_states.device), self.values.to(key_states.device)

    def reset(self) -> None:
        if self.is_initialized and self.keys.device != self.device:
            _cuda.before_host_write(self.device)  # kernels launched earlier may still read or write the rows
        super().reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows reordered in place (the pinned allocations, and the offload state keyed by them,
        stay); the indexer keys as ``StaticIndexedLayer`` does."""
        keys, values = self.keys, self.values
        if self.is_initialized and keys.device != self.device:
            _cuda.before_host_write(self.device)
            idx = beam_idx.to(keys.device)
            keys.copy_(keys.index_select(0, idx))
            values.copy_(values.index_select(0, idx))
            self.keys, self.values = None, None  # the base class reorders keys / values: skip them there
            self.is_initialized = False
            try:
                super().reorder_cache(beam_idx)
            finally:
                self.keys, self.values, self.is_initialized = keys, values, True
        else:
            super().reorder_cache(beam_idx)


class HostStaticCache(StaticCache):
    """A ``StaticCache`` whose ``indexed_attention`` layers keep their KV in host memory (module doc).

    ``batch_size``, ``device`` (the model's) and ``dtype`` allocate every host layer now; without them each
    layer allocates on its first (eager) ``update``. ``offloading=True`` (transformers' own copy-to-CPU
    scheme) does not combine with host-resident KV and is refused.
    """

    #: ``offload_passes.cuda.place_full_caches`` places this cache (a plain ``StaticCache`` it refuses)
    host_kv = True

    def __init__(self, config: Any, max_cache_len: int, batch_size: Optional[int] = None,
                 device: Union[str, torch.device, None] = None, dtype: Optional[torch.dtype] = None,
                 offloading: bool = False, **kwargs: Any):
        if offloading:
            raise ValueError("HostStaticCache: offloading=True (transformers' prefetch of KV copied to the CPU) does "
                             "not combine with KV that already lives in host memory")
        super().__init__(config=config, max_cache_len=max_cache_len, offloading=False, **kwargs)
        self.layers = [HostIndexedLayer(max_cache_len=layer.max_cache_len) if type(layer) is StaticIndexedLayer
                       else layer for layer in self.layers]
        if not any(isinstance(layer, HostIndexedLayer) for layer in self.layers):
            raise ValueError(f"HostStaticCache: config {type(config).__name__} has no indexed_attention (DSA) layer: "
                             "there is no KV the offload could serve from the host")
        given = {"batch_size": batch_size, "device": device, "dtype": dtype}
        if any(v is not None for v in given.values()):
            if any(v is None for v in given.values()):
                raise ValueError("HostStaticCache: batch_size, device and dtype allocate the KV together; missing: "
                                 f"{sorted(k for k, v in given.items() if v is None)}")
            if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
                raise ValueError(f"HostStaticCache: batch_size must be an int >= 1, got {batch_size!r}")
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"HostStaticCache: dtype must be a torch.dtype, got {dtype!r}")
            k, v = host_kv_shapes(config, batch_size, max_cache_len)
            for layer in self.layers:
                if isinstance(layer, HostIndexedLayer):
                    layer.allocate(k, v, dtype, torch.device(device))

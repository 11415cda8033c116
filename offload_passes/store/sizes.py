"""What one token of KV costs in the store for a models/glm config: the caches a chunk must hold per layer
(MLA latent and rope key at the cache dtype; the indexer key of each layer that keeps one, int8 with an fp16
dequant scale under W8A8's ``li_cache_quant_mode: int8``). Read from the config's fields only."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["glm_cache_layout", "KVBytes", "kv_bytes_per_token"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _model(cfg: Any) -> Any:
    model = getattr(cfg, "model", cfg)  # a GlmConfig or its ModelConfig
    for f in ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim", "index_head_dim", "indexer_types",
              "torch_dtype"):
        if not hasattr(model, f):
            raise TypeError(f"glm_cache_layout: cfg has no {f!r}; pass a models/glm GlmConfig or ModelConfig")
    return model


def glm_cache_layout(cfg: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{cache name: (per-token shape, dtype)} of every cache a GLM DSA model keeps per token, named as the
    model's buffers (``layers.<i>.self_attn.kv_cache`` ...): the ``caches`` field of a store Fingerprint."""
    m = _model(cfg)
    dt = _DTYPES[m.torch_dtype]
    int8_indexer = bool(getattr(m, "li_cache_int8", False))
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for i in range(m.num_hidden_layers):
        attn = f"layers.{i}.self_attn"
        out[f"{attn}.kv_cache"] = ((1, m.kv_lora_rank), dt)
        if m.qk_rope_head_dim:
            out[f"{attn}.k_rope_cache"] = ((1, m.qk_rope_head_dim), dt)
        if m.indexer_types[i] == "full":  # a shared layer reads its group leader's indexer keys
            out[f"{attn}.indexer.key_cache"] = ((1, m.index_head_dim), torch.int8 if int8_indexer else dt)
            if int8_indexer:
                out[f"{attn}.indexer.key_scale_cache"] = ((1,), torch.float16)
    return out


@dataclass(frozen=True)
class KVBytes:
    """Bytes per token: ``attention`` (latent + rope), ``indexer_keys``, ``indexer_scales`` (W8A8), ``total``."""

    attention: int
    indexer_keys: int
    indexer_scales: int

    @property
    def total(self) -> int:
        return self.attention + self.indexer_keys + self.indexer_scales

    @property
    def indexer_share(self) -> float:
        """Fraction of the bytes that are indexer keys and their scales."""
        return (self.indexer_keys + self.indexer_scales) / self.total


def kv_bytes_per_token(cfg: Any) -> KVBytes:
    """Per-token store bytes of a models/glm config, split by kind of cache."""
    parts = {"attention": 0, "indexer_keys": 0, "indexer_scales": 0}
    for name, (shape, dt) in glm_cache_layout(cfg).items():
        kind = ("indexer_scales" if name.endswith("key_scale_cache") else
                "indexer_keys" if name.endswith("indexer.key_cache") else "attention")
        parts[kind] += math.prod(shape) * dt.itemsize
    return KVBytes(**parts)

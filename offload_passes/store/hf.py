"""KV chunks out of and into Hugging Face caches, so that a chat's next turn or a request sharing a long system
prompt prefills only what is new, without the caller keeping the cache object (a new process too, from disk).

A chunk holds, per layer, the attention KV the cache layer keeps (``L.k`` / ``L.v``: for the MLA families
the latent ``[1, kv_lora_rank]`` and the rope key ``[1, qk_rope_head_dim]`` per token) and, in a layer whose
indexer keeps keys (``StaticIndexedLayer`` / ``DynamicIndexedLayer``: ``indexer_keys [B, T, index_head_dim]``),
those too (``L.index_k``). The layout is read from the model itself (:func:`hf_cache_layout`: a one-token
forward), so a chunk without the indexer keys of a layer that keeps them is no hit (the fingerprint's cache
layout names them).

Caches: ``transformers``' ``StaticCache`` / ``DynamicCache`` and the project's ``HostStaticCache``. Placement:
each tensor is written where the cache layer keeps it; ``HostStaticCache`` keeps the attention KV in host
memory (pinned beside a CUDA model), so a reload writes it from host memory and only the indexer keys, which
the device reads directly, cross to the device.
"""
from __future__ import annotations

import logging
import re
import weakref
from typing import Any, Callable, Optional

import torch

from .. import _compat
from .keys import Fingerprint
from .paged import weights_digest

log = logging.getLogger("offload_passes.store.hf")

__all__ = ["hf_cache_layout", "hf_fingerprint", "check_hf_store", "reload_hf", "save_hf", "generate_with_store"]

#: the form of :func:`weights_digest` (sha256 hex): a fingerprint's weights identity of this form is a hash
_WEIGHTS_DIGEST = re.compile(r"[0-9a-f]{64}")

_CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                  "index_topk", "index_head_dim", "index_n_heads", "rope_theta", "layer_types", "index_topk_pattern")


#: model type -> why a stored prefix cannot be reloaded into its cache: refused by name rather than reloaded wrong
_UNSERVED = {
    "dots3_note": "its sliding-window layers keep only the last window of tokens, not the whole prefix",
    "mistral_large4": "its kv_source_layers read another layer's cache (a cache layer without keys of its own)",
    "glm5_next": "its linear-attention layers keep a recurrent state, not per-token KV",
}
_UNSERVED["dots3_note_text"] = _UNSERVED["dots3_note"]


def _refuse_unserved(model: Any, where: str) -> None:
    """Refuse (ValueError naming ``where``) a model whose family's cache a stored prefix cannot be reloaded into."""
    types = (getattr(model.config, "model_type", None), getattr(_text_config(model), "model_type", None))
    for t in dict.fromkeys(types):
        if t in _UNSERVED:
            raise ValueError(f"{where}: the KV store does not serve model type {t!r}: {_UNSERVED[t]}; it serves "
                             "the families whose every layer keeps per-token KV of its own")


def _cache_kwarg() -> str:
    from .. import _compat

    return _compat.hf_cache_kwarg()


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


#: model -> (its layout signature, its cache layout): one probe per model while its config and dtype stay
_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _text_config(model: Any) -> Any:
    return model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config


def _layout_signature(model: Any) -> tuple:
    """What the cache layout depends on: the config's cache-shaping fields and the parameters' dtype/device."""
    cfg = _text_config(model)
    p = next(model.parameters())
    return (type(model), p.dtype, p.device) + tuple(repr(getattr(cfg, n, None)) for n in _CONFIG_FIELDS)


@torch.no_grad()
def hf_cache_layout(model: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{chunk name: (per-token shape, dtype)} of every cache ``model`` keeps, read from a one-token forward
    once per model (again when its config's cache fields, dtype or device change)."""
    from transformers import DynamicCache

    sig = _layout_signature(model)
    known = _LAYOUTS.get(model)
    if known is not None and known[0] == sig:
        return dict(known[1])
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=_device(model)), use_cache=True,
          **{_cache_kwarg(): cache})
    out = {}
    for i, layer in enumerate(cache.layers):
        for tag, t in (("k", layer.keys), ("v", layer.values)):
            out[f"{i}.{tag}"] = ((t.shape[1],) + tuple(t.shape[3:]), t.dtype)
        ix = getattr(layer, "indexer_keys", None)
        if ix is not None and ix.numel():
            out[f"{i}.index_k"] = (tuple(ix.shape[2:]), ix.dtype)
    _LAYOUTS[model] = (sig, dict(out))
    return out


def hf_fingerprint(model: Any, chunk_tokens: int, weights_id: Optional[str] = None) -> Fingerprint:
    """The fingerprint of an HF model's KV: config dims, dtype, weights identity (``weights_id``, else a hash of
    the weights), the chunk size and the cache layout (:func:`hf_cache_layout`)."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"hf_fingerprint: chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if weights_id is not None and not isinstance(weights_id, str):
        raise TypeError(f"hf_fingerprint: weights_id must be a str or None, got {type(weights_id).__name__}")
    _refuse_unserved(model, "hf_fingerprint")
    cfg = _text_config(model)
    fields = {n: getattr(cfg, n) for n in _CONFIG_FIELDS if isinstance(getattr(cfg, n, None), (int, float, str, list))}
    fields.update(architecture=f"hf/{type(model).__name__}", dtype=str(next(model.parameters()).dtype),
                  weights=weights_id if weights_id is not None else weights_digest(model), world=[0, 1],
                  chunk_tokens=chunk_tokens, caches={n: (list(s), d) for n, (s, d) in hf_cache_layout(model).items()})
    return Fingerprint.of(fields)


def check_hf_store(model: Any, store: Any, where: str = "check_hf_store") -> None:
    """Refuse (ValueError naming ``where``'s ``store``) a store whose fingerprint is not ``model``'s: every field
    is read from the model again (:func:`hf_fingerprint` with the store's chunk size) except the weights
    identity, which only the weights can confirm: a 64-hex-digit one (hf_fingerprint's default, a hash) must
    be the model's :func:`weights_digest`; any other is the id the store was built with, taken as given."""
    _refuse_unserved(model, where)
    fields = store.fp.fields
    weights = fields.get("weights")
    if not isinstance(weights, str):
        raise ValueError(f"{where}: store's fingerprint has no weights identity: build the store with "
                         "hf_fingerprint(model, chunk_tokens)")
    if _WEIGHTS_DIGEST.fullmatch(weights):
        mine = weights_digest(model)
        if mine != weights:
            raise ValueError(f"{where}: store's fingerprint names other weights (hash {weights[:12]}..., this "
                             f"model's {mine[:12]}...): its chunks are another model's KV")
    expected = hf_fingerprint(model, store.chunk_tokens, weights_id=weights)
    if expected.digest != store.fp.digest:
        differ = sorted(k for k in set(expected.fields) | set(fields) if expected.fields.get(k) != fields.get(k))
        raise ValueError(f"{where}: store's fingerprint is not this model's (it differs in {differ}): build the "
                         "store with hf_fingerprint(model, chunk_tokens)")


def _ids(call: str, input_ids: Any) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{call}: input_ids must be an integer tensor [1, T], got {type(input_ids).__name__}")
    if input_ids.dim() == 2 and input_ids.size(0) == 1:
        input_ids = input_ids[0]
    if input_ids.dim() != 1 or input_ids.numel() < 1:
        raise ValueError(f"{call}: input_ids must be [1, T] with T >= 1 (one sequence), got {tuple(input_ids.shape)}")
    return input_ids.to("cpu", torch.int64)


def _rows(t: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """The first ``n`` rows of a token-major chunk tensor ``[T, H, D]`` as a cache layer holds them ``[1, H, n, D]``."""
    return t[:n].permute(1, 0, 2).unsqueeze(0).to(device)


def _empty(t: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """An uninitialised ``[1, H, n, D]`` buffer of the chunk tensor ``t``'s per-token shape and dtype."""
    return t.new_empty((1, t.size(1), n, *t.shape[2:]), device=device)


def _fill_layer(layer: Any, chunks: list, i: int, n: int, indexed: bool, device: torch.device) -> None:
    """Rows ``0..n-1`` of cache layer ``i`` := the chunks' tensors (token-major ``[n_c, H, D]``; ``index_k``
    ``[n_c, Di]``), each chunk copied once, straight into the layer's rows: a static layer's preallocated
    buffers in place, where the layer keeps them (``HostStaticCache``'s KV is host memory: no device copy on
    the way); a dynamic layer gets new tensors of exactly ``n`` rows."""
    from .paged import copy_rows

    first = chunks[0]
    static = hasattr(layer, "max_cache_len")
    if not layer.is_initialized:
        layer.lazy_initialization(*(_rows(first[f"{i}.{t}"], 1, device) for t in ("k", "v")))
    if not static:
        layer.keys, layer.values = (_empty(first[f"{i}.{t}"], n, device) for t in ("k", "v"))
    dst, src = [], []
    for tag, buf in (("k", layer.keys), ("v", layer.values)):
        s = 0
        for c in chunks:
            t = c[f"{i}.{tag}"]
            dst.append(buf[0, :, s:s + t.size(0)])
            src.append(t.transpose(0, 1))
            s += t.size(0)
    if indexed:
        ix = first[f"{i}.index_k"]
        if not layer.is_indexer_initialized:
            layer.lazy_initialization_indexer(ix[:1].unsqueeze(0).to(device))
        if not static:
            layer.indexer_keys = ix.new_empty((1, n, *ix.shape[1:]), device=device)
        s = 0
        for c in chunks:
            t = c[f"{i}.index_k"]
            dst.append(layer.indexer_keys[0, s:s + t.size(0)])
            src.append(t)
            s += t.size(0)
    copy_rows(dst, src)
    if static:
        layer.cumulative_length.fill_(n)
        if indexed:
            layer.indexer_cumulative_length.fill_(n)


def _cache_layers(cache: Any) -> list:
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or not layers:
        raise TypeError(f"reload_hf: cache must be a transformers Cache with layers (StaticCache, DynamicCache, "
                        f"HostStaticCache), got {type(cache).__name__}")
    return layers


def _held(cache: Any) -> int:
    """Tokens the cache holds; 0 for a counter without a value (a fake tensor: the fake-CUDA test double)."""
    n = cache.get_seq_length()
    return 0 if isinstance(n, torch.Tensor) and _compat.is_fake(n) else int(n)


@torch.no_grad()
def reload_hf(store: Any, model: Any, input_ids: torch.Tensor, cache: Any, limit: Optional[int] = None) -> int:
    """Load the longest stored prefix of ``input_ids`` (one sequence; at most ``limit`` tokens, default all but
    the last: the logits need one computed token) into the empty ``cache`` at positions ``0..n-1``; returns n
    (0: the cache is untouched). Then ``generate(input_ids, cache=...)`` computes only tokens ``n..``."""
    _refuse_unserved(model, "reload_hf")
    ids = _ids("reload_hf", input_ids)
    layers = _cache_layers(cache)
    held = _held(cache)
    if held:
        raise ValueError(f"reload_hf: cache must be empty (it holds {held} tokens)")
    names = set(store.fp.caches)
    missing = sorted(set(hf_cache_layout(model)) - names)
    if missing or len(layers) != len({n.split(".")[0] for n in names}):
        raise ValueError(f"reload_hf: the store's chunks lack {missing[:4]} of the caches the model keeps (or its "
                         f"layers differ from the cache's {len(layers)}): a chunk without them is no hit; build the "
                         "store with hf_fingerprint(model)")
    n, chunks = store.load(ids, limit=ids.numel() - 1 if limit is None else limit, copy=False)
    if not n:
        return 0
    dev = _device(model)
    for i, layer in enumerate(layers):
        _fill_layer(layer, chunks, i, n, f"{i}.index_k" in names, dev)
    log.debug("reloaded %d tokens into %s", n, type(cache).__name__)
    return n


@torch.no_grad()
def save_hf(store: Any, input_ids: torch.Tensor, cache: Any) -> int:
    """Store the KV ``cache`` holds for the first ``cache.get_seq_length()`` tokens of ``input_ids`` (the whole
    sequence generate() returned: its last token has no KV yet); returns the chunks written."""
    ids = _ids("save_hf", input_ids)
    layers = _cache_layers(cache)
    T = int(cache.get_seq_length())
    if T > ids.numel():
        raise ValueError(f"save_hf: the cache holds {T} tokens, input_ids only {ids.numel()}")
    if T == 0:
        return 0
    rows: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        rows[f"{i}.k"] = layer.keys[0, :, :T].transpose(0, 1).to("cpu")
        rows[f"{i}.v"] = layer.values[0, :, :T].transpose(0, 1).to("cpu")
        ix = getattr(layer, "indexer_keys", None)
        if ix is not None and ix.numel():
            rows[f"{i}.index_k"] = ix[0, :T].to("cpu")
    C = store.chunk_tokens
    chunks = [{k: v[s:s + C].contiguous() for k, v in rows.items()} for s in range(0, T, C)]
    return store.put(ids[:T], chunks)


def generate_with_store(model: Any, store: Any, input_ids: torch.Tensor, cache: Optional[Any] = None,
                        max_cache_len: Optional[int] = None, generate: Optional[Callable] = None,
                        **generate_kwargs: Any) -> Any:
    """``model.generate`` (or ``generate``) of one sequence that reloads its longest stored prefix first and
    stores the whole sequence after: ``cache`` (default a ``StaticCache`` of ``max_cache_len``, else a fresh
    cache of the caller's choice, e.g. ``HostStaticCache``). Returns generate's output; what was reloaded is
    counted in ``store.stats``."""
    from transformers import StaticCache

    ids = _ids("generate_with_store", input_ids).view(1, -1)
    if cache is None:
        if not isinstance(max_cache_len, int) or max_cache_len < ids.size(1) + 1:
            raise ValueError(f"generate_with_store: max_cache_len must be an int > len(input_ids)={ids.size(1)} "
                             f"when no cache is given, got {max_cache_len!r}")
        cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    reload_hf(store, model, ids, cache)
    dev = _device(model)
    gen = generate if generate is not None else model.generate
    kw = dict(generate_kwargs)
    kw.setdefault("attention_mask", torch.ones_like(ids, device=dev))
    out = gen(ids.to(dev), **{_cache_kwarg(): cache}, **kw)
    seq = out.sequences if hasattr(out, "sequences") else out
    save_hf(store, seq[0].to("cpu"), cache)
    return out

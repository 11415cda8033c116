"""KV chunks out of and into Hugging Face caches, so that a chat's next turn or a request sharing a long system
prompt prefills only what is new, without the caller keeping the cache object (a new process too, from disk).

A chunk holds, per layer, the attention KV the cache layer keeps (``L.k`` / ``L.v``: for the MLA families
the latent ``[1, kv_lora_rank]`` and the rope key ``[1, qk_rope_head_dim]`` per token) and, in a layer whose
indexer keeps keys (``StaticIndexedLayer`` / ``DynamicIndexedLayer``: ``indexer_keys [B, T, index_head_dim]``),
those too (``L.index_k``). The layout is read from the model itself (:func:`hf_cache_layout`: a one-token
forward), so a chunk without the indexer keys of a layer that keeps them is no hit (the fingerprint's cache
layout names them). A layer that reads another layer's cache (``kv_source_layers``) keeps no chunk tensor;
sliding-window and linear-attention layers keep their window rows / states in the end snapshot of a saved
sequence (:mod:`.hf_layers`), so such a model reloads only a prefix that ends where a sequence was saved.

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
from . import hf_layers
from .chunk import EXTRAS_FIELD, chunk_extras
from .keys import Fingerprint
from .paged import weights_digest

log = logging.getLogger("offload_passes.store.hf")

__all__ = ["hf_cache_layout", "hf_end_snapshot", "hf_fingerprint", "check_hf_store", "reload_hf", "save_hf",
           "generate_with_store"]

#: the form of :func:`weights_digest` (sha256 hex): a fingerprint's weights identity of this form is a hash
_WEIGHTS_DIGEST = re.compile(r"[0-9a-f]{64}")

_CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                  "index_topk", "index_head_dim", "index_n_heads", "rope_theta", "layer_types", "index_topk_pattern",
                  "kv_source_layers")
#: further config fields the cache layout depends on (read again when they change; the layout names their effect)
_LAYOUT_FIELDS = ("sliding_window", "linear_conv_kernel_dim", "linear_num_heads", "linear_head_dim")


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
    return (type(model), p.dtype, p.device) + tuple(repr(getattr(cfg, n, None))
                                                    for n in _CONFIG_FIELDS + _LAYOUT_FIELDS)


@torch.no_grad()
def _layers(model: Any, call: str = "hf_cache_layout") -> list[hf_layers.LayerLayout]:
    """What each cache layer of ``model`` keeps, read from a one-token forward once per model (again when its
    config's cache fields, dtype or device change); a layer the store does not know is refused naming ``call``."""
    from transformers import DynamicCache

    sig = _layout_signature(model)
    known = _LAYOUTS.get(model)
    if known is not None and known[0] == sig:
        return known[1]
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=_device(model)), use_cache=True,
          **{_cache_kwarg(): cache})
    layouts = hf_layers.probe_layers(cache, call)
    _LAYOUTS[model] = (sig, layouts)
    return layouts


def hf_cache_layout(model: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{chunk name: (per-token shape, dtype)} of every per-token cache ``model`` keeps (every chunk holds them),
    read from a one-token forward once per model (again when its config's cache fields, dtype or device change)."""
    return {n: spec for lay in _layers(model) for n, spec in lay.tokens.items()}


def hf_end_snapshot(model: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{chunk extra name: (shape, dtype)} of the end snapshot ``model``'s cache needs at a reload's boundary:
    sliding-window rows and linear-attention states ({} for a model whose every layer keeps per-token KV)."""
    return {n: spec for lay in _layers(model) for n, spec in lay.snapshot.items()}


def hf_fingerprint(model: Any, chunk_tokens: int, weights_id: Optional[str] = None) -> Fingerprint:
    """The fingerprint of an HF model's KV: config dims, dtype, weights identity (``weights_id``, else a hash of
    the weights), the chunk size and the cache layout (:func:`hf_cache_layout`)."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"hf_fingerprint: chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if weights_id is not None and not isinstance(weights_id, str):
        raise TypeError(f"hf_fingerprint: weights_id must be a str or None, got {type(weights_id).__name__}")
    _layers(model, "hf_fingerprint")
    cfg = _text_config(model)
    fields = {n: getattr(cfg, n) for n in _CONFIG_FIELDS if isinstance(getattr(cfg, n, None), (int, float, str, list))}
    fields.update(architecture=f"hf/{type(model).__name__}", dtype=str(next(model.parameters()).dtype),
                  weights=weights_id if weights_id is not None else weights_digest(model), world=[0, 1],
                  chunk_tokens=chunk_tokens, caches={n: (list(s), d) for n, (s, d) in hf_cache_layout(model).items()})
    snapshot = hf_end_snapshot(model)
    if snapshot:  # only then: the fingerprints of models without one stay as they were
        fields[EXTRAS_FIELD] = {n: (list(s), d) for n, (s, d) in snapshot.items()}
    return Fingerprint.of(fields)


def check_hf_store(model: Any, store: Any, where: str = "check_hf_store") -> None:
    """Refuse (ValueError naming ``where``'s ``store``) a store whose fingerprint is not ``model``'s: every field
    is read from the model again (:func:`hf_fingerprint` with the store's chunk size) except the weights
    identity, which only the weights can confirm: a 64-hex-digit one (hf_fingerprint's default, a hash) must
    be the model's :func:`weights_digest`; any other is the id the store was built with, taken as given."""
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
    ids = _ids("reload_hf", input_ids)
    layers = _cache_layers(cache)
    held = _held(cache)
    if held:
        raise ValueError(f"reload_hf: cache must be empty (it holds {held} tokens)")
    layouts = _layers(model, "reload_hf")
    hf_layers.check_cache_layers(layouts, layers)
    mine = {**hf_cache_layout(model), **hf_end_snapshot(model)}
    theirs = {**store.fp.caches, **chunk_extras(store.fp, "reload_hf")}
    missing = sorted(set(mine) - set(theirs))
    if set(theirs) != set(mine):
        raise ValueError(f"reload_hf: the store's chunks lack {missing[:4]} of the caches the model keeps (or hold "
                         f"{sorted(set(theirs) - set(mine))[:4]}, which it does not keep): a chunk without them is no "
                         "hit; build the store with hf_fingerprint(model)")
    snapshot = sorted(hf_end_snapshot(model))  # a model with one reloads only where a saved sequence ended
    n, chunks = store.load(ids, limit=ids.numel() - 1 if limit is None else limit, copy=False,
                           **({"ends_with": snapshot} if snapshot else {}))
    if not n:
        return 0
    dev = _device(model)
    for lay, layer in zip(layouts, layers):
        hf_layers.fill_layer(lay, layer, chunks, n, dev)
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
    extras = chunk_extras(store.fp, "save_hf")
    layouts = hf_layers.layouts_of(store.fp.caches, extras, layers)
    rows: dict[str, torch.Tensor] = {}
    for lay, layer in zip(layouts, layers):
        rows.update(hf_layers.save_rows(lay, layer, T))
    C = store.chunk_tokens
    chunks = [{k: v[s:s + C].contiguous() for k, v in rows.items()} for s in range(0, T, C)]
    if extras:
        chunks[-1].update(hf_layers.save_snapshot(layouts, layers, T))  # the state at T: the last chunk's end
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

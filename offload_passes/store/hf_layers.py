"""What each kind of Hugging Face cache layer keeps, and how the KV store saves it and writes it back.

* A **full attention layer** (``DynamicLayer`` / ``StaticLayer``, the indexed ones with their indexer keys)
  keeps one row per token: chunk tensors ``{i}.k`` / ``{i}.v`` (/ ``{i}.index_k``), in every chunk. A tensor of
  zero width per token (a key-only latent cache's ``values [B, H, T, 0]``) holds nothing: it is not stored, and
  a reload gives the layer an empty one of its shape.
* A **shared layer** (``DummyLayer``: the layer reads another layer's cache, ``kv_source_layers``) keeps
  nothing: no chunk tensor. A layer that shares the KV but keeps its own indexer keys keeps only those.
* A **sliding-window layer** keeps the last rows of its window only, so its rows are not per-token chunk
  tensors: the chunk that ends a saved sequence holds them (``{i}.window.k`` / ``{i}.window.v``, the window's
  last ``W - 1`` rows, the ones the next forward reads, zero rows in front of a shorter sequence's).
* A **linear-attention layer** keeps a state at one position (conv and recurrent): the chunk that ends a saved
  sequence holds it (``{i}.state.conv.{j}`` / ``{i}.state.recurrent.{j}``).

The window rows and the states are the **end snapshot**: chunk extras (``chunk_extras`` in the fingerprint)
held by the chunk whose end is the saved sequence's end, so a stored prefix reloads into such a model only
where a snapshot exists (docs/store.md, "End snapshots").
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from transformers.cache_utils import (DummyLayer, DynamicLayer, DynamicSlidingWindowLayer,
                                      LinearAttentionCacheLayerMixin, StaticLayer, StaticSlidingWindowLayer)

log = logging.getLogger("offload_passes.store.hf_layers")

__all__ = ["LayerLayout", "probe_layers", "layouts_of", "check_cache_layers", "save_rows", "save_snapshot",
           "fill_layer"]

Spec = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class LayerLayout:
    """What cache layer ``index`` keeps: ``tokens`` (per-token chunk tensors, every chunk), ``empty`` (per-token
    tensors of zero width: rebuilt, never stored), ``snapshot`` (end-snapshot extras: ``{i}.window.*`` for a
    sliding layer keeping ``window`` rows, ``{i}.state.*`` for a linear-attention layer)."""

    index: int
    kind: str  # "attention", "shared", "sliding" or "linear" (a hybrid layer: "linear" with tokens too)
    tokens: dict = field(default_factory=dict)
    empty: dict = field(default_factory=dict)
    snapshot: dict = field(default_factory=dict)
    window: int = 0


def _per_token(t: torch.Tensor) -> tuple[int, ...]:
    return (t.shape[1],) + tuple(t.shape[3:])


def _probe_attention(i: int, layer: Any, out: LayerLayout, call: str) -> None:
    sliding = isinstance(layer, DynamicSlidingWindowLayer)
    if sliding:
        if layer.sliding_window < 2:
            raise ValueError(f"{call}: layer {i} has a sliding window of {layer.sliding_window} tokens: "
                             "it keeps no row the next token reads")
        object.__setattr__(out, "window", layer.sliding_window - 1)  # the rows a DynamicSlidingWindowLayer keeps
    for tag, t in (("k", layer.keys), ("v", layer.values)):
        if not (layer.is_initialized and isinstance(t, torch.Tensor)):
            continue  # shares another layer's KV (and keeps only its own indexer keys)
        shape = _per_token(t)
        if 0 in shape:
            out.empty[f"{i}.{tag}"] = (shape, t.dtype)
        elif sliding:
            out.snapshot[f"{i}.window.{tag}"] = ((out.window, *shape), t.dtype)
        else:
            out.tokens[f"{i}.{tag}"] = (shape, t.dtype)
    ix = getattr(layer, "indexer_keys", None)
    if isinstance(ix, torch.Tensor) and ix.numel():
        if sliding:
            raise ValueError(f"{call}: layer {i} is a sliding-window layer with indexer keys; the store "
                             "knows no such layer")
        out.tokens[f"{i}.index_k"] = (tuple(ix.shape[2:]), ix.dtype)


def _probe_linear(i: int, layer: Any, out: LayerLayout) -> None:
    for kind, states in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
        for j, t in states.items():
            if isinstance(t, torch.Tensor):
                out.snapshot[f"{i}.state.{kind}.{j}"] = (tuple(t.shape[1:]), t.dtype)


def probe_layers(cache: Any, call: str = "hf_cache_layout") -> list[LayerLayout]:
    """The layout of every layer of ``cache``: a ``DynamicCache`` after a one-token forward of the model. A layer
    of a kind the store does not know is refused (ValueError naming ``call``), never stored incomplete."""
    out = []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DummyLayer):
            out.append(LayerLayout(i, "shared"))
            continue
        linear = isinstance(layer, LinearAttentionCacheLayerMixin)
        if not (linear or isinstance(layer, DynamicLayer)):
            raise ValueError(f"{call}: layer {i} is a {type(layer).__name__}, whose cache the KV store does "
                             "not know: refused rather than stored incomplete")
        kind = "linear" if linear else "sliding" if isinstance(layer, DynamicSlidingWindowLayer) else "attention"
        lay = LayerLayout(i, kind)
        if isinstance(layer, DynamicLayer):
            _probe_attention(i, layer, lay, call)
        if linear:
            _probe_linear(i, layer, lay)
        out.append(lay)
    return out


def _kind(layer: Any) -> str:
    if isinstance(layer, DummyLayer):
        return "shared"
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        return "linear"
    return "sliding" if isinstance(layer, (DynamicSlidingWindowLayer, StaticSlidingWindowLayer)) else "attention"


def layouts_of(caches: dict, extras: dict, layers: list) -> list[LayerLayout]:
    """The layouts a store's fingerprint names (its per-token ``caches`` and chunk ``extras``) for the cache
    ``layers``: what :func:`save_rows` / :func:`save_snapshot` read from a cache without the model at hand."""
    out = []
    for i, layer in enumerate(layers):
        mine = lambda d: {n: spec for n, spec in d.items() if n.split(".", 1)[0] == str(i)}  # noqa: E731
        snap = mine(extras)
        window = next((spec[0][0] for n, spec in snap.items() if ".window." in n), 0)
        out.append(LayerLayout(i, _kind(layer), tokens=mine(caches), snapshot=snap, window=window))
    return out


def check_cache_layers(layouts: list[LayerLayout], layers: list) -> None:
    """Refuse (ValueError naming ``reload_hf``) a cache whose layers are not of the kinds the model keeps."""
    if len(layers) != len(layouts):
        raise ValueError(f"reload_hf: the cache has {len(layers)} layers, the model {len(layouts)}")
    for lay, layer in zip(layouts, layers):
        if _kind(layer) != lay.kind or (lay.kind == "attention" and not isinstance(layer, (DynamicLayer, StaticLayer))):
            raise ValueError(f"reload_hf: cache layer {lay.index} is a {type(layer).__name__}; the model's layer "
                             f"{lay.index} keeps a {lay.kind} cache")


# ---- save ---------------------------------------------------------------------------------------------------
def save_rows(lay: LayerLayout, layer: Any, T: int) -> dict[str, torch.Tensor]:
    """The per-token chunk tensors of layer ``lay`` for tokens ``0..T-1``: token-major ``[T, H, D]`` on the CPU."""
    rows = {}
    for name in lay.tokens:
        tag = name.split(".", 1)[1]
        if tag == "index_k":
            rows[name] = layer.indexer_keys[0, :T].to("cpu")
        else:
            rows[name] = (layer.keys if tag == "k" else layer.values)[0, :, :T].transpose(0, 1).to("cpu")
    return rows


def _layer_length(layer: Any) -> Optional[int]:
    """The tokens a sliding or linear layer says it has seen (None: it keeps no count of its own)."""
    for attr in ("cumulative_length_int", "cumulative_length_linear", "cumulative_length"):
        n = getattr(layer, attr, None)
        if n is not None:
            return int(n)
    return None


def _window_snapshot(lay: LayerLayout, layer: Any, T: int) -> Optional[dict[str, torch.Tensor]]:
    """The window rows for positions ``[T - r, T)`` (r = min(T, window)), zero rows in front: where the layer
    still holds them all (a static window shorter than ``W`` has dropped some: None)."""
    r = min(T, lay.window)
    out = {}
    for name, (shape, dtype) in lay.snapshot.items():
        if ".window." not in name:
            continue
        buf = layer.keys if name.endswith(".k") else layer.values
        held = min(T, buf.shape[2])  # a static window keeps positions [T - W, T) once full, [0, T) before
        if held < r:
            return None
        snap = torch.zeros(shape, dtype=dtype)
        snap[lay.window - r:] = buf[0, :, held - r:held].transpose(0, 1).to("cpu")
        out[name] = snap
    return out


def save_snapshot(layouts: list[LayerLayout], layers: list, T: int) -> dict[str, torch.Tensor]:
    """The end snapshot of the cache at ``T`` tokens ({} when some layer's cannot be taken: then the saved
    sequence has no end snapshot and reloads nowhere; never a snapshot of another position)."""
    out: dict[str, torch.Tensor] = {}
    for lay, layer in zip(layouts, layers):
        if not lay.snapshot:
            continue
        if _layer_length(layer) != T:
            log.debug("no end snapshot: layer %d has seen %s tokens, the cache %d", lay.index, _layer_length(layer), T)
            return {}
        if lay.window:
            snap = _window_snapshot(lay, layer, T)
            if snap is None:
                log.debug("no end snapshot: layer %d's window no longer holds the last %d rows", lay.index,
                          lay.window)
                return {}
            out.update(snap)
        for name, (shape, _) in lay.snapshot.items():
            if ".state." not in name:
                continue
            kind, j = name.split(".")[2:]
            states = layer.conv_states if kind == "conv" else layer.recurrent_states
            if not layer.has_previous_state[int(j)]:
                return {}
            out[name] = states[int(j)][0, ..., -shape[-1]:].to("cpu").contiguous()
    return out


# ---- reload -------------------------------------------------------------------------------------------------
def _rows(t: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """The first ``n`` rows of a token-major tensor ``[T, H, D]`` as a cache layer holds them ``[1, H, n, D]``."""
    return t[:n].permute(1, 0, 2).unsqueeze(0).to(device)


def _empty(t: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """An uninitialised ``[1, H, n, D]`` buffer of the chunk tensor ``t``'s per-token shape and dtype."""
    return t.new_empty((1, t.size(1), n, *t.shape[2:]), device=device)


def _source(lay: LayerLayout, chunk: dict, tag: str) -> torch.Tensor:
    """A chunk's per-token tensor of layer ``lay`` (an empty one of its shape for a zero-width tensor)."""
    name = f"{lay.index}.{tag}"
    if name in lay.empty:
        shape, dtype = lay.empty[name]
        n = next(t for k, t in chunk.items() if k in lay.tokens).size(0) if lay.tokens else 1
        return torch.empty((n, *shape), dtype=dtype)
    return chunk[name]


def _fill_tokens(lay: LayerLayout, layer: Any, chunks: list, n: int, device: torch.device) -> None:
    """Rows ``0..n-1`` of a full attention layer := the chunks' tensors, each copied once, straight into the
    layer's rows: a static layer's preallocated buffers in place, where the layer keeps them
    (``HostStaticCache``'s KV is host memory: no device copy on the way); a dynamic layer gets new tensors."""
    from .paged import copy_rows

    i, first = lay.index, chunks[0]
    static = hasattr(layer, "max_cache_len")
    kv = f"{i}.k" in lay.tokens or f"{i}.k" in lay.empty
    dst, src = [], []
    if kv:
        if not layer.is_initialized:
            layer.lazy_initialization(*(_rows(_source(lay, first, t), 1, device) for t in ("k", "v")))
        if not static:
            layer.keys, layer.values = (_empty(_source(lay, first, t), n, device) for t in ("k", "v"))
        for tag, buf in (("k", layer.keys), ("v", layer.values)):
            s = 0
            for c in chunks:
                t = _source(lay, c, tag)
                if t.numel():  # a zero-width tensor has no rows to copy
                    dst.append(buf[0, :, s:s + t.size(0)])
                    src.append(t.transpose(0, 1))
                s += t.size(0)
    indexed = f"{i}.index_k" in lay.tokens
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
    if static and kv:
        layer.cumulative_length.fill_(n)
    if static and indexed:
        layer.indexer_cumulative_length.fill_(n)


def _fill_window(lay: LayerLayout, layer: Any, snap: dict, n: int, device: torch.device) -> None:
    """A sliding layer at ``n`` tokens: the window rows where the layer keeps them. A dynamic layer keeps the
    last ``r = min(n, W - 1)`` rows; a static one (a buffer of ``M = min(W, max_cache_len)`` rows, positions
    ``[n - M, n)`` oldest first once full) gets them at its last rows, its first row zero when ``n >= W``: the
    position ``n - W``, which the next update drops before any attention reads it."""
    i = lay.index
    r = min(n, lay.window)
    k, v = (snap[f"{i}.window.{t}"][lay.window - r:] for t in ("k", "v"))
    if not layer.is_initialized:
        layer.lazy_initialization(_rows(k, 1, device), _rows(v, 1, device))
    if isinstance(layer, StaticSlidingWindowLayer):
        M = layer.max_cache_len
        m = min(r, M)
        start = min(n, M) - m
        for buf, t in ((layer.keys, k), (layer.values, v)):
            buf[0, :, :start].zero_()
            buf[0, :, start:start + m].copy_(t[r - m:].transpose(0, 1))
        layer.cumulative_length_int = n
        layer.cumulative_length.fill_(n)  # read only while the window is not full, i.e. when n < M
    else:
        layer.keys, layer.values = _rows(k, r, device).contiguous(), _rows(v, r, device).contiguous()
        layer.cumulative_length = n


def _fill_states(lay: LayerLayout, layer: Any, snap: dict, n: int, device: torch.device) -> None:
    """A linear-attention layer at ``n`` tokens: its conv and recurrent states and its token count."""
    for name in lay.snapshot:
        if ".state." not in name:
            continue
        kind, j = name.split(".")[2:]
        t = snap[name].unsqueeze(0).to(device)
        if kind == "conv":
            if not layer.is_conv_states_initialized[int(j)]:
                layer.lazy_initialization(conv_states=t, state_idx=int(j))
            layer.conv_states[int(j)].copy_(t)
        else:
            if not layer.is_recurrent_states_initialized[int(j)]:
                layer.lazy_initialization(recurrent_states=t, state_idx=int(j))
            layer.recurrent_states[int(j)].copy_(t)
        layer.has_previous_state[int(j)] = True
    layer.cumulative_length_linear.fill_(n)


def fill_layer(lay: LayerLayout, layer: Any, chunks: list, n: int, device: torch.device) -> None:
    """Cache layer ``lay.index`` := the prefix of ``n`` tokens the ``chunks`` hold (the last one's end snapshot
    for a sliding or linear-attention layer)."""
    if lay.tokens or lay.empty:
        _fill_tokens(lay, layer, chunks, n, device)
    if lay.window:
        _fill_window(lay, layer, chunks[-1], n, device)
    if lay.kind == "linear":
        _fill_states(lay, layer, chunks[-1], n, device)

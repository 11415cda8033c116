"""KV chunks out of and into the recipe model's paged caches (``models/glm``), by block table.

A chunk holds, per layer, every cache the model keeps per token: the latent KV (``L.kv``), the rope key
(``L.rope``), and in a layer with an indexer its keys (``L.index_k``) and, in the W8A8 model, their dequant
scales (``L.index_scale``). :class:`PagedStore` is the object the serving loop (``models/glm/serve.py``,
``Server(store=...)``) calls; :class:`RecomputeReference` gives its reference lanes the same prefix
recomputed with the same boundaries (what a reload is compared with, bit for bit).

Placement: every tensor is written where its cache lives. The offload keeps the latent / rope caches in host
memory (pinned beside a CUDA model) and only the indexer keys on the device: a reload writes the host caches
from host memory and moves only the indexer keys to the device (docs/store.md, "Serving loop").
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any, Optional, Sequence

import torch

from .. import _compat
from .keys import Fingerprint

log = logging.getLogger("offload_passes.store.paged")

__all__ = ["paged_caches", "paged_fingerprint", "extract_paged", "insert_paged", "PagedStore", "RecomputeReference",
           "reference_fingerprint"]

_CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_topk", "index_head_dim",
                  "index_n_heads", "rope_theta", "rms_norm_eps", "n_routed_experts", "num_experts_per_tok")


def paged_caches(model: Any) -> dict[str, torch.Tensor]:
    """Every per-token cache of ``model`` (a ``GlmMoeDsaForCausalLM``) by chunk name: ``[blocks, BS, *per-token]``."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        out[f"{i}.kv"], out[f"{i}.rope"] = a.kv_cache, a.k_rope_cache
        if a.indexer is not None:
            out[f"{i}.index_k"] = a.indexer.key_cache
            if getattr(a.indexer, "int8", False):
                out[f"{i}.index_scale"] = a.indexer.key_scale_cache
    return out


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name, dtype, shape and bytes (the weights' identity in a fingerprint)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def paged_fingerprint(model: Any, chunk_tokens: int, weights_id: Optional[str] = None) -> Fingerprint:
    """The fingerprint of the recipe model's KV: architecture and dims, dtypes, quantisation, weights identity
    (``weights_id``, else :func:`weights_digest`), the world layout, the chunk size and the cache layout."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"paged_fingerprint: chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if weights_id is not None and not isinstance(weights_id, str):
        raise TypeError(f"paged_fingerprint: weights_id must be a str or None, got {type(weights_id).__name__}")
    cfg = model.config
    par = model.parallel
    fields = {name: getattr(cfg, name) for name in _CONFIG_FIELDS if hasattr(cfg, name)}
    fields.update(
        architecture="glm_moe_dsa/recipe", dtype=cfg.dtype, indexer_types=list(cfg.indexer_types),
        li_cache_int8=bool(getattr(cfg, "li_cache_int8", False)),
        weights=weights_id if weights_id is not None else weights_digest(model),
        world=[par.rank, par.world_size] if par is not None else [0, 1], chunk_tokens=chunk_tokens,
        caches={n: (list(t.shape[2:]), t.dtype) for n, t in paged_caches(model).items()})
    return Fingerprint.of(fields)


def _slots(model: Any, blocks: Sequence[int], start: int, end: int) -> torch.Tensor:
    BS = model.block_size
    if end > len(blocks) * BS:
        raise ValueError(f"paged KV: tokens [{start}, {end}) need {-(-end // BS)} blocks, got {len(blocks)}")
    pos = torch.arange(start, end, dtype=torch.int64)
    return torch.as_tensor(list(blocks), dtype=torch.int64)[pos // BS] * BS + pos % BS


def extract_paged(model: Any, blocks: Sequence[int], n_tokens: int, chunk_tokens: int) -> list[dict[str, torch.Tensor]]:
    """Tokens ``0..n_tokens-1`` of the request at ``blocks`` as chunks of ``chunk_tokens`` (the last may be
    partial): CPU tensors ``[n_i, *per-token]`` per cache."""
    slots = _slots(model, blocks, 0, n_tokens)
    rows = {n: t.view(-1, *t.shape[2:]).index_select(0, slots.to(t.device)).to("cpu")
            for n, t in paged_caches(model).items()}
    return [{n: r[s:s + chunk_tokens] for n, r in rows.items()} for s in range(0, n_tokens, chunk_tokens)]


def copy_rows(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i: one fused call when everything is on the CPU (a 4K-token reload
    is thousands of chunk-sized copies; their per-call overhead was most of the copy's time)."""
    if dst and all(t.device.type == "cpu" for t in dst) and all(t.device.type == "cpu" for t in src):
        _compat.foreach_copy_(dst, src)
        return
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=True)


def _run_start(slots: torch.Tensor) -> Optional[int]:
    """The first slot when ``slots`` is one contiguous run (a batch-1 model's identity block table), else None."""
    n = slots.numel()
    first = int(slots[0])
    return first if int(slots[-1]) - first == n - 1 and bool((slots.diff() == 1).all()) else None


@torch.no_grad()
def insert_paged(model: Any, blocks: Sequence[int], chunks: Sequence[dict[str, torch.Tensor]]) -> int:
    """Write ``chunks`` (tokens ``0..n-1`` in order) into the request's ``blocks``: each cache on its own device
    (host caches from host memory; only the device-resident ones, the indexer keys, cross to the device).
    Every chunk tensor is copied once, straight into its cache rows (one slice per chunk when the slots are
    one run, else one ``index_copy_`` per cache). Returns n."""
    if not chunks:
        return 0
    caches = paged_caches(model)
    if set(chunks[0]) != set(caches):
        raise ValueError(f"insert_paged: chunk names {sorted(chunks[0])[:4]}… differ from the model's caches "
                         f"{sorted(caches)[:4]}…")
    sizes = [int(next(iter(c.values())).shape[0]) for c in chunks]
    n = sum(sizes)
    slots = _slots(model, blocks, 0, n)
    dev = model.block_table.device
    host = [t for t in caches.values() if t.device != dev]
    if host and dev.type != "cpu":  # kernels launched earlier may still read or write the pinned rows
        from .. import cuda as _cuda

        _cuda.before_host_write(dev)
    first = _run_start(slots)
    dst, src = [], []
    for name, t in caches.items():
        flat = t.view(-1, *t.shape[2:])
        if t.device.type != "cpu" or first is None:  # one transfer / one scatter per cache
            rows = torch.cat([c[name] for c in chunks]) if len(chunks) > 1 else chunks[0][name]
            flat.index_copy_(0, slots.to(t.device), rows.to(t.device, non_blocking=True))
            continue
        dst.extend(flat.narrow(0, first, n).split(sizes))
        src.extend(c[name] for c in chunks)
    copy_rows(dst, src)
    return n


def _present(store: Any, key: str) -> bool:
    for tier in store.tiers:
        try:
            if tier.exists(key):
                return True
        except Exception:  # a tier fault: the store itself counts and reports it
            continue
    return False


class PagedStore:
    """The serving loop's view of a :class:`~offload_passes.store.KVStore` (``Server(store=PagedStore(kv))``):
    ``reload`` a prompt's longest stored prefix into a batch-1 prefill model, ``save`` a request's KV from the
    decode caches by its block table."""

    def __init__(self, store: Any) -> None:
        for name in ("load_keyed", "put", "chunk_keys", "tiers", "chunk_tokens"):
            if not hasattr(store, name):
                raise TypeError(f"PagedStore: store must be a KVStore (lacks {name}), got {type(store).__name__}")
        self.store = store
        self.chunk_tokens = store.chunk_tokens
        self.last_keys: list[str] = []

    @property
    def stats(self) -> Any:
        return self.store.stats

    def reload(self, model: Any, tokens: torch.Tensor, limit: int) -> int:
        """Load the longest stored prefix of ``tokens`` (at most ``limit`` tokens) into row 0 of ``model``
        (batch 1, identity block table); returns its length (0: nothing reloaded, the caches untouched). The
        chunks come uncopied from the store and are copied once, into the caches."""
        n, chunks, keys = self.store.load_keyed(tokens, limit=limit, copy=False)
        self.last_keys = keys  # what was loaded, in order (a partial last chunk has its own key): the reference's
        if n:
            insert_paged(model, model.block_table[0].tolist(), chunks)
        return n

    def save(self, model: Any, blocks: Sequence[int], tokens: torch.Tensor) -> list[str]:
        """Store the KV of ``tokens`` held at ``blocks`` of ``model``'s caches; returns the keys written (chunks
        no tier held before)."""
        keys = self.store.chunk_keys(tokens)
        new = [k for k in keys if not _present(self.store, k)]
        if not new:
            return []
        self.store.put(tokens, extract_paged(model, blocks, len(tokens), self.chunk_tokens))
        return [k for k in new if _present(self.store, k)]


class RecomputeReference:
    """The reference of a reload: per chunk key, the KV the reference lanes computed for it (their own prefill
    with the same boundaries, never read from the store). ``reload(model, tokens, n)`` writes the first ``n``
    tokens of those into the prefill model, as :meth:`PagedStore.reload` wrote the stored ones; ``save`` keeps
    the reference lanes' KV of exactly the chunks the store wrote (the version a later reload reads).

    ``keep``: a second KVStore under the reference's own fingerprint (:func:`reference_fingerprint`), where
    ``save`` also puts those chunks, so that a store that outlives the loop (disk, a shared store) can be
    checked by a later process: a chunk an earlier process stored is compared with the KV that process's
    reference lanes computed for it."""

    def __init__(self, paged: PagedStore, keep: Optional[Any] = None) -> None:
        self.paged = paged
        self.keep = keep
        self.chunks: dict[str, dict[str, torch.Tensor]] = {}

    def _kept(self, tokens: torch.Tensor, n: int, keys: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """The reference chunks of ``keys`` an earlier loop kept (all of the prefix or none)."""
        if self.keep is None:
            return {}
        got, parts, _ = self.keep.load_keyed(tokens, limit=n)
        return dict(zip(keys, parts)) if got == n else {}

    def reload(self, model: Any, tokens: torch.Tensor, n: int) -> None:
        """Call right after ``PagedStore.reload`` of the same ``tokens`` returned ``n``."""
        C = self.paged.chunk_tokens
        keys = self.paged.last_keys[: -(-n // C)]  # what PagedStore.reload loaded for these tokens
        known = self.chunks
        if any(k not in known for k in keys):
            known = {**self._kept(tokens, n, keys), **self.chunks}
        missing = [k for k in keys if k not in known]
        if missing:
            raise KeyError(f"RecomputeReference.reload: {len(missing)} chunk(s) of the reloaded prefix were stored "
                           "by no request of this loop (nor kept by an earlier one): the reference has no "
                           "recomputed KV for them")
        parts = [known[k] for k in keys]
        cut = n - (len(keys) - 1) * C
        parts[-1] = {name: t[:cut] for name, t in parts[-1].items()}
        insert_paged(model, model.block_table[0].tolist(), parts)

    def save(self, model: Any, blocks: Sequence[int], tokens: torch.Tensor, written: Sequence[str]) -> None:
        if not written:
            return
        keys = self.paged.store.chunk_keys(tokens)
        parts = extract_paged(model, blocks, len(tokens), self.paged.chunk_tokens)
        for k, part in zip(keys, parts):
            if k in written:
                self.chunks[k] = part
        if self.keep is not None:
            last = max(i for i, k in enumerate(keys) if k in written)
            self.keep.put(tokens, parts[: last + 1])


def reference_fingerprint(fp: Fingerprint) -> Fingerprint:
    """``fp`` marked as the reference lanes' KV: its chunks never answer a lookup of ``fp``'s store."""
    return Fingerprint.of({**fp.fields, "lane": "reference"})

"""What a stored chunk belongs to (:class:`Fingerprint`) and where it is found (chained chunk keys).

A chunk's key hashes every token before it and its own, salted with the fingerprint's digest: two
requests share a key exactly when they share the whole prefix up to the chunk's end *and* the model
state that produced it (weights, dtypes, quantisation, world layout, cache layout).
"""
from __future__ import annotations

import array
import hashlib
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

__all__ = ["Fingerprint", "chain_keys", "next_key", "check_token_ids"]

_SCALARS = (str, int, float, bool, type(None))
_KEY_DOMAIN = b"offload_passes.kv_chunk.key/1"


def _canonical(value: Any, where: str) -> Any:
    """JSON-ready, order-free form of one fingerprint field (tuples become lists, dtypes their names)."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"Fingerprint.of: field {where} is {value}; a fingerprint holds finite numbers only")
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (tuple, list)):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"Fingerprint.of: field {where} has key {k!r}; keys must be str")
            out[k] = _canonical(v, f"{where}.{k}")
        return out
    raise TypeError(f"Fingerprint.of: field {where} is a {type(value).__name__}; allowed: str, int, float, bool, "
                    "None, tuple, list, a mapping of those, torch.dtype")


def _dtype(name: Any, where: str) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"Fingerprint.of: {where} dtype {name!r} is not a torch dtype name")
    return dt


def _caches(raw: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError("Fingerprint.of: field 'caches' must be a non-empty mapping name -> (per-token shape, dtype)")
    out = {}
    for name, spec in raw.items():
        if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], list)):
            raise ValueError(f"Fingerprint.of: caches.{name} must be (per-token shape, dtype), got {spec!r}")
        shape = spec[0]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            raise ValueError(f"Fingerprint.of: caches.{name} per-token shape {shape!r} must hold positive ints")
        out[name] = (tuple(shape), _dtype(spec[1], f"caches.{name}"))
    return out


@dataclass(frozen=True)
class Fingerprint:
    """Identity of the model state a chunk's KV came from. Build with :meth:`of`."""

    fields: Mapping[str, Any] = field(repr=False)
    digest: str
    caches: Mapping[str, tuple[tuple[int, ...], torch.dtype]] = field(repr=False)

    @classmethod
    def of(cls, fields: Mapping[str, Any]) -> "Fingerprint":
        """Fingerprint of ``fields`` (architecture, dims, dtypes, quantisation, weights identity, world layout,
        chunk size, and ``caches``: {name: (per-token shape, dtype)}). The digest is sha256 of the sorted-key JSON."""
        if not isinstance(fields, Mapping):
            raise TypeError(f"Fingerprint.of: fields must be a mapping, got {type(fields).__name__}")
        if "caches" not in fields:
            raise ValueError("Fingerprint.of: fields must include 'caches' ({name: (per-token shape, dtype)})")
        canon = _canonical(dict(fields), "fields")
        caches = _caches(canon["caches"])
        text = json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return cls(fields=canon, digest=hashlib.sha256(text.encode()).hexdigest(), caches=caches)

    def bytes_per_token(self) -> int:
        """Bytes one token occupies over all caches."""
        return sum(math.prod(shape) * dt.itemsize for shape, dt in self.caches.values())


def check_token_ids(call: str, token_ids: Any, vocab_size: Optional[int]) -> list[int]:
    """``token_ids`` as a list of ints, or a TypeError/ValueError naming ``call``, the argument and the limit."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise TypeError(f"{call}: token_ids must be integers, got a tensor of {token_ids.dtype}")
        if token_ids.dim() != 1:
            raise ValueError(f"{call}: token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        ids = token_ids.tolist()
    elif isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(f"{call}: token_ids must be a sequence of ints or a 1-D integer tensor, "
                        f"got {type(token_ids).__name__}")
    else:
        ids = list(token_ids)
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                if hasattr(t, "__index__") and not isinstance(t, bool):
                    ids[i] = t = int(t.__index__())  # numpy integers
                else:
                    raise TypeError(f"{call}: token_ids[{i}] is {t!r} ({type(t).__name__}); token ids must be ints")
    for i, t in enumerate(ids):
        if t < 0:
            raise ValueError(f"{call}: token_ids[{i}] is {t}; token ids must be >= 0")
        if vocab_size is not None and t >= vocab_size:
            raise ValueError(f"{call}: token_ids[{i}] is {t}; token ids must be < vocab_size {vocab_size}")
        if t >= 1 << 63:
            raise ValueError(f"{call}: token_ids[{i}] is {t}; token ids must be < 2**63")
    return ids


def _le_int64(ids: Sequence[int]) -> bytes:
    arr = array.array("q", ids)
    if sys.byteorder != "little":  # keys are shared between machines: one byte order
        arr.byteswap()
    return arr.tobytes()


def chain_keys(digest: str, token_ids: Sequence[int], chunk_tokens: int) -> list[str]:
    """One hex key per chunk of ``chunk_tokens`` tokens (the partial last chunk too), each hashing the previous
    key and the chunk's tokens; the first is salted with ``digest``."""
    prev = bytes.fromhex(digest)
    keys = []
    for start in range(0, len(token_ids), chunk_tokens):
        prev = next_key(prev, token_ids[start:start + chunk_tokens])
        keys.append(prev.hex())
    return keys


def next_key(prev: bytes, part: Sequence[int]) -> bytes:
    """The raw key of the chunk holding ``part`` after the chunk keyed ``prev`` (the digest's bytes for the first)."""
    h = hashlib.sha256(_KEY_DOMAIN)
    h.update(prev)
    h.update(len(part).to_bytes(8, "little"))
    h.update(_le_int64(part))
    return h.digest()

"""A chunk on the wire: safetensors bytes whose metadata carries the key, the fingerprint digest, the token
count and each tensor's sha256. Decoding never unpickles: safetensors parses a JSON header and raw tensor
bytes only, and anything that fails to parse or verify is a :class:`ChunkError`.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from .keys import Fingerprint

__all__ = ["ChunkError", "HeldChunk", "encode_chunk", "decode_chunk", "FORMAT"]

#: The metadata's format tag: a chunk of another layout is refused, not guessed at.
FORMAT = "offload_passes.kv_chunk/1"


class ChunkError(ValueError):
    """A blob that is not a verified chunk of this fingerprint and key (why in the message)."""


@dataclass(frozen=True)
class HeldChunk:
    """A chunk kept as tensors by a tier in this process (``RamTier``): verified when it entered the process
    (checked tensors from ``KVStore.put``, or a blob from disk or the shared store that passed
    :func:`decode_chunk`), so a hit pays neither deserialisation nor a checksum. The tensors are the tier's
    own and read-only by contract: ``KVStore.load`` clones them unless its caller copies them into a cache."""

    n_tokens: int
    tensors: dict
    nbytes: int

    @classmethod
    def own(cls, n_tokens: int, tensors: Mapping[str, torch.Tensor], copy: bool) -> "HeldChunk":
        """A held chunk of ``tensors`` (cloned when ``copy``: the caller keeps and may change its own)."""
        kept = {k: (t.detach().clone(memory_format=torch.contiguous_format) if copy else t.detach().contiguous())
                for k, t in tensors.items()}
        return cls(n_tokens, kept, sum(t.numel() * t.element_size() for t in kept.values()))


def _tensor_sha(t: torch.Tensor) -> str:
    # Hash the raw bytes in place (bf16 and fp8 included: viewed as uint8, no numeric conversion, no copy).
    return hashlib.sha256(t.contiguous().view(torch.uint8).reshape(-1).numpy() if t.numel() else b"").hexdigest()


def check_chunk_tensors(call: str, fp: Fingerprint, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
    """Refuse tensors that are not exactly ``fp.caches`` for ``n_tokens`` tokens on the CPU (names the call)."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"{call}: a chunk must be a dict name -> tensor, got {type(tensors).__name__}")
    if set(tensors) != set(fp.caches):
        raise ValueError(f"{call}: chunk caches {sorted(tensors)} differ from the fingerprint's {sorted(fp.caches)}")
    for name, (shape, dtype) in fp.caches.items():
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{call}: chunk cache {name!r} is a {type(t).__name__}, not a tensor")
        if t.device.type != "cpu":
            raise ValueError(f"{call}: chunk cache {name!r} is on {t.device}; the store takes CPU tensors")
        if tuple(t.shape) != (n_tokens, *shape) or t.dtype != dtype:
            raise ValueError(f"{call}: chunk cache {name!r} is {tuple(t.shape)} {t.dtype}; expected "
                             f"{(n_tokens, *shape)} {dtype}")


def encode_chunk(fp: Fingerprint, key: str, n_tokens: int, tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The bytes of one chunk (tensors already checked against ``fp``)."""
    meta = {"format": FORMAT, "fingerprint": fp.digest, "key": key, "n_tokens": str(n_tokens)}
    clean = {}
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        meta["sha256." + name] = _tensor_sha(t)
        clean[name] = t
    return _st_save(clean, metadata=meta)


def decode_chunk(fp: Fingerprint, key: str, blob: bytes) -> tuple[int, dict[str, torch.Tensor]]:
    """(n_tokens, tensors) of a blob that verifies against ``fp`` and ``key``; :class:`ChunkError` otherwise."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise ChunkError(f"not bytes: {type(blob).__name__}")
    blob = bytes(blob)
    meta = _metadata(blob)
    if meta.get("format") != FORMAT:
        raise ChunkError(f"format {meta.get('format')!r} is not {FORMAT}")
    if meta.get("fingerprint") != fp.digest:
        raise ChunkError(f"fingerprint {meta.get('fingerprint')!r} is not this store's {fp.digest}")
    if meta.get("key") != key:
        raise ChunkError(f"chunk key {meta.get('key')!r} is not the key it was found under")
    try:
        n_tokens = int(meta.get("n_tokens", ""))
    except ValueError:
        raise ChunkError(f"n_tokens {meta.get('n_tokens')!r} is not an int") from None
    if n_tokens <= 0:
        raise ChunkError(f"n_tokens {n_tokens} is not positive")
    try:
        tensors = _st_load(blob)
    except Exception as exc:  # safetensors raises its own error types for every malformed input
        raise ChunkError(f"safetensors could not read it: {exc}") from None
    try:
        check_chunk_tensors("decode_chunk", fp, tensors, n_tokens)
    except (TypeError, ValueError) as exc:
        raise ChunkError(str(exc)) from None
    for name, t in tensors.items():
        if meta.get("sha256." + name) != _tensor_sha(t):
            raise ChunkError(f"cache {name!r} fails its sha256")
    return n_tokens, tensors


def _metadata(blob: bytes) -> dict[str, str]:
    """The safetensors header's ``__metadata__``, read without trusting its length field."""

    if len(blob) < 8:
        raise ChunkError(f"{len(blob)} bytes: shorter than a safetensors header")
    n = int.from_bytes(blob[:8], "little")
    if n <= 0 or 8 + n > len(blob):
        raise ChunkError(f"header length {n} does not fit the {len(blob)} bytes")
    try:
        header = json.loads(blob[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ChunkError(f"header is not JSON: {exc}") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ChunkError("header carries no metadata")
    return meta

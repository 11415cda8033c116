"""A chunk on the wire: safetensors bytes whose metadata carries the key, the fingerprint digest, the token
count and each tensor's sha256. Decoding never unpickles: safetensors parses a JSON header and raw tensor
bytes only, and anything that fails to parse or verify is a :class:`ChunkError`.

Besides the per-token caches every chunk holds (``fp.caches``), a chunk may hold **chunk extras**: whole tensors
the fingerprint names in its ``chunk_extras`` field ({name: (shape, dtype)}, no token dimension), e.g. the
recurrent state of a model at the chunk's end. They are optional per chunk, checksummed like the rest, and one
of a wrong shape or dtype fails verification.
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

__all__ = ["ChunkError", "HeldChunk", "encode_chunk", "decode_chunk", "chunk_extras", "FORMAT", "EXTRAS_FIELD"]

#: The metadata's format tag: a chunk of another layout is refused, not guessed at.
FORMAT = "offload_passes.kv_chunk/1"
#: The fingerprint field naming the optional whole tensors a chunk may hold besides its per-token caches.
EXTRAS_FIELD = "chunk_extras"


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


def chunk_extras(fp: Fingerprint, call: str = "chunk_extras") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of the chunk extras ``fp`` allows (its ``chunk_extras`` field; {} without one);
    a malformed field is a ValueError naming ``call``."""
    raw = fp.fields.get(EXTRAS_FIELD)
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError(f"{call}: fingerprint field {EXTRAS_FIELD!r} must be a non-empty mapping name -> "
                         f"(shape, dtype), got {raw!r}")
    out = {}
    for name, spec in raw.items():
        ok = isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], list) and all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in spec[0])
        dtype = getattr(torch, spec[1], None) if ok and isinstance(spec[1], str) else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{call}: {EXTRAS_FIELD}.{name} must be (shape of positive ints, torch dtype name), "
                             f"got {spec!r}")
        if name in fp.caches:
            raise ValueError(f"{call}: {EXTRAS_FIELD}.{name} is also a per-token cache; a name is one or the other")
        out[name] = (tuple(spec[0]), dtype)
    return out


def check_chunk_tensors(call: str, fp: Fingerprint, tensors: Mapping[str, torch.Tensor], n_tokens: int) -> None:
    """Refuse tensors that are not exactly ``fp.caches`` for ``n_tokens`` tokens, plus any of the fingerprint's
    chunk extras at their exact shape, on the CPU (names the call)."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"{call}: a chunk must be a dict name -> tensor, got {type(tensors).__name__}")
    extras = chunk_extras(fp, call)
    if not set(fp.caches) <= set(tensors) <= set(fp.caches) | set(extras):
        optional = f" (optional extras: {sorted(extras)})" if extras else ""
        raise ValueError(f"{call}: chunk caches {sorted(tensors)} differ from the fingerprint's "
                         f"{sorted(fp.caches)}{optional}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{call}: chunk cache {name!r} is a {type(t).__name__}, not a tensor")
        if t.device.type != "cpu":
            raise ValueError(f"{call}: chunk cache {name!r} is on {t.device}; the store takes CPU tensors")
        shape, dtype = (((n_tokens, *fp.caches[name][0]), fp.caches[name][1]) if name in fp.caches
                        else extras[name])
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{call}: chunk cache {name!r} is {tuple(t.shape)} {t.dtype}; expected "
                             f"{shape} {dtype}")


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

"""The Tier interface: a named key -> bytes map with a byte budget. The store does the serialising and
verifying; a tier only keeps blobs, so another engine (Redis, a shared mount) is one small class."""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

__all__ = ["Tier", "TierFault", "check_budget"]


class TierFault(RuntimeError):
    """A tier's backing service or medium failed (not a miss): the store counts it and goes on without it."""


@runtime_checkable
class Tier(Protocol):
    """``put`` returns the (key, blob) pairs it evicted to make room, so the store can spill them to the tier
    below, or None when it did not keep the blob (larger than the budget, a full shared store). ``get``
    returns None on a miss. Faults raise :class:`TierFault` or OSError; a miss never raises.

    A tier in this process's memory may set ``keeps_chunks = True``: the store then puts verified
    :class:`~offload_passes.store.chunk.HeldChunk` objects (``nbytes``, ``n_tokens``, ``tensors``) instead of
    bytes and trusts them on a hit (``RamTier``). Every other tier's blobs are verified on every ``get``."""

    name: str

    @property
    def used_bytes(self) -> int: ...

    def put(self, key: str, blob: bytes) -> Optional[list[tuple[str, bytes]]]: ...

    def get(self, key: str) -> Optional[bytes]: ...

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def close(self) -> None: ...


def check_budget(call: str, budget_bytes: object) -> int:
    """``budget_bytes`` as a non-negative int, or an error naming the call, the argument and the limit."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"{call}: budget_bytes must be an int >= 0, got {budget_bytes!r} "
                        f"({type(budget_bytes).__name__})")
    if budget_bytes < 0:
        raise ValueError(f"{call}: budget_bytes must be >= 0, got {budget_bytes}")
    return budget_bytes


def check_name(call: str, name: object) -> str:
    if not isinstance(name, str) or not name or not name.isidentifier():
        raise ValueError(f"{call}: name must be a non-empty identifier string, got {name!r}")
    return name

"""Host-RAM tier: an LRU map of chunks within a byte budget.

It keeps chunks as tensors (``keeps_chunks``): the store hands it verified :class:`~offload_passes.store.chunk.
HeldChunk` objects and reads them back without deserialising or hashing them; it also keeps plain bytes (what
any tier keeps), so it can stand in wherever a Tier does. The budget counts tensor bytes (a blob: its length).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Optional

from .base import check_budget, check_name

__all__ = ["RamTier"]


def _size(item: Any) -> int:
    return len(item) if isinstance(item, (bytes, bytearray, memoryview)) else int(item.nbytes)


class RamTier:
    """Chunks in this process's memory, least recently used evicted first; gone with the process."""

    #: The store gives this tier verified tensors, not bytes (a hit is neither decoded nor checksummed).
    keeps_chunks = True

    def __init__(self, budget_bytes: int, name: str = "ram") -> None:
        self.budget_bytes = check_budget("RamTier", budget_bytes)
        self.name = check_name("RamTier", name)
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def put(self, key: str, item: Any) -> Optional[list[tuple[str, Any]]]:
        """Keep ``item`` (a HeldChunk, or bytes: copied) under ``key``; the (key, item) pairs evicted for room."""
        if isinstance(item, (bytearray, memoryview)):
            item = bytes(item)
        size = _size(item)
        if size > self.budget_bytes:
            return None  # larger than the whole tier: never held
        evicted = []
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._used -= _size(old)
            while self._used + size > self.budget_bytes:
                k, b = self._items.popitem(last=False)
                self._used -= _size(b)
                evicted.append((k, b))
            self._items[key] = item
            self._used += size
        return evicted

    def get(self, key: str) -> Optional[Any]:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def exists(self, key: str) -> bool:
        return key in self._items

    def delete(self, key: str) -> None:
        with self._lock:
            item = self._items.pop(key, None)
            if item is not None:
                self._used -= _size(item)

    def keys(self) -> list[str]:
        """Held keys, least recently used first."""
        return list(self._items)

    def close(self) -> None:
        with self._lock:
            self._items.clear()
            self._used = 0

    def __repr__(self) -> str:
        return f"RamTier(name={self.name!r}, budget_bytes={self.budget_bytes}, used_bytes={self._used})"

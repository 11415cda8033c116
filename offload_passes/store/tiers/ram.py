"""Host-RAM tier: an LRU map of blobs within a byte budget."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

from .base import check_budget, check_name

__all__ = ["RamTier"]


class RamTier:
    """Blobs in this process's memory, least recently used evicted first; gone with the process."""

    def __init__(self, budget_bytes: int, name: str = "ram") -> None:
        self.budget_bytes = check_budget("RamTier", budget_bytes)
        self.name = check_name("RamTier", name)
        self._blobs: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def put(self, key: str, blob: bytes) -> Optional[list[tuple[str, bytes]]]:
        blob = bytes(blob)
        if len(blob) > self.budget_bytes:
            return None  # larger than the whole tier: never held
        evicted = []
        with self._lock:
            old = self._blobs.pop(key, None)
            if old is not None:
                self._used -= len(old)
            while self._used + len(blob) > self.budget_bytes:
                k, b = self._blobs.popitem(last=False)
                self._used -= len(b)
                evicted.append((k, b))
            self._blobs[key] = blob
            self._used += len(blob)
        return evicted

    def get(self, key: str) -> Optional[bytes]:
        with self._lock:
            blob = self._blobs.get(key)
            if blob is not None:
                self._blobs.move_to_end(key)
            return blob

    def exists(self, key: str) -> bool:
        return key in self._blobs

    def delete(self, key: str) -> None:
        with self._lock:
            blob = self._blobs.pop(key, None)
            if blob is not None:
                self._used -= len(blob)

    def keys(self) -> list[str]:
        """Held keys, least recently used first."""
        return list(self._blobs)

    def close(self) -> None:
        with self._lock:
            self._blobs.clear()
            self._used = 0

    def __repr__(self) -> str:
        return f"RamTier(name={self.name!r}, budget_bytes={self.budget_bytes}, used_bytes={self._used})"

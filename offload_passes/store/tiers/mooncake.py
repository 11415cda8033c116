"""Shared tier: a Mooncake Store (mooncake_master + holder processes contributing memory segments)."""
from __future__ import annotations

from typing import Optional

from .base import check_name

__all__ = ["MooncakeTier"]


class MooncakeTier:
    """Chunks in a Mooncake Store shared by processes and machines; an evicted or leased-away object is a miss."""

    def __init__(self, master: str, metadata: str, local_hostname: str = "127.0.0.1",
                 global_segment_size: int = 0, local_buffer_size: int = 64 << 20, protocol: str = "tcp",
                 device_name: str = "", name: str = "mooncake", optional: bool = False,
                 connect_timeout_s: float = 2.0) -> None:
        self.name = check_name("MooncakeTier", name)
        raise NotImplementedError("MooncakeTier: being written")

    @property
    def used_bytes(self) -> int:
        return 0

    def put(self, key: str, blob: bytes) -> list[tuple[str, bytes]]:
        raise NotImplementedError

    def get(self, key: str) -> Optional[bytes]:
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

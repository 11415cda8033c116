"""Shared tier: a Mooncake Store (a ``mooncake_master`` with its HTTP metadata server, and holder processes
that contribute memory segments). Processes and machines on one master share its objects.

Mooncake answers with status codes, not exceptions. Here a key it does not hold, one whose lease ran out or
that is not ready yet is a miss (None / False); a full store or a blob larger than the client's transfer
buffer is "not stored"; an RPC or transfer failure is a :class:`TierFault` (the store counts it and goes on
without the tier for a while). ``mooncake`` is imported only when a MooncakeTier is built.
"""
from __future__ import annotations

import logging
import socket
import urllib.parse
from typing import Any, Optional

from .base import TierFault, check_name

__all__ = ["MooncakeTier", "parse_host_port"]

log = logging.getLogger("offload_passes.store.mooncake")

_OBJECT_NOT_FOUND = -704
_OBJECT_ALREADY_EXISTS = -705
_MISS = {-703, _OBJECT_NOT_FOUND, -707}  # not ready, not found, lease expired
_NOT_STORED = {-200, -600}  # no space in any segment; larger than the transfer buffer (invalid params)


def parse_host_port(call: str, arg: str, value: Any) -> tuple[str, int]:
    """``host:port`` (or an http URL with a port) -> (host, port), or a ValueError naming the argument."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{call}: {arg} must be 'host:port' or an http URL, got {value!r}")
    text = value if "://" in value else "tcp://" + value
    try:
        url = urllib.parse.urlsplit(text)
        host, port = url.hostname, url.port
    except ValueError:
        host = port = None
    if not host or not port:
        raise ValueError(f"{call}: {arg} {value!r} names no host and port")
    return host, port


def _answers(host: str, port: int, timeout_s: float) -> Optional[str]:
    """None when a TCP connection to host:port opens within ``timeout_s``, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def _size_arg(arg: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"MooncakeTier: {arg} must be an int >= 0 (bytes), got {value!r}")
    return value


class MooncakeTier:
    """Chunks in a Mooncake Store shared by processes and machines; an evicted or leased-away object is a miss.

    ``master`` is the master's RPC ``host:port``, ``metadata`` its HTTP metadata URL. Both are probed at
    construction: one that does not answer within ``connect_timeout_s`` is a ValueError naming it, or, with
    ``optional=True``, one warning and a tier that is down (every call a miss). ``global_segment_size`` is the
    memory this client contributes to the shared pool (0: none, holders provide it; Mooncake wants >= 16 MiB
    when non-zero); ``local_buffer_size`` bounds one transfer, so a larger chunk is not stored here."""

    def __init__(self, master: str, metadata: str, local_hostname: str = "127.0.0.1",
                 global_segment_size: int = 0, local_buffer_size: int = 64 << 20, protocol: str = "tcp",
                 device_name: str = "", name: str = "mooncake", optional: bool = False,
                 connect_timeout_s: float = 2.0, key_prefix: str = "offload_passes.kv/") -> None:
        self.name = check_name("MooncakeTier", name)
        mhost, mport = parse_host_port("MooncakeTier", "master", master)
        dhost, dport = parse_host_port("MooncakeTier", "metadata", metadata)
        if not isinstance(metadata, str) or not metadata.startswith("http://"):
            raise ValueError(f"MooncakeTier: metadata must be the master's HTTP metadata URL "
                             f"(http://host:port/metadata), got {metadata!r}")
        self.global_segment_size = _size_arg("global_segment_size", global_segment_size)
        self.local_buffer_size = _size_arg("local_buffer_size", local_buffer_size)
        if self.local_buffer_size == 0:
            raise ValueError("MooncakeTier: local_buffer_size must be > 0 (it bounds one transfer)")
        if not isinstance(connect_timeout_s, (int, float)) or isinstance(connect_timeout_s, bool) \
                or not connect_timeout_s > 0:
            raise ValueError(f"MooncakeTier: connect_timeout_s must be a number > 0, got {connect_timeout_s!r}")
        if not isinstance(key_prefix, str):
            raise TypeError(f"MooncakeTier: key_prefix must be a str, got {type(key_prefix).__name__}")
        self.master, self.metadata, self.optional, self.key_prefix = master, metadata, bool(optional), key_prefix
        self._written: dict[str, int] = {}
        self._client: Any = None
        why = self._probe((("master", master, mhost, mport), ("metadata", metadata, dhost, dport)),
                          float(connect_timeout_s))
        if why is None:
            why = self._setup(local_hostname, global_segment_size, local_buffer_size, protocol, device_name)
        if why is not None:
            if not self.optional:
                raise ValueError(f"MooncakeTier: {why}")
            log.warning("KV store: shared tier %r unavailable (%s); going on without it", self.name, why)

    @staticmethod
    def _probe(targets: tuple, timeout_s: float) -> Optional[str]:
        for arg, value, host, port in targets:
            why = _answers(host, port, timeout_s)
            if why is not None:
                return f"{arg} {value!r} does not answer ({why})"
        return None

    def _setup(self, local_hostname: str, segment: int, buffer: int, protocol: str, device: str) -> Optional[str]:
        try:
            from mooncake.store import MooncakeDistributedStore  # optional dependency: the [store] extra
        except ImportError as exc:
            raise ImportError(f"MooncakeTier needs the Mooncake Store client: pip install "
                              f"'offload_passes[store]' (mooncake-transfer-engine-non-cuda); {exc}") from exc

        client = MooncakeDistributedStore()
        rc = client.setup(local_hostname, self.metadata, segment, buffer, protocol, device, self.master)
        if rc != 0:
            return (f"setup with master {self.master!r} and metadata {self.metadata!r} failed with status {rc} "
                    "(global_segment_size must be 0 or >= 16 MiB)")
        self._client = client
        return None

    # ---- Tier ------------------------------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """False when construction found the shared store unavailable (``optional=True``)."""
        return self._client is not None

    @property
    def used_bytes(self) -> int:
        """Bytes this client stored and has not deleted (the shared store may have evicted some since)."""
        return sum(self._written.values())

    def _fault(self, op: str, key: str, rc: Any) -> TierFault:
        return TierFault(f"mooncake {op} of {key[:12]}… answered status {rc}")

    def put(self, key: str, blob: bytes) -> Optional[list[tuple[str, bytes]]]:
        if self._client is None or len(blob) > self.local_buffer_size:
            return None
        rc = self._client.put(self.key_prefix + key, blob)
        if rc in _NOT_STORED:
            log.debug("mooncake: %s… not stored (status %s: store full or blob too large)", key[:12], rc)
            return None
        if rc not in (0, _OBJECT_ALREADY_EXISTS):
            raise self._fault("put", key, rc)
        self._written[key] = len(blob)
        return []  # the shared store evicts on its own; nothing spills from it

    def get(self, key: str) -> Optional[bytes]:
        if self._client is None:
            return None
        size = self._client.get_size(self.key_prefix + key)
        if size in _MISS:
            return None
        if size < 0:
            raise self._fault("get_size", key, size)
        if size > self.local_buffer_size:
            return None  # cannot come through this client's buffer
        blob = self._client.get(self.key_prefix + key)
        return bytes(blob) if blob else None  # empty: evicted between the two calls

    def exists(self, key: str) -> bool:
        if self._client is None:
            return False
        rc = self._client.is_exist(self.key_prefix + key)
        if rc in (0, 1):
            return rc == 1
        if rc in _MISS:
            return False
        raise self._fault("is_exist", key, rc)

    def exists_many(self, keys: list[str]) -> list[bool]:
        """``exists`` of each key in one round trip."""
        if self._client is None:
            return [False] * len(keys)
        rcs = self._client.batch_is_exist([self.key_prefix + k for k in keys])
        bad = [rc for rc in rcs if rc not in (0, 1) and rc not in _MISS]
        if bad:
            raise self._fault("batch_is_exist", keys[0], bad[0])
        return [rc == 1 for rc in rcs]

    def delete(self, key: str) -> None:
        if self._client is None:
            return
        rc = self._client.remove(self.key_prefix + key, True)  # force: a reader's lease must not keep a bad chunk
        self._written.pop(key, None)
        if rc not in (0, _OBJECT_NOT_FOUND):
            raise self._fault("remove", key, rc)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def __repr__(self) -> str:
        return f"MooncakeTier(name={self.name!r}, master={self.master!r}, metadata={self.metadata!r})"

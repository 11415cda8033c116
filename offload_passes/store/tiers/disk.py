"""Local-disk tier: one file per chunk under a directory, LRU within a byte budget, surviving the process.

A chunk is written to a temporary file (``.tmp.<pid>.<random>.<key>.part``), fsynced, then linked to its final name, so
a reader sees a whole file or none: a writer killed mid-chunk leaves only a temporary file, which readers never
open and the next DiskTier on the directory removes once its writer is gone. When two writers store one key at
once, the first link wins and the second drops its copy: one file, both read it.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import threading
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Union

from .base import check_budget, check_name

__all__ = ["DiskTier"]

log = logging.getLogger("offload_passes.store.disk")

_KEY = re.compile(r"^[0-9a-f]{16,128}$")
_SUFFIX = ".safetensors"
_TMP = re.compile(r"^\.tmp\.(\d+)\.[0-9a-f]+\.")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskTier:
    """Chunk files under ``path`` (created if missing), least recently used deleted beyond ``budget_bytes``.

    The budget is this object's: a directory shared by several processes is bounded by each one's view (files
    another process wrote join the view when this one reads or finds them)."""

    def __init__(self, path: Union[str, os.PathLike], budget_bytes: int, name: str = "disk",
                 fsync: bool = True) -> None:
        self.budget_bytes = check_budget("DiskTier", budget_bytes)
        self.name = check_name("DiskTier", name)
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"DiskTier: path must be a str or os.PathLike, got {type(path).__name__}")
        root = Path(path)
        if root.exists() and not root.is_dir():
            raise ValueError(f"DiskTier: path {str(root)!r} exists and is not a directory")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"DiskTier: path {str(root)!r} cannot be created ({exc.strerror or exc})") from None
        if not os.access(root, os.W_OK | os.X_OK):
            raise ValueError(f"DiskTier: path {str(root)!r} is not a writable directory")
        self.path = root
        self.fsync = bool(fsync)
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        self._used = 0
        self._lock = threading.Lock()
        self._scan()
        self._trim(0)

    # ---- layout -----------------------------------------------------------------------------------------
    def _file(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"DiskTier: key {key!r} is not a lowercase hex digest")
        return self.path / key[:2] / (key + _SUFFIX)

    def _scan(self) -> None:
        """Index the chunk files already there (oldest first) and remove temporary files of dead writers."""
        found = []
        for sub in self.path.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                m = _TMP.match(f.name)
                if m:
                    if not _pid_alive(int(m.group(1))):
                        f.unlink(missing_ok=True)  # a writer killed mid-chunk
                    continue
                if f.name.endswith(_SUFFIX) and _KEY.match(f.name[: -len(_SUFFIX)]):
                    st = f.stat()
                    found.append((st.st_mtime, f.name[: -len(_SUFFIX)], st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._used += size

    def _trim(self, room: int) -> list[str]:
        """Delete least recently used files until ``room`` more bytes fit; the keys deleted."""
        gone = []
        while self._index and self._used + room > self.budget_bytes:
            key, size = self._index.popitem(last=False)
            self._used -= size
            try:
                self._file(key).unlink()
            except FileNotFoundError:
                pass
            gone.append(key)
        return gone

    def _adopt(self, key: str, size: int) -> None:
        """Count a file another writer made (it is the most recently used now)."""
        if key in self._index:
            self._index.move_to_end(key)
            return
        self._index[key] = size
        self._used += size
        if self._used > self.budget_bytes:
            self._index.move_to_end(key, last=False)  # beyond budget: it goes first
            self._trim(0)

    # ---- Tier ------------------------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    def put(self, key: str, blob: bytes) -> Optional[list[tuple[str, bytes]]]:
        final = self._file(key)
        if len(blob) > self.budget_bytes:
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return []
            evicted = []
            for k in list(self._index):
                if self._used + len(blob) <= self.budget_bytes:
                    break
                evicted.append((k, self._read(k)))
                self._trim_one(k)
            self._write(final, blob)
            self._index[key] = len(blob)
            self._used += len(blob)
            return [(k, b) for k, b in evicted if b is not None]

    def _trim_one(self, key: str) -> None:
        self._used -= self._index.pop(key)
        self._file(key).unlink(missing_ok=True)

    def _read(self, key: str) -> Optional[bytes]:
        try:
            return self._file(key).read_bytes()
        except FileNotFoundError:
            return None

    def _write(self, final: Path, blob: bytes) -> None:
        final.parent.mkdir(exist_ok=True)
        tmp = final.parent / f".tmp.{os.getpid()}.{uuid.uuid4().hex}.{final.stem}.part"
        try:
            with open(tmp, "xb") as f:
                f.write(blob)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            try:
                os.link(tmp, final)  # first writer wins; never replaces a file a reader may hold
            except FileExistsError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV):
                    raise
                os.replace(tmp, final)  # a filesystem without hard links
            if self.fsync:
                self._fsync_dir(final.parent)
        finally:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
            except OSError:
                log.debug("could not remove %s", tmp)

    @staticmethod
    def _fsync_dir(d: Path) -> None:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, key: str) -> Optional[bytes]:
        path = self._file(key)
        with self._lock:
            try:
                blob = path.read_bytes()
            except FileNotFoundError:
                if key in self._index:
                    self._used -= self._index.pop(key)
                return None
            self._adopt(key, len(blob))
            return blob

    def exists(self, key: str) -> bool:
        path = self._file(key)
        with self._lock:
            if key in self._index:
                return True
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                return False
            self._adopt(key, size)
            return key in self._index

    def delete(self, key: str) -> None:
        path = self._file(key)
        with self._lock:
            if key in self._index:
                self._used -= self._index.pop(key)
            path.unlink(missing_ok=True)

    def keys(self) -> list[str]:
        """Indexed keys, least recently used first."""
        return list(self._index)

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return (f"DiskTier(path={str(self.path)!r}, name={self.name!r}, budget_bytes={self.budget_bytes}, "
                f"used_bytes={self._used})")

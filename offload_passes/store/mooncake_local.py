"""A Mooncake Store on this machine, for tests, benchmarks and trying the shared tier: one ``mooncake_master``
(with its HTTP metadata server) and one holder process that contributes a memory segment, on 127.0.0.1 at
free ports, both stopped by PID (docs/store.md, "Starting a shared store").

    with LocalMooncake(workdir) as mc:
        tier = MooncakeTier(mc.master_addr, mc.metadata_url)

Not for production: a real deployment runs its master and holders as services.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Union

__all__ = ["LocalMooncake", "free_port", "master_binary"]

log = logging.getLogger("offload_passes.store.mooncake_local")

#: The holder: a client that contributes ``segment`` bytes to the pool and stays until killed.
_HOLDER = r"""
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", sys.argv[1], int(sys.argv[3]), 16 << 20, "tcp", "", sys.argv[2])
print("ready" if rc == 0 else f"failed {rc}", flush=True)
if rc != 0:
    sys.exit(1)
while True:
    time.sleep(3600)
"""


def master_binary() -> Optional[str]:
    """The ``mooncake_master`` on PATH (installed by the ``[store]`` extra), or None."""
    return shutil.which("mooncake_master")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not open port {port} in {timeout} s")


def _stop(proc: Optional[subprocess.Popen]) -> None:
    if proc is not None and proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


class LocalMooncake:
    """One master (RPC + HTTP metadata + metrics ports) and one holder process with a ``segment``-byte segment;
    ``lease_ms`` is the master's KV lease (how long a read object is pinned). Logs go to ``workdir``.
    ``start()`` starts both (or raises, leaving nothing running); ``stop()`` kills both by PID."""

    def __init__(self, workdir: Union[str, os.PathLike], segment: int = 64 << 20, lease_ms: int = 200) -> None:
        if not isinstance(workdir, (str, os.PathLike)):
            raise TypeError(f"LocalMooncake: workdir must be a path, got {type(workdir).__name__}")
        for arg, value, low in (("segment", segment, 16 << 20), ("lease_ms", lease_ms, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"LocalMooncake: {arg} must be an int >= {low}, got {value!r}")
        self.workdir, self.segment, self.lease_ms = Path(workdir), segment, lease_ms
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.master: Optional[subprocess.Popen] = None
        self.holder: Optional[subprocess.Popen] = None

    @property
    def master_addr(self) -> str:
        return f"127.0.0.1:{self.rpc}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http}/metadata"

    def start(self) -> "LocalMooncake":
        try:
            self.start_master()
            self.start_holder()
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self) -> None:
        binary = master_binary()
        if binary is None:
            raise RuntimeError("LocalMooncake: mooncake_master is not on PATH: pip install "
                               "'offload_passes[store]' (mooncake-transfer-engine-non-cuda)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "master.log", "ab") as out:
            self.master = subprocess.Popen(
                [binary, f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
                 f"--http_metadata_server_port={self.http}", "--http_metadata_server_host=127.0.0.1",
                 f"--metrics_port={self.metrics}", "--metrics_host=127.0.0.1",
                 f"--default_kv_lease_ttl={self.lease_ms}"], stdout=out, stderr=subprocess.STDOUT)
        _wait_port(self.rpc, self.master, "mooncake_master")
        _wait_port(self.http, self.master, "mooncake_master's metadata server")
        log.info("mooncake_master pid %d at %s", self.master.pid, self.master_addr)

    def start_holder(self) -> None:
        env = dict(os.environ, GLOG_minloglevel="3")
        with open(self.workdir / "holder.log", "ab") as err:
            self.holder = subprocess.Popen([sys.executable, "-c", _HOLDER, self.metadata_url, self.master_addr,
                                            str(self.segment)], stdout=subprocess.PIPE, stderr=err, env=env)
        line = self.holder.stdout.readline().decode().strip()
        if line != "ready":
            _stop(self.holder)
            raise RuntimeError(f"LocalMooncake: the holder did not start: {line!r} "
                               f"(see {self.workdir / 'holder.log'})")

    def kill_master(self) -> None:
        """Kill the master alone (a shared store going away under its clients)."""
        _stop(self.master)
        self.master = None

    def stop(self) -> None:
        _stop(self.holder)
        _stop(self.master)
        if self.holder is not None and self.holder.stdout is not None:
            self.holder.stdout.close()

    def __enter__(self) -> "LocalMooncake":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

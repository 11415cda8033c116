"""Fixtures of the KV store tests: a real ``mooncake_master`` (with its HTTP metadata server) and a holder
process that contributes a memory segment, on 127.0.0.1 at free ports, both stopped by PID afterwards."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

MASTER = shutil.which("mooncake_master")

HOLDER = r"""
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


def free_port() -> int:
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


class MooncakeCluster:
    """One master (RPC + HTTP metadata + metrics ports) and one holder process with a ``segment``-byte segment."""

    def __init__(self, workdir: Path, segment: int = 64 << 20, lease_ms: int = 200) -> None:
        self.workdir, self.segment, self.lease_ms = workdir, segment, lease_ms
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.master: Optional[subprocess.Popen] = None
        self.holder: Optional[subprocess.Popen] = None

    @property
    def master_addr(self) -> str:
        return f"127.0.0.1:{self.rpc}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http}/metadata"

    def start_master(self) -> None:
        log = open(self.workdir / "master.log", "ab")
        self.master = subprocess.Popen(
            [MASTER, f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
             f"--http_metadata_server_port={self.http}", "--http_metadata_server_host=127.0.0.1",
             f"--metrics_port={self.metrics}", "--metrics_host=127.0.0.1", f"--default_kv_lease_ttl={self.lease_ms}"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        _wait_port(self.rpc, self.master, "mooncake_master")
        _wait_port(self.http, self.master, "mooncake_master's metadata server")

    def start_holder(self) -> None:
        env = dict(os.environ, GLOG_minloglevel="3")
        self.holder = subprocess.Popen([sys.executable, "-c", HOLDER, self.metadata_url, self.master_addr,
                                        str(self.segment)], stdout=subprocess.PIPE,
                                       stderr=open(self.workdir / "holder.log", "ab"), env=env)
        line = self.holder.stdout.readline().decode().strip()
        if line != "ready":
            _stop(self.holder)
            raise RuntimeError(f"mooncake holder did not start: {line!r} (see {self.workdir / 'holder.log'})")

    def kill_master(self) -> None:
        _stop(self.master)
        self.master = None

    def stop(self) -> None:
        _stop(self.holder)
        _stop(self.master)


def _cluster(workdir: Path, **kw) -> MooncakeCluster:
    if MASTER is None:
        pytest.fail("mooncake_master is not installed: pip install mooncake-transfer-engine-non-cuda "
                    "(scripts/setup.sh installs it)")
    c = MooncakeCluster(workdir, **kw)
    try:
        c.start_master()
        c.start_holder()
    except BaseException:
        c.stop()
        raise
    return c


@pytest.fixture(scope="session")
def mooncake(tmp_path_factory) -> MooncakeCluster:
    """A master and holder shared by the tests that only read and write."""
    c = _cluster(tmp_path_factory.mktemp("mooncake"))
    yield c
    c.stop()


@pytest.fixture
def mooncake_own(tmp_path) -> MooncakeCluster:
    """A master and holder of this test alone (for killing, restarting or filling them)."""
    c = _cluster(tmp_path, segment=16 << 20)
    yield c
    c.stop()

"""Fixtures of the KV store tests: a real ``mooncake_master`` (with its HTTP metadata server) and a holder
process that contributes a memory segment, on 127.0.0.1 at free ports, both stopped by PID afterwards
(``offload_passes.store.mooncake_local.LocalMooncake``)."""
from __future__ import annotations

from pathlib import Path

import pytest

from offload_passes.store.mooncake_local import LocalMooncake, master_binary


def _cluster(workdir: Path, **kw) -> LocalMooncake:
    if master_binary() is None:
        pytest.fail("mooncake_master is not installed: pip install mooncake-transfer-engine-non-cuda "
                    "(scripts/setup.sh installs it)")
    return LocalMooncake(workdir, **kw).start()


@pytest.fixture(scope="session")
def mooncake(tmp_path_factory) -> LocalMooncake:
    """A master and holder shared by the tests that only read and write."""
    c = _cluster(tmp_path_factory.mktemp("mooncake"))
    yield c
    c.stop()


@pytest.fixture
def mooncake_own(tmp_path) -> LocalMooncake:
    """A master and holder of this test alone (for killing, restarting or filling them)."""
    c = _cluster(tmp_path, segment=16 << 20)
    yield c
    c.stop()

"""Fixtures for the tools tests: dump directories written by the real backend (once per session) and
by the stand-alone fake writer (78 layers / malformed cases)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fake_dump import glm52_pattern, write_fake_dump
from synth_model import TinyDSA


def _compile_once(model: TinyDSA, dump_dir: Path) -> dict:
    from offload_passes import make_offload_backend

    backend = make_offload_backend(dump_dir=str(dump_dir), pool_size=256)
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(*model.example_inputs())
    return json.loads((dump_dir / "report.json").read_text())


@pytest.fixture(scope="session")
def real_dump(tmp_path_factory) -> tuple[Path, dict]:
    """Groups {0..3}, {4,5}, {6} (shared, shared, singleton), S = 2, rewritten by the backend."""
    d = tmp_path_factory.mktemp("dump_ok")
    doc = _compile_once(TinyDSA(pattern="FSSSFSF", S=2), d)
    return d, doc


@pytest.fixture(scope="session")
def refused_dump(tmp_path_factory) -> tuple[Path, dict]:
    """K = 48 violates dsa_plan's K % 64 == 0: the backend compiles the graph unmodified and says why."""
    d = tmp_path_factory.mktemp("dump_refused")
    doc = _compile_once(TinyDSA(pattern="FSSF", K=48), d)
    return d, doc


@pytest.fixture(scope="session")
def fake78(tmp_path_factory) -> Path:
    """The GLM-5.2 78-layer IndexShare layout (21 groups) in the dump format."""
    return write_fake_dump(tmp_path_factory.mktemp("fake78"), glm52_pattern(78), B=2, S=4, K=2048, PS=8192)

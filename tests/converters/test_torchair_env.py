"""tools/torchair_env.py: obtaining TorchAir / npugraph_ex from the torch-npu wheel without installing it.

Uses a small hand-made wheel (zip) in a temporary folder; nothing is downloaded here.
"""
from __future__ import annotations

import json
import subprocess
import zipfile

import pytest

from offload_passes.tools import torchair_env as te


def _wheel(tmp_path, version="9.9.0", packages=("torchair", "npugraph_ex")):
    path = tmp_path / f"torch_npu-{version}-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p in packages:
            z.writestr(f"torch_npu/dynamo/{p}/__init__.py", f"NAME = {p!r}\n")
            z.writestr(f"torch_npu/dynamo/{p}/sub/mod.py", "X = 1\n")
        z.writestr("torch_npu/dynamo/torchair/core/_torchair.so", b"\x7fELF")
        z.writestr("torch_npu/dynamo/trace_rule.py", "")
        z.writestr("torch_npu/__init__.py", "")
    return path


def test_version_follows_torch_and_can_be_overridden(monkeypatch):
    import torch

    monkeypatch.delenv(te.ENV_VERSION, raising=False)
    assert te.default_torch_npu_version() == ".".join(torch.__version__.split("+")[0].split(".")[:2]) + ".0"
    monkeypatch.setenv(te.ENV_VERSION, "2.14.0")
    assert te.default_torch_npu_version() == "2.14.0"


def test_cache_root_from_env_or_home(monkeypatch, tmp_path):
    monkeypatch.setenv(te.ENV_DIR, str(tmp_path / "x"))
    assert te.cache_root() == tmp_path / "x"
    monkeypatch.delenv(te.ENV_DIR)
    assert te.cache_root().parts[-3:] == (".cache", "offload_passes", "torchair")


def test_extracts_only_the_two_packages_without_compiled_modules(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    whl = _wheel(tmp_path)
    assert te.site_dir("9.9.0", cache) is None
    site = te.ensure("9.9.0", cache, wheel=whl)
    assert site == te.site_dir("9.9.0", cache) == cache / "torch_npu-9.9.0" / "site"
    files = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())
    assert files == [".offload_passes_torchair.json", "npugraph_ex/__init__.py", "npugraph_ex/sub/mod.py",
                     "torchair/__init__.py", "torchair/sub/mod.py"]
    marker = json.loads((site / ".offload_passes_torchair.json").read_text())
    assert marker["version"] == "9.9.0" and marker["files"] == 4 and marker["wheel"] == whl.name
    # idempotent: prepared folder is reused, nothing is extracted or downloaded again
    monkeypatch.setattr(te, "_extract", lambda *a: pytest.fail("extracted twice"))
    monkeypatch.setattr(te, "_download", lambda *a: pytest.fail("downloaded twice"))
    assert te.ensure("9.9.0", cache) == site


def test_wheel_without_the_packages_is_an_error(tmp_path):
    whl = _wheel(tmp_path, packages=("torchair",))
    with pytest.raises(te.TorchAirEnvError, match="has no torch_npu/dynamo/npugraph_ex/__init__.py"):
        te.ensure("9.9.0", tmp_path / "cache", wheel=whl)
    assert te.site_dir("9.9.0", tmp_path / "cache") is None  # nothing half-written is taken for ready


def test_download_failure_explains_the_alternatives(tmp_path, monkeypatch):
    def fail(cmd, **kw):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for torch-npu==9.9.0")

    monkeypatch.setattr(te.subprocess, "run", fail)
    with pytest.raises(te.TorchAirEnvError) as e:
        te.ensure("9.9.0", tmp_path / "cache")
    msg = str(e.value)
    assert "cannot download torch-npu==9.9.0" in msg and "No matching distribution" in msg
    assert "--wheel" in msg and te.ENV_DIR in msg


def test_cli_check_and_prepare(tmp_path, capsys):
    cache = str(tmp_path / "cache")
    assert te.main(["--version", "9.9.0", "--dir", cache, "--check"]) == 1
    assert "not prepared" in capsys.readouterr().out
    assert te.main(["--ensure", "--version", "9.9.0", "--dir", cache, "--wheel", str(_wheel(tmp_path))]) == 0
    assert capsys.readouterr().out.strip().endswith("torch_npu-9.9.0/site")
    assert te.main(["--version", "9.9.0", "--dir", cache, "--check"]) == 0


def test_activate_puts_the_folder_first(tmp_path, monkeypatch):
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    te.activate(tmp_path)
    te.activate(tmp_path)
    assert sys.path[0] == str(tmp_path.resolve()) and sys.path.count(str(tmp_path.resolve())) == 1

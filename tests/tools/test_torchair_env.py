"""tools/torchair_env.py: obtaining TorchAir / npugraph_ex from the torch-npu wheel without installing it.

Uses a small hand-made wheel (zip) in a temporary folder; nothing is downloaded here.
"""
from __future__ import annotations

import json
import subprocess
import zipfile

import pytest

from offload_passes.tools import torchair_env as te


def _wheel(tmp_path, version="9.9.0", packages=("torchair", "npugraph_ex"), requires_torch=None):
    path = tmp_path / f"torch_npu-{version}-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        if requires_torch is not None:  # the form torch_npu's wheels use
            z.writestr(f"torch_npu-{version}.dist-info/METADATA",
                       f"Metadata-Version: 2.1\nName: torch_npu\nVersion: {version}\n"
                       f"Requires-Dist: numpy\nRequires-Dist: torch=={requires_torch}\n")
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
    assert te.default_torch_npu_version() == te.matching_torch_npu_version(torch.__version__)
    monkeypatch.setenv(te.ENV_VERSION, "2.14.0")
    assert te.default_torch_npu_version() == "2.14.0"


@pytest.mark.parametrize("torch_version, npu", [
    ("2.8.0", "2.8.0.post5"),  # plain torch-npu 2.8.0 has no npugraph_ex: the checked post release
    ("2.8.0+cu128", "2.8.0.post5"),
    ("2.10.0", "2.10.0.post4"),  # vllm-ascend's pin
    ("2.10.0+cpu", "2.10.0.post4"),
    ("2.13.0+cpu", "2.13.0"),
    ("2.14.0", "2.14.0"),
    ("2.14.1+cu128", "2.14.0"),  # newest torch-npu; its wheel requires torch==2.14.0.*, major.minor matches
    ("2.11.0+cu130", "2.11.0.post3"),  # the lent GPU machine's torch: its newest post release
    ("2.12.1", "2.12.1"),  # unchecked versions: the plain release of that torch
    ("2.16.0a0+git1234", "2.16.0"),
    ("2.15.0", None),  # no torch-npu release exists
    ("2.15.0+cu132", None),
])
def test_matching_torch_npu_release(torch_version, npu):
    assert te.matching_torch_npu_version(torch_version) == npu


def test_a_torch_without_torch_npu_is_named_and_nothing_is_prepared(tmp_path, monkeypatch, capsys):
    assert te.no_torch_npu_reason("2.14.1") is None
    why = te.no_torch_npu_reason("2.15.0+cu132")
    assert why == ("no torch-npu release exists for torch 2.15 (the newest, 2.14.0, requires torch 2.14): "
                   "TorchAir / npugraph_ex, hence the ge_graph and npugraph_ex modes, cannot run with it "
                   "(tools/torchair_env.py TORCH_NPU_FOR_TORCH)")
    monkeypatch.delenv(te.ENV_VERSION, raising=False)
    monkeypatch.setattr(te, "matching_torch_npu_version", lambda torch_version=None: None)
    assert te.default_torch_npu_version() is None
    assert te.site_dir(cache=tmp_path) is None
    with pytest.raises(te.TorchAirEnvError, match="^no torch-npu release exists for torch "):
        te.ensure(cache=tmp_path)
    assert te.main(["--ensure", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no torch-npu release exists for torch ") and err.count("\n") == 1
    assert not any(tmp_path.iterdir())  # nothing downloaded or created
    monkeypatch.setenv(te.ENV_VERSION, "2.14.0")  # an explicit choice still wins
    assert te.default_torch_npu_version() == "2.14.0"


def test_each_torch_version_has_its_own_cache_folder(tmp_path, monkeypatch):
    import torch

    cache = tmp_path / "cache"
    mine = te._major_minor(torch.__version__)
    other = "2.8" if mine != "2.8" else "2.13"
    site = te.ensure("9.9.0", cache, wheel=_wheel(tmp_path, "9.9.0", requires_torch=f"{mine}.0+cpu"))
    assert json.loads((site / ".offload_passes_torchair.json").read_text())["torch"] == f"{mine}.0+cpu"
    assert site.parent.name == "torch_npu-9.9.0" and te.site_dir("9.9.1", cache) is None
    # a wheel built for another torch is refused with what to do instead, and nothing is extracted
    with pytest.raises(te.TorchAirEnvError) as e:
        te.ensure("9.9.1", cache, wheel=_wheel(tmp_path, "9.9.1", requires_torch=f"{other}.0.*"))
    mine = te.matching_torch_npu_version()
    instead = (f"use torch-npu {mine} (the default for this torch) or another torch" if mine is not None
               else te.no_torch_npu_reason())  # torch 2.15: no torch-npu release to point to
    assert str(e.value) == (f"torch_npu-9.9.1-cp311-cp311-manylinux_2_28_x86_64.whl is built for torch {other}.0.*, "
                            f"the installed torch is {torch.__version__}; {instead}")
    assert not (cache / "torch_npu-9.9.1" / "site").exists()


def test_copy_for_another_torch_is_not_used(tmp_path):
    import torch

    site = te.ensure("9.9.0", tmp_path / "cache", wheel=_wheel(tmp_path, requires_torch=torch.__version__))
    assert te.torch_mismatch(site) is None
    why = te.torch_mismatch(site, torch_version="1.0.0")
    assert why == (f"torchair/npugraph_ex from torch_npu-9.9.0-cp311-cp311-manylinux_2_28_x86_64.whl "
                   f"were built for torch {torch.__version__}, "
                   f"the installed torch is 1.0.0")
    marker = site / ".offload_passes_torchair.json"
    info = json.loads(marker.read_text())
    marker.write_text(json.dumps(dict(info, torch="1.0.0")))  # as if prepared under another torch
    assert te.site_dir("9.9.0", tmp_path / "cache") is None


def test_wheel_torch_requirement(tmp_path):
    assert te.wheel_torch_requirement(_wheel(tmp_path, "1.0.0", requires_torch="2.8.0+cpu")) == "2.8.0+cpu"
    assert te.wheel_torch_requirement(_wheel(tmp_path, "1.0.1")) is None


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

"""The torch requirement in the package metadata: a binary wheel pins the torch it was compiled against, an
editable install or an sdist keeps the tested range (offload_passes/_extensions.py, docs/build.md §3).

``scripts/check_wheel.sh`` builds a real wheel and installs it into a fresh venv (minutes of C++ build);
here ``setup.py`` runs with ``setuptools.setup`` replaced by a recorder, so the rule is checked on what
``setup()`` receives: the source metadata and the wheel command that pins it.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import setuptools
import torch
from packaging.requirements import Requirement

from offload_passes import _extensions

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.14.1", "2.8.0+cu128"])
def test_binary_wheel_pins_the_exact_build(version):
    req = Requirement(_extensions.torch_requirement(version, binary_wheel=True))
    assert str(req) == f"torch=={version}"
    assert req.specifier.contains(version)
    # the local part is kept: a CUDA build of the same public version loads other libraries (torch_tag)
    public = version.split("+")[0]
    assert req.specifier.contains(public) == (public == version)
    assert not req.specifier.contains("2.14.2")


def test_source_install_keeps_the_range():
    req = Requirement(_extensions.torch_requirement("2.13.0+cpu", binary_wheel=False))
    assert req.name == "torch"
    for ok in ("2.8.0", "2.10.0", "2.11.0", "2.13.0", "2.14.1", "2.15.0"):
        assert req.specifier.contains(ok), ok
    for bad in ("2.7.1", "2.16.0"):
        assert not req.specifier.contains(bad), bad


METADATA = """Metadata-Version: 2.4
Name: offload_passes
Version: 0.1.0
Requires-Dist: torch<2.16,>=2.8
Requires-Dist: sympy
Provides-Extra: test
Requires-Dist: pytest; extra == "test"
Requires-Dist: torchvision; extra == "viz"
"""


def test_metadata_pin_replaces_only_the_torch_requirement():
    out = _extensions.pin_torch_in_metadata(METADATA, "2.13.0+cpu")
    assert out == METADATA.replace("Requires-Dist: torch<2.16,>=2.8", "Requires-Dist: torch==2.13.0+cpu")
    with pytest.raises(ValueError, match="expected one 'Requires-Dist: torch' line, found 0"):
        _extensions.pin_torch_in_metadata("Name: x\nRequires-Dist: torchvision\n", "2.13.0")


def _setup_kwargs(monkeypatch) -> dict:
    seen: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    monkeypatch.setattr(sys, "argv", ["setup.py", "egg_info"])
    runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    return seen


def test_source_metadata_keeps_the_range(monkeypatch):
    reqs = [r for r in _setup_kwargs(monkeypatch)["install_requires"] if Requirement(r).name == "torch"]
    assert reqs == [_extensions.torch_requirement(torch.__version__, binary_wheel=False)]


@pytest.mark.parametrize("ran_as_bdist_wheel", [True, False])
def test_setup_py_wheel_command_pins_its_metadata(monkeypatch, tmp_path, ran_as_bdist_wheel):
    # setuptools' own bdist_wheel.run builds and zips; here only the hook that writes the dist-info runs.
    # pip install -e . calls write_wheelfile of the same class without run (editable_wheel): no pin.
    from setuptools.dist import Distribution

    cls = _setup_kwargs(monkeypatch)["cmdclass"]["bdist_wheel"]
    base = cls.__mro__[1]
    monkeypatch.setattr(base, "run", lambda self: self.write_wheelfile(str(tmp_path)))
    monkeypatch.setattr(base, "write_wheelfile", lambda self, *a, **k: None)
    (tmp_path / "METADATA").write_text(METADATA)
    cmd = cls(Distribution({"name": "offload_passes", "version": "0.1.0"}))
    if ran_as_bdist_wheel:
        cmd.run()
    else:
        cmd.write_wheelfile(str(tmp_path))
    torch_lines = [line for line in (tmp_path / "METADATA").read_text().splitlines()
                   if line.startswith("Requires-Dist: torch") and "extra" not in line]
    want = "==" + torch.__version__ if ran_as_bdist_wheel else "<2.16,>=2.8"
    assert torch_lines == ["Requires-Dist: torch" + want]


def test_every_console_script_names_a_function_that_exists(monkeypatch):
    """Each ``console_scripts`` entry imports and names a callable; ``offload-demo`` lives in the applications
    package (``offload_passes.apps``, which the wheel ships)."""
    import importlib

    kw = _setup_kwargs(monkeypatch)
    scripts = dict(entry.replace(" ", "").split("=") for entry in kw["entry_points"]["console_scripts"])
    assert scripts["offload-demo"] == "offload_passes.apps.demo:main"
    assert "offload_passes.apps" in kw["packages"]
    for name, target in scripts.items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), name

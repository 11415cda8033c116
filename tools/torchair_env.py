"""Test environment for the GE-converter / npugraph_ex tests: TorchAir and npugraph_ex as plain Python.

The ``torch-npu`` wheel bundles TorchAir and npugraph_ex as pure-Python packages under
``torch_npu/dynamo/`` (plus four CANN-linked ``.so`` files in ``torchair/core``). The converter and
reinplace tests run against exactly that Python code, with only the CANN-linked modules replaced by
labelled test stand-ins (``tests/testdoubles/``). This module obtains that code **without
installing torch_npu**:

1. ``pip download --no-deps torch-npu==<version>`` into ``<cache>/wheels`` (nothing is installed;
   ``import torch`` keeps working without ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``). ``<version>`` is the
   torch-npu release matching the running torch (:data:`TORCH_NPU_FOR_TORCH`), so each torch version
   gets its own TorchAir and its own cache folder;
2. extract only ``torch_npu/dynamo/torchair/**`` and ``torch_npu/dynamo/npugraph_ex/**`` (no ``.so``)
   into ``<cache>/torch_npu-<version>/site/`` as the top-level packages ``torchair`` and
   ``npugraph_ex``;
3. :func:`site_dir` / :func:`activate` put that folder on ``sys.path``.

Cache folder: ``$OFFLOAD_PASSES_TORCHAIR_DIR`` or ``~/.cache/offload_passes/torchair``.
Runtime requirements of the extracted packages: ``protobuf>=3.13`` and ``packaging``
(:data:`REQUIREMENTS`).

Command line (also used by ``.ci/run``)::

    python -m offload_passes.tools.torchair_env [--ensure] # download + extract if needed, print the folder
    python -m offload_passes.tools.torchair_env --check    # exit 1 (no download) when not prepared
    python -m offload_passes.tools.torchair_env --wheel torch_npu-2.13.0-...whl   # use a local wheel
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional, Sequence

log = logging.getLogger("offload_passes.tools.torchair_env")

ENV_DIR = "OFFLOAD_PASSES_TORCHAIR_DIR"
ENV_VERSION = "OFFLOAD_PASSES_TORCH_NPU_VERSION"
#: Packages taken from ``torch_npu/dynamo/`` of the wheel.
PACKAGES = ("torchair", "npugraph_ex")
#: pip requirements of the extracted packages (TorchAir asserts protobuf >= 3.13 and imports packaging).
REQUIREMENTS = ("protobuf>=3.13", "packaging")
_WHEEL_PREFIX = "torch_npu/dynamo/"
_MARKER = ".offload_passes_torchair.json"
#: Bump when the extraction layout changes, so stale caches are rebuilt (2: marker records the torch
#: version the wheel was built for).
_LAYOUT_VERSION = 2
#: torch-npu release whose TorchAir / npugraph_ex the tests use, per torch ``major.minor`` (each one run
#: by ``scripts/test_matrix.sh``, results in docs/versions.md). torch-npu ships post releases for one
#: torch version; the plain ``2.8.0`` has no npugraph_ex yet, so 2.8 takes its newest post release; 2.10
#: takes ``2.10.0.post4``, the one vllm-ascend pins; 2.11 its newest post release; 2.14.0 is the newest
#: torch-npu and serves torch 2.14.1 too (its wheel requires ``torch==2.14.0.*``, only ``major.minor`` must
#: match). Checked here: each of these five wheels carries torchair + npugraph_ex. ``None``: no torch-npu
#: release exists for that torch (2.15: the newest, 2.14.0, requires torch 2.14, and TorchAir 2.14's
#: converter does not run on torch 2.15's graphs), so the NPU modes cannot run with it and their tests
#: skip, naming this (:func:`no_torch_npu_reason`). Other torch versions fall back to the plain
#: ``major.minor.patch`` release (untested; plain ``2.9.0`` has no npugraph_ex either).
TORCH_NPU_FOR_TORCH: dict[str, Optional[str]] = {"2.8": "2.8.0.post5", "2.10": "2.10.0.post4", "2.11": "2.11.0.post3",
                                                 "2.13": "2.13.0", "2.14": "2.14.0", "2.15": None}
#: The start of :func:`no_torch_npu_reason`'s sentence (tests/conftest.py lets exactly these skips through
#: ``OFFLOAD_PASSES_NO_SKIP``: they are a fact of the torch version, not a missing set-up step).
NO_TORCH_NPU = "no torch-npu release exists for torch"


class TorchAirEnvError(RuntimeError):
    """The TorchAir test environment could not be prepared (message says why and what to do)."""


def _major_minor(version: str) -> str:
    """``"2.8.0+cpu"`` / ``"2.13.0.*"`` / ``"2.8.0.post5"`` -> ``"2.8"`` / ``"2.13"`` / ``"2.8"``."""
    return ".".join(version.split("+")[0].split(".")[:2])


def matching_torch_npu_version(torch_version: Optional[str] = None) -> Optional[str]:
    """The torch-npu release for ``torch_version`` (default: the installed torch), or None when none exists.

    ``2.8.x`` -> ``2.8.0.post5``, ``2.10.x`` -> ``2.10.0.post4``, ``2.11.x`` -> ``2.11.0.post3``, ``2.13.x``
    -> ``2.13.0``, ``2.14.x`` -> ``2.14.0``, ``2.15.x`` -> None (:data:`TORCH_NPU_FOR_TORCH`); any other
    ``X.Y.Z`` -> ``X.Y.Z`` (the plain torch-npu release of that torch).
    """
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    mm = _major_minor(torch_version)
    if mm in TORCH_NPU_FOR_TORCH:
        return TORCH_NPU_FOR_TORCH[mm]
    parts = (torch_version.split("+")[0].split(".") + ["0", "0"])[:3]
    return ".".join(p if p.isdigit() else "0" for p in parts)


def no_torch_npu_reason(torch_version: Optional[str] = None) -> Optional[str]:
    """Why the installed torch (or ``torch_version``) has no TorchAir / npugraph_ex, or None when it has a
    torch-npu release (:data:`TORCH_NPU_FOR_TORCH`)."""
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    if matching_torch_npu_version(torch_version) is not None:
        return None
    newest = max((v for v in TORCH_NPU_FOR_TORCH.values() if v is not None),
                 key=lambda v: tuple(int(p) for p in v.split(".")[:3]))
    return (f"{NO_TORCH_NPU} {_major_minor(torch_version)} (the newest, {newest}, requires torch "
            f"{_major_minor(newest)}): TorchAir / npugraph_ex, hence the ge_graph and npugraph_ex modes, cannot run "
            "with it (tools/torchair_env.py TORCH_NPU_FOR_TORCH)")


def default_torch_npu_version() -> Optional[str]:
    """torch_npu release matching the installed torch (:func:`matching_torch_npu_version`; None when none
    exists); env override."""
    override = os.environ.get(ENV_VERSION, "").strip()
    if override:
        return override
    return matching_torch_npu_version()


def _version_or_raise(version: Optional[str]) -> str:
    version = version or default_torch_npu_version()
    if version is None:
        raise TorchAirEnvError(no_torch_npu_reason())
    return version


def wheel_torch_requirement(wheel: os.PathLike) -> Optional[str]:
    """The torch version a torch_npu wheel was built for (``Requires-Dist: torch==...``), or None."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        if not names:
            return None
        text = zf.read(names[0]).decode("utf-8", "replace")
    for line in text.splitlines():
        key, _, req = line.partition(":")
        req = req.strip().replace(" ", "")
        if key.strip().lower() == "requires-dist" and req.startswith("torch==") and ";" not in req:
            return req[len("torch=="):]
    return None


def torch_mismatch(site: os.PathLike, torch_version: Optional[str] = None) -> Optional[str]:
    """Why the TorchAir copy in ``site`` does not fit the installed torch, or None when it does.

    TorchAir / npugraph_ex follow torch internals closely (FX passes, AOT, Inductor), so a copy
    made for another torch ``major.minor`` is not used.
    """
    try:
        info = json.loads((Path(site) / _MARKER).read_text())
    except (OSError, ValueError):
        return f"{site}: no readable {_MARKER}"
    built_for = info.get("torch")
    if not built_for:
        return None  # a wheel without a torch requirement (hand-made): nothing to compare
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    if _major_minor(built_for) != _major_minor(torch_version):
        return (f"torchair/npugraph_ex from {info.get('wheel')} were built for torch {built_for}, "
                f"the installed torch is {torch_version}")
    return None


def cache_root(cache: Optional[os.PathLike] = None) -> Path:
    if cache is not None:
        return Path(cache).expanduser()
    env = os.environ.get(ENV_DIR, "").strip()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "offload_passes" / "torchair"


def _version_dir(version: str, cache: Optional[os.PathLike]) -> Path:
    return cache_root(cache) / f"torch_npu-{version}"


def site_dir(version: Optional[str] = None, cache: Optional[os.PathLike] = None) -> Optional[Path]:
    """The folder to put on ``sys.path`` if the packages are extracted, else ``None`` (never downloads;
    None also where the torch has no torch-npu release, :func:`no_torch_npu_reason`)."""
    version = version or default_torch_npu_version()
    if version is None:
        return None
    site = _version_dir(version, cache) / "site"
    marker = site / _MARKER
    if not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if info.get("layout") != _LAYOUT_VERSION or info.get("version") != version:
        return None
    if not all((site / p / "__init__.py").is_file() for p in PACKAGES):
        return None
    why = torch_mismatch(site)
    if why is not None:
        log.warning("not using %s: %s", site, why)
        return None
    return site


def missing_requirements() -> list:
    """Requirements from :data:`REQUIREMENTS` that are not importable here."""
    missing = []
    if importlib.util.find_spec("google.protobuf") is None:
        missing.append(REQUIREMENTS[0])
    if importlib.util.find_spec("packaging") is None:
        missing.append(REQUIREMENTS[1])
    return missing


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(version: str, dest: Path) -> Path:
    """``pip download --no-deps torch-npu==version``; returns the wheel path."""
    dest.mkdir(parents=True, exist_ok=True)
    existing = sorted(dest.glob(f"torch_npu-{version}-*.whl"))
    if existing:
        return existing[0]
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    # The bundled Python sources are identical for every platform tag; if this platform has no
    # wheel (e.g. macOS), fall back to the manylinux x86_64 one for the running CPython.
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    attempts = [
        base + [f"torch-npu=={version}"],
        base + ["--platform", "manylinux_2_28_x86_64", "--python-version", py,
                "--implementation", "cp", f"torch-npu=={version}"],
    ]
    errors = []
    for cmd in attempts:
        log.info("running %s", " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(dest.glob(f"torch_npu-{version}-*.whl"))
        if proc.returncode == 0 and found:
            return found[0]
        errors.append((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    raise TorchAirEnvError(
        f"cannot download torch-npu=={version} with pip (no network / no such release?). "
        f"Last pip messages: {errors[-1]}. Alternatives: pass --wheel <path to a torch_npu-{version} wheel>, "
        f"or set {ENV_DIR} to a folder prepared on another machine."
    )


def _extract(wheel: Path, site_tmp: Path) -> int:
    count = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if not name.startswith(_WHEEL_PREFIX) or info.is_dir():
                continue
            rel = name[len(_WHEEL_PREFIX):]
            parts = rel.split("/")
            # only the two pure-Python packages; never the CANN-linked .so (stand-ins replace them)
            if parts[0] not in PACKAGES or name.endswith(".so") or ".." in parts:
                continue
            target = site_tmp.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            count += 1
    missing = [p for p in PACKAGES if not (site_tmp / p / "__init__.py").is_file()]
    if missing:
        raise TorchAirEnvError(f"wheel {wheel.name} has no torch_npu/dynamo/{missing[0]}/__init__.py")
    return count


def ensure(
    version: Optional[str] = None,
    cache: Optional[os.PathLike] = None,
    wheel: Optional[os.PathLike] = None,
) -> Path:
    """Prepare (idempotently) and return the folder holding ``torchair/`` and ``npugraph_ex/``.

    Downloads the wheel only when the extracted packages are missing. Raises
    :class:`TorchAirEnvError` with instructions when that is impossible.
    """
    version = _version_or_raise(version)
    ready = site_dir(version, cache)
    if ready is not None:
        return ready
    vdir = _version_dir(version, cache)
    vdir.mkdir(parents=True, exist_ok=True)
    whl = Path(wheel) if wheel is not None else _download(version, vdir / "wheels")
    if not whl.is_file():
        raise TorchAirEnvError(f"wheel not found: {whl}")
    built_for = wheel_torch_requirement(whl)
    import torch

    if built_for is not None and _major_minor(built_for) != _major_minor(torch.__version__):
        mine = matching_torch_npu_version()
        instead = (f"use torch-npu {mine} (the default for this torch) or another torch" if mine is not None
                   else no_torch_npu_reason())
        raise TorchAirEnvError(f"{whl.name} is built for torch {built_for}, the installed torch is "
                               f"{torch.__version__}; {instead}")
    tmp = Path(tempfile.mkdtemp(prefix="site-", dir=vdir))
    try:
        count = _extract(whl, tmp)
        marker = {
            "layout": _LAYOUT_VERSION,
            "version": version,
            "wheel": whl.name,
            "sha256": _sha256(whl),
            "files": count,
            "packages": list(PACKAGES),
            "torch": built_for,
        }
        (tmp / _MARKER).write_text(json.dumps(marker, indent=1))
        site = vdir / "site"
        if site.exists():  # stale or half-written: replace as a whole
            shutil.rmtree(site)
        os.replace(tmp, site)  # atomic on one filesystem: readers see all or nothing
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("extracted %d files of %s into %s", count, whl.name, site)
    return site


def activate(site: os.PathLike) -> Path:
    """Put ``site`` first on ``sys.path`` so ``import torchair`` / ``import npugraph_ex`` find it."""
    site = str(Path(site).resolve())
    if site not in sys.path:
        sys.path.insert(0, site)
    return Path(site)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m offload_passes.tools.torchair_env",
        description="Prepare TorchAir/npugraph_ex (Python only, from the torch-npu wheel) for the CPU tests.",
    )
    p.add_argument("--version", default=None,
                   help="torch-npu version (default: matches torch, e.g. 2.8.0.post5 for torch 2.8, 2.14.0 for 2.14)")
    p.add_argument("--dir", default=None, help=f"cache folder (default: ${ENV_DIR} or ~/.cache/offload_passes/torchair)")
    p.add_argument("--wheel", default=None, help="use this local torch_npu wheel instead of downloading")
    p.add_argument("--check", action="store_true", help="do not download; exit 1 if not prepared")
    p.add_argument("--ensure", action="store_true", help="prepare if needed (the default action; explicit form)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        version = _version_or_raise(args.version)
    except TorchAirEnvError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        site = site_dir(version, args.dir)
        if site is None:
            print(f"not prepared: torchair/npugraph_ex of torch-npu=={version} under {cache_root(args.dir)}")
            return 1
    else:
        try:
            site = ensure(version, args.dir, args.wheel)
        except TorchAirEnvError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    print(site)
    missing = missing_requirements()
    if missing:
        print(f"warning: also needed: pip install {' '.join(repr(m) for m in missing)}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

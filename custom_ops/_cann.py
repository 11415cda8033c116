"""Living beside CANN's custom-op torch extension, whichever is loaded first.

On an Atlas machine the seven ``custom::`` ops come from CANN's ``custom_ops`` wheel (built from the
reference's ``ops/ascendc/torch_ops_extension``; library ``custom_ops_lib*.so``). That library owns the
namespace with ``TORCH_LIBRARY(custom, m)`` and defines the schemas, the NPU (PrivateUse1) kernels and
the Meta kernels. PyTorch aborts the process (inside ``dlopen``, uncatchable) when a ``TORCH_LIBRARY``
block defines a schema that already exists, so the order matters:

1. **CANN first (preferred).** ``import offload_passes`` looks for the library *before* defining anything:
   ``$OFFLOAD_PASSES_CANN_OPS_LIB`` (a ``.so`` file, or a directory holding ``custom_ops_lib*.so``), else a
   ``custom_ops/custom_ops_lib*.so`` in any ``sys.path`` entry or site-packages (the wheel's layout). It
   is loaded with ``torch.ops.load_library`` (like the reference's own loader; ``custom_ops/__init__``
   is not imported, it mounts every op on torch_npu). Then the op modules add only what is missing: CPU
   and Functionalize kernels, and fakes only where CANN has no Meta kernel.
   ``OFFLOAD_PASSES_CANN_OPS_LIB=none`` turns the search off.
2. **CANN later.** ``offload_passes.load_cann_ops(path)``, ``torch.ops.load_library(path)`` and
   ``import custom_ops`` (its ``custom_ops_lib`` extension) are intercepted: when the library defines one
   of the schemas we defined, our schemas, fakes and NPU guards are deregistered first (the CPU and
   Functionalize kernels stay, which keeps the operator entries and every ``torch.ops.custom.*`` object
   valid), the library is loaded, and whatever it lacks is registered again. A raw ``ctypes.CDLL`` of the
   library after ``import offload_passes`` cannot be intercepted and still aborts: use one of the above.
3. **No CANN.** Every op we define gets a PrivateUse1 kernel that raises a clear error (how to install /
   load CANN's ops) instead of letting torch_npu's CPU fallback run our CPU kernels on device tensors.

:func:`cann_library_status` reports what was loaded from where and which kernels each op has.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import mmap
import os
import sys
import sysconfig
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar, Union

import torch

from offload_passes import _compat

from . import _library as L

log = logging.getLogger("offload_passes.custom_ops.cann")

ENV_VAR = "OFFLOAD_PASSES_CANN_OPS_LIB"
LIB_GLOB = "custom_ops_lib*.so"
_OFF_VALUES = ("none", "off", "0", "no", "false")
_OUR_PACKAGE_DIR = Path(__file__).resolve().parent

_lock = threading.RLock()
_T = TypeVar("_T")


@dataclass
class _LoadRecord:
    path: Optional[str] = None
    source: Optional[str] = None  # env | discovered | explicit | torch.ops.load_library | import | preloaded
    when: Optional[str] = None  # "before" or "after" offload_passes registered its ops
    error: Optional[str] = None  # last failed attempt (path: message)
    discovery: str = "on"  # "on" or "disabled" (OFFLOAD_PASSES_CANN_OPS_LIB=none)


_record = _LoadRecord()


@dataclass(frozen=True)
class CannOpStatus:
    """Kernels of one ``custom::`` op in this process."""

    name: str
    schema_owner: str  # "cann" (defined by another library) or "offload_passes"
    schema_matches: bool  # the live schema string is CANN's string from docs/ops.md
    npu_kernel: bool  # a real PrivateUse1 kernel (not our error-raising guard)
    npu_guard: bool  # our PrivateUse1 kernel that raises "CANN ops not loaded"
    meta_kernel: bool  # a Meta kernel registered by another library (CANN's)
    our_fake: bool  # our fake kernel is registered (only when there is no CANN Meta kernel)
    cpu_kernel: bool
    functionalize_kernel: bool


@dataclass(frozen=True)
class CannLibraryStatus:
    """What :func:`cann_library_status` returns; ``as_dict()`` is JSON-ready."""

    loaded: bool
    path: Optional[str]
    source: Optional[str]
    when: Optional[str]
    error: Optional[str]
    discovery: str
    env_value: Optional[str]
    torch_npu_imported: bool
    ops: dict[str, CannOpStatus] = field(default_factory=dict)

    @property
    def missing_npu_kernels(self) -> list[str]:
        return [n for n, s in self.ops.items() if not s.npu_kernel]

    @property
    def schema_mismatches(self) -> list[str]:
        return [n for n, s in self.ops.items() if not s.schema_matches]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["missing_npu_kernels"] = self.missing_npu_kernels
        d["schema_mismatches"] = self.schema_mismatches
        return d


# --------------------------------------------------------------------------------------------
# Finding the library
# --------------------------------------------------------------------------------------------

def _libs_in(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob(LIB_GLOB) if p.is_file())


def _resolve_env_path(value: str) -> Path:
    p = Path(value).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        for d in (p, p / "custom_ops"):
            libs = _libs_in(d)
            if libs:
                return libs[0]
    raise RuntimeError(
        f"{ENV_VAR}={value!r}: no such file, and no {LIB_GLOB} in that directory (or its custom_ops/); "
        f"point it at CANN's custom_ops_lib*.so, or set {ENV_VAR}=none to disable loading"
    )


def _search_dirs() -> Iterator[Path]:
    seen: set[str] = set()
    extra = [sysconfig.get_paths().get(k) for k in ("purelib", "platlib")]
    for entry in list(sys.path) + extra:
        if entry is None:
            continue
        d = Path(entry or ".") / "custom_ops"
        try:
            key = str(d.resolve())
        except OSError:
            continue
        # Our own repository folder is also called custom_ops (it installs as offload_passes.custom_ops).
        if key in seen or Path(key) == _OUR_PACKAGE_DIR:
            continue
        seen.add(key)
        if d.is_dir():
            yield d


def find_cann_library(use_env: bool = True) -> Optional[Path]:
    """Path of CANN's ``custom_ops_lib*.so``: ``$OFFLOAD_PASSES_CANN_OPS_LIB`` first (when ``use_env``),
    then ``custom_ops/`` in ``sys.path`` / site-packages. ``None`` if not found or disabled."""
    value = os.environ.get(ENV_VAR, "").strip() if use_env else ""
    if value.lower() in _OFF_VALUES:
        return None
    if value:
        return _resolve_env_path(value)
    for d in _search_dirs():
        libs = _libs_in(d)
        if libs:
            return libs[0]
    return None


def _defines_our_ops(path: Union[str, Path], names: set[str]) -> bool:
    """True if the library's read-only data holds the schema string of one of ``names``.

    ``m.def("dsa_plan(Tensor ...")`` keeps the literal in the binary, so this tells, before loading it,
    whether its ``TORCH_LIBRARY`` would collide with a schema we defined.
    """
    if not names or Path(path).name.startswith("offload_passes_"):
        return False  # our own C++ CPU kernels (offload_cpu:: namespace, same op names) never collide
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return any(data.find(f"{n}(Tensor".encode()) >= 0 for n in names)
    except (OSError, ValueError):
        return False  # unreadable / empty: let the real loader report it


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

_original_load_library: Callable[[str], None] = torch.ops.load_library


def _import_torch_npu_if_available() -> None:
    """CANN's library links against libtorch_npu; importing torch_npu first makes its symbols available."""
    if "torch_npu" in sys.modules or importlib.util.find_spec("torch_npu") is None:
        return
    try:
        import torch_npu  # noqa: F401
    except Exception as e:  # pragma: no cover - only on machines with a broken torch_npu
        log.warning("could not import torch_npu before loading CANN's custom ops: %s", e)


def _load_external(path: Path, do_load: Callable[[], _T], source: str) -> _T:
    """Run ``do_load`` (which dlopens ``path``), first stepping aside if it would redefine our schemas."""
    with _lock:
        ours = set(L.defined_ops())
        if not _defines_our_ops(path, ours):
            result = do_load()
            # First sight of a library holding our ops that did not collide (e.g. CANN already owned
            # them): note it; a repeated load of the same library (a no-op dlopen) keeps the record.
            if _record.path is None and _defines_our_ops(path, set(L.registered_schemas())):
                _remember(path, source, "after")
            return result
        log.info("loading %s after offload_passes: handing the custom:: schemas %s to it", path, sorted(ours))
        L.release_for_external_library()
        try:
            result = do_load()
        except BaseException as e:
            _record.error = f"{path}: {e}"
            _register_missing()  # put ours back: the library did not load
            raise
        _remember(path, source, "after")
        _register_missing()
        return result


def _remember(path: Path, source: str, when: str) -> None:
    _record.path, _record.source, _record.when, _record.error = str(path), source, when, None


def _register_missing() -> None:
    """After another library (CANN) was loaded: define what it lacks, add fakes where it has no Meta
    kernel, guard ops without an NPU kernel, and flag schema strings that differ from ours."""
    for schema in L.registered_schemas().values():
        L.define(schema)
    for name, fn in L.registered_fakes().items():
        L.register_fake(name, fn)
    register_npu_guards()
    _check_schemas()


def _live_schema(name: str) -> Optional[str]:
    return _compat.dispatcher_schema(L.qualname(name))


def _check_schemas() -> None:
    for name, ours in L.registered_schemas().items():
        live = _live_schema(name)
        if live is not None and live != L.qualname(ours):
            log.warning(
                "custom::%s: the loaded CANN library defines a different schema than offload_passes "
                "expects (CPU kernels and passes may not match it):\n  CANN: %s\n  ours: %s",
                name, live, L.qualname(ours),
            )
            _drop_cached_packet(name)  # so torch.ops.custom.<name> is rebuilt from the live schema


def _drop_cached_packet(name: str) -> None:
    ns = torch.ops.custom
    if name in vars(ns):
        delattr(ns, name)
        if name in getattr(ns, "_dir", []):
            ns._dir.remove(name)


def load_cann_ops(path: Union[str, Path, None] = None) -> CannLibraryStatus:
    """Load CANN's custom-op library (``custom_ops_lib*.so``) into this process, safely in any order.

    ``path``: the ``.so`` (or a directory holding it); default: ``$OFFLOAD_PASSES_CANN_OPS_LIB``, then the
    installed ``custom_ops`` wheel. Import torch_npu first on an NPU machine (done here if importable).
    Raises ``FileNotFoundError`` when nothing is found and ``OSError`` when the library cannot be loaded
    (our own definitions are then kept). Returns :func:`cann_library_status`.
    """
    if path is None:
        found = find_cann_library()
        if found is None:
            raise FileNotFoundError(
                f"CANN's custom-op library ({LIB_GLOB}) was not found: pass its path, set {ENV_VAR}, or "
                "install the custom_ops wheel (docs/atlas.md, 'On an Atlas A3')"
            )
    else:
        found = _resolve_env_path(str(path)) if Path(path).is_dir() else Path(path)
        if not found.is_file():
            raise FileNotFoundError(f"load_cann_ops: no such file {found}")
    found = found.resolve()
    _import_torch_npu_if_available()
    _load_external(found, lambda: _original_load_library(str(found)), "explicit")
    return cann_library_status()


def autoload() -> None:
    """Called by ``offload_passes.custom_ops`` before any op module defines a schema."""
    with _lock:
        value = os.environ.get(ENV_VAR, "").strip()
        if value.lower() in _OFF_VALUES:
            _record.discovery = "disabled"
            return
        if L.schema_exists("dsa_plan") or L.schema_exists("npu_gather_selection_kv_cache"):
            _remember_preloaded()
            return
        path = find_cann_library()  # raises if $OFFLOAD_PASSES_CANN_OPS_LIB points nowhere
        if path is None:
            return
        source = "env" if value else "discovered"
        _import_torch_npu_if_available()
        try:
            _original_load_library(str(path))
        except OSError as e:
            _record.error = f"{path}: {e}"
            if source == "env":
                raise RuntimeError(f"{ENV_VAR}: could not load {path}: {e}") from e
            log.warning("found CANN's custom-op library at %s but could not load it: %s", path, e)
            return
        _remember(path, source, "before")
        log.info("loaded CANN's custom-op library %s (%s) before registering offload_passes' ops", path, source)


def _remember_preloaded() -> None:
    """The schemas were already there: CANN's library was loaded before ``import offload_passes``."""
    path = next((p for p in sorted(torch.ops.loaded_libraries) if Path(p).name.startswith("custom_ops_lib")), None)
    if path is None:
        mod = next((m for n, m in list(sys.modules.items()) if n.rpartition(".")[2] == "custom_ops_lib"), None)
        path = getattr(mod, "__file__", None)
    _record.path, _record.source, _record.when = path, "preloaded", "before"


# --------------------------------------------------------------------------------------------
# NPU guard: no CANN library -> a clear error instead of a CPU fallback
# --------------------------------------------------------------------------------------------

def npu_guard_message(name: str) -> str:
    msg = (
        f"custom::{name} was called on an NPU tensor, but CANN's custom-op library ({LIB_GLOB}, the "
        "custom_ops wheel of the torch_ops_extension) is not loaded, so there is no NPU kernel; "
        "offload_passes only provides CPU kernels and never runs them on device tensors. Install CANN's op "
        "package and the custom_ops torch extension (docs/atlas.md, 'On an Atlas A3'), then keep the wheel "
        f"importable (found at import), set {ENV_VAR}=/path/to/{LIB_GLOB} before importing offload_passes, "
        "or call offload_passes.load_cann_ops(path)"
    )
    if _record.error:
        msg += f". Last load attempt failed: {_record.error}"
    return msg


def _make_guard(name: str) -> Callable[..., Any]:
    def npu_guard(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(npu_guard_message(name))

    npu_guard.__name__ = f"{name}_npu_guard"
    return npu_guard


def register_npu_guards() -> list[str]:
    """A raising PrivateUse1 kernel for every ``custom::`` op that has no NPU kernel. Returns the names."""
    return [n for n in L.registered_schemas() if L.schema_exists(n) and L.register_npu_guard(n, _make_guard(n))]


# --------------------------------------------------------------------------------------------
# Hooks for a CANN load after import: torch.ops.load_library and `import custom_ops`
# --------------------------------------------------------------------------------------------

def _load_library_hook(path: str) -> None:
    try:
        resolved = Path(_compat.resolve_library_path(path))
    except Exception:  # pragma: no cover - let the original report it
        resolved = Path(path)
    return _load_external(resolved, lambda: _original_load_library(path), "torch.ops.load_library")


_load_library_hook._offload_passes_hook = True  # type: ignore[attr-defined]


class _ExtensionLoader(importlib.abc.Loader):
    """Wraps the extension loader of ``custom_ops_lib``: its ``create_module`` is where dlopen happens."""

    def __init__(self, inner: importlib.machinery.ExtensionFileLoader, origin: str) -> None:
        self.inner, self.origin = inner, origin

    def create_module(self, spec):  # noqa: ANN001
        return _load_external(Path(self.origin), lambda: self.inner.create_module(spec), "import")

    def exec_module(self, module) -> None:  # noqa: ANN001
        self.inner.exec_module(module)


class _CannExtensionFinder(importlib.abc.MetaPathFinder):
    """Sees ``import custom_ops`` load its ``custom_ops_lib`` extension (the wheel's ``__init__`` does)."""

    _offload_passes_hook = True

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001
        if not fullname.rpartition(".")[2].startswith("custom_ops_lib"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            return spec
        spec.loader = _ExtensionLoader(spec.loader, spec.origin)
        return spec


def install_hooks() -> None:
    """Route later loads of CANN's library through :func:`_load_external` (idempotent)."""
    if not getattr(torch.ops.load_library, "_offload_passes_hook", False):
        torch.ops.load_library = _load_library_hook  # instance attribute; the class method stays intact
    if not any(getattr(f, "_offload_passes_hook", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _CannExtensionFinder())


# --------------------------------------------------------------------------------------------
# Status
# --------------------------------------------------------------------------------------------

def cann_library_status() -> CannLibraryStatus:
    """What was loaded from where, and which kernels each of the seven ``custom::`` ops has.

    For ``offload-atlas-check``: ``status.missing_npu_kernels`` lists the ops that would fail on an NPU,
    ``status.as_dict()`` goes into the JSON report.
    """
    from . import CUSTOM_OPS

    defined, faked, guarded = set(L.defined_ops()), set(L._faked_here), set(L._guarded_here)
    schemas = L.registered_schemas()
    ops = {}
    for name in CUSTOM_OPS:
        live = _live_schema(name)
        exists = live is not None
        ops[name] = CannOpStatus(
            name=name,
            schema_owner="offload_passes" if name in defined else ("cann" if exists else "none"),
            schema_matches=exists and live == L.qualname(schemas.get(name, "")),
            npu_kernel=exists and L.has_kernel(name, "PrivateUse1") and name not in guarded,
            npu_guard=name in guarded,
            meta_kernel=exists and L.has_kernel(name, "Meta") and name not in faked,
            our_fake=name in faked,
            cpu_kernel=exists and L.has_kernel(name, "CPU"),
            functionalize_kernel=exists and L.has_kernel(name, "Functionalize"),
        )
    loaded = any(s.schema_owner == "cann" for s in ops.values())
    return CannLibraryStatus(
        loaded=loaded,
        path=_record.path,
        source=_record.source,
        when=_record.when,
        error=_record.error,
        discovery=_record.discovery,
        env_value=os.environ.get(ENV_VAR),
        torch_npu_imported="torch_npu" in sys.modules,
        ops=ops,
    )

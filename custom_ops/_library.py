"""Shared registration machinery for the ``custom::`` ops.

Every op module (``dsa_plan.py``, ``dsa_serve.py`` ...) uses these helpers so that:

* a schema already present in the process (CANN's ``custom_ops`` extension loaded first) is never
  redefined; we only add the kernels that are missing (CPU, Meta/fake, Functionalize);
* C++ CPU kernels (``csrc/*.cpp``, all ops in one library) are built by ``pip install`` (``setup.py``,
  ``BuildExtension``) and loaded when the op modules register (about 1 ms), so that each op's CPU kernel
  is its C++ entry (``csrc/_entry.cpp``). Only when that prebuilt library is missing (a source checkout
  without build, another torch version) or ``OFFLOAD_PASSES_JIT_KERNELS=1`` is set are they JIT-built with
  ``torch.utils.cpp_extension.load`` + ninja on the first CPU call, cached under ``TORCH_EXTENSIONS_DIR``
  (default ``~/.cache/torch_extensions``); the ops' CPU kernels then stay Python (validation once per call
  signature, then the C++ kernel). Importing the package never invokes a compiler.
* ``OFFLOAD_PASSES_CPU_KERNELS=reference`` switches every CPU kernel to the pure-torch reference
  (for machines without a compiler); the default ``cpp`` uses the C++ kernels.

It also holds what every op's wiring shares, on every device: ``bind`` (``OpSpec.binder``: the one schema
binding), ``run_twin`` (the one functional-twin runner), ``ValidationMemo`` (validate once per call
signature), ``check`` (eager or lazily formatted message), ``cpu_kernel`` / ``cpu_run`` (the C++ kernel or
the reference), ``register_twins`` (the op's kernels from its spec) and the C++ CPU entries
(``csrc/_entry.cpp``: the op's CPU kernel without Python per call, :func:`register_cpu`).
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Hashable, Iterable, Optional, Sequence, TypeVar, Union

import torch

from offload_passes import _compat, _extensions

if TYPE_CHECKING:
    from .opspec import OpSpec

log = logging.getLogger("offload_passes.custom_ops")

NAMESPACE = "custom"
#: Namespace of the internal C++ entry points (``torch.ops.offload_cpu.<op>``). Not public API.
CPU_NAMESPACE = "offload_cpu"
CSRC = Path(__file__).resolve().parent / "csrc"

# Our registrations live in separate libraries so that CANN's extension can be loaded *after* us (see
# ``_cann.py``): the schemas, fakes and NPU guards are released before it runs its ``TORCH_LIBRARY(custom)``,
# while the CPU and Functionalize kernels (``_lib``) stay registered. Those kernels keep the dispatcher's
# operator entries alive, so the ``torch.ops.custom.*`` objects other modules already hold stay valid.
_lib = torch.library.Library(NAMESPACE, "FRAGMENT")  # CPU + Functionalize kernels (never released)
_def_lib = torch.library.Library(NAMESPACE, "FRAGMENT")  # schemas we defined
_fake_lib = torch.library.Library(NAMESPACE, "FRAGMENT")  # fake kernels we registered
_guard_lib = torch.library.Library(NAMESPACE, "FRAGMENT")  # PrivateUse1 guards we registered
_defined_here: set[str] = set()
_faked_here: set[str] = set()
_guarded_here: set[str] = set()
#: Everything the op modules asked for, kept to re-register what is missing after a late CANN load.
_schemas: dict[str, str] = {}
_fakes: dict[str, Callable] = {}
_load_lock = threading.Lock()
#: How the CPU kernels were loaded in this process: None (not yet), "prebuilt" or "jit".
_kernels_origin: Optional[str] = None


def qualname(name: str) -> str:
    return f"{NAMESPACE}::{name}"


def schema_exists(name: str) -> bool:
    """True if ``custom::<name>`` is already known to the dispatcher (ours or CANN's)."""
    return _compat.dispatcher_has_schema(qualname(name))


def define(schema: str) -> bool:
    """Define ``custom::<schema>`` unless the process already has it. Returns True if defined here."""
    name = schema.split("(", 1)[0].strip()
    _schemas[name] = schema
    if schema_exists(name):
        log.debug("custom::%s already defined in this process; adding only missing kernels", name)
        return False
    _def_lib.define(schema)
    _defined_here.add(name)
    return True


def has_kernel(name: str, dispatch_key: str) -> bool:
    return _compat.dispatcher_has_kernel(qualname(name), dispatch_key)


def impl(name: str, dispatch_key: str, fn: Callable) -> bool:
    """Register ``fn`` for ``custom::<name>`` at ``dispatch_key`` unless a kernel is already there."""
    if has_kernel(name, dispatch_key):
        return False
    _lib.impl(name, fn, dispatch_key)
    return True


def register_fake(name: str, fn: Callable) -> bool:
    """Register a fake (meta) kernel unless one exists (a C++ Meta kernel from CANN counts)."""
    _fakes[name] = fn
    if has_kernel(name, "Meta") or (name not in _defined_here and _has_python_fake(name)):
        return False
    torch.library.register_fake(qualname(name), fn, lib=_fake_lib)
    _faked_here.add(name)
    return True


def register_npu_guard(name: str, fn: Callable) -> bool:
    """Register ``fn`` as the PrivateUse1 (NPU) kernel of ``custom::<name>`` unless one exists (CANN's)."""
    if has_kernel(name, "PrivateUse1"):
        return False
    _guard_lib.impl(name, fn, "PrivateUse1")
    _guarded_here.add(name)
    return True


def release_for_external_library() -> tuple[set[str], set[str], set[str]]:
    """Deregister our schemas, fakes and NPU guards (not the CPU/Functionalize kernels) so that a library
    with its own ``TORCH_LIBRARY(custom, m)`` can define the schemas. Returns what was released.

    The cached ``torch.ops.custom.<op>`` objects are kept on purpose (``Library._destroy`` would drop
    them): the operator entries survive through ``_lib``'s kernels, so objects held elsewhere keep working.
    """
    global _def_lib, _fake_lib, _guard_lib
    released = (set(_defined_here), set(_faked_here), set(_guarded_here))
    for lib in (_def_lib, _fake_lib, _guard_lib):
        getattr(lib, "_op_defs", set()).clear()  # keep torch.ops.custom.* (see docstring)
        lib._destroy()
    _def_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    _fake_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    _guard_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    _defined_here.clear()
    _faked_here.clear()
    _guarded_here.clear()
    return released


def registered_schemas() -> dict[str, str]:
    """Schema string of every ``custom::`` op the op modules define (CANN's strings)."""
    return dict(_schemas)


def registered_fakes() -> dict[str, Callable]:
    return dict(_fakes)


def _has_python_fake(name: str) -> bool:
    return _compat.has_python_fake_kernel(qualname(name))


def cpu_kernel_mode() -> str:
    """``cpp`` (default) or ``reference``, from ``OFFLOAD_PASSES_CPU_KERNELS``."""
    mode = os.environ.get("OFFLOAD_PASSES_CPU_KERNELS", "cpp").strip().lower()
    if mode not in ("cpp", "reference"):
        raise RuntimeError(
            f"OFFLOAD_PASSES_CPU_KERNELS must be 'cpp' or 'reference', got {mode!r}"
        )
    return mode


def prebuilt_library() -> Optional[Path]:
    """The CPU-kernel library ``pip install`` built for the running torch, or None if there is none."""
    name = _extensions.cpu_kernels_name(torch.__version__)
    path = Path(__file__).resolve().parent / _extensions.ext_filename(name)
    return path if path.is_file() else None


def _choose_origin() -> tuple[str, Optional[Path]]:
    """``("prebuilt", path)`` unless the library is missing or ``OFFLOAD_PASSES_JIT_KERNELS=1``: ``("jit", None)``."""
    if _extensions.jit_forced(os.environ):
        return "jit", None
    path = prebuilt_library()
    return ("prebuilt", path) if path is not None else ("jit", None)


def cpu_kernels_origin() -> str:
    """Where the C++ CPU kernels come from: ``"prebuilt"`` (built by ``pip install``) or ``"jit"``.

    The answer for this process once they are loaded, else the one the first CPU call will take."""
    return _kernels_origin or _choose_origin()[0]


def load_cpu_kernels() -> str:
    """Load the C++ CPU kernels (every ``offload_cpu::<op>``) once per process; returns the origin."""
    global _kernels_origin
    if _kernels_origin is None:
        with _load_lock:
            if _kernels_origin is None:
                origin, path = _choose_origin()
                if path is not None:
                    log.info("C++ CPU kernels: prebuilt %s", path)
                    # The class method, not torch.ops.load_library: _cann.py hooks that instance attribute
                    # to step aside for CANN's library, and ours (offload_cpu::) is not CANN's.
                    type(torch.ops).load_library(torch.ops, str(path))
                else:
                    _jit_build()
                _kernels_origin = origin
    return _kernels_origin


def cpu_op(name: str):
    """Return ``torch.ops.offload_cpu.<name>``, loading the CPU kernels on first use.

    Each ``csrc/<op>.cpp`` registers its entry point with ``TORCH_LIBRARY_FRAGMENT(offload_cpu, m)``.
    """
    load_cpu_kernels()
    return getattr(torch.ops.offload_cpu, name)


def _jit_build() -> None:
    """Fallback: compile every ``csrc/*.cpp`` into one library with ninja (needs a C++ compiler)."""
    from torch.utils import cpp_extension

    sources = _extensions.cpu_kernel_sources(CSRC)
    if not sources:
        raise RuntimeError(f"no C++ sources for the custom:: CPU kernels in {CSRC}")
    name = _extensions.cpu_kernels_name(torch.__version__)
    if _extensions.jit_forced(os.environ):
        why = f"forced by {_extensions.FORCE_JIT_ENV}"
    else:
        why = f"no prebuilt {_extensions.ext_filename(name)} for torch {torch.__version__}; `pip install -e .` builds it"
    log.warning("C++ CPU kernels: JIT build (%s), cached in TORCH_EXTENSIONS_DIR", why)
    cpp_extension.load(
        name="offload_passes" + name,
        sources=[str(s) for s in sources],
        extra_cflags=list(_extensions.CPU_KERNELS_CFLAGS),
        extra_ldflags=list(_extensions.CPU_KERNELS_LDFLAGS),
        extra_include_paths=[str(CSRC)],
        is_python_module=False,
        verbose=False,
    )


def check(cond: bool, op: str, msg: Union[str, Callable[[], str]]) -> None:
    """Raise ``RuntimeError("custom::<op>: <msg>")`` unless ``cond``. Messages name argument and limit.

    ``msg`` may be a zero-argument callable: the fake kernels validate on every traced call, so hot paths
    format the message only when the check fails.
    """
    if not cond:
        raise RuntimeError(f"{qualname(op)}: {msg() if callable(msg) else msg}")


def is_pow2(n) -> bool:
    n = int(n)
    return n > 0 and (n & (n - 1)) == 0


# --------------------------------------------------------------------------------------------
# CPU-kernel plumbing shared by the op modules
# --------------------------------------------------------------------------------------------

_cpu_kernels: dict[str, "_compat.OpOverload"] = {}


def cpu_kernel(name: str) -> "_compat.OpOverload":
    """``cpu_op(name).default``, resolved once (``cpu_op``'s lookup costs tens of microseconds)."""
    kernel = _cpu_kernels.get(name)
    if kernel is None:
        kernel = _cpu_kernels[name] = cpu_op(name).default
    return kernel


_warned_copy: set[tuple[str, str]] = set()


def warn_strided(op: str, spec: "OpSpec", a: Sequence) -> None:
    """Log (once per op and argument) every strided tensor of the bound arguments ``a``: the kernels copy
    it to a dense buffer on every call (and back, for a mutated one), a silent bandwidth sink."""
    for name, t in zip(spec.arg_names, a):
        if isinstance(t, torch.Tensor) and not t.is_contiguous() and (op, name) not in _warned_copy:
            _warned_copy.add((op, name))
            logging.getLogger(f"{log.name}.{spec.name}").warning(
                "%s: %s is not contiguous; the kernel copies it on every call", op, name)


def signature(a: Sequence) -> list:
    """What validation reads of bound arguments: per tensor its shape, dtype and contiguity; every other
    argument itself."""
    return [(x.shape, x.dtype, x.is_contiguous()) if isinstance(x, torch.Tensor) else x for x in a]


_T = TypeVar("_T")


class ValidationMemo:
    """What validation returned for call signatures (:func:`signature`) that passed.

    An op's ``validate_<op>`` reads shapes, dtypes and the non-tensor arguments only, so a signature that
    passed passes again; kernels validate once per signature (the fake kernels always do, so a graph is
    checked when it is traced). Failures are never stored. Bounded: cleared when ``maxsize`` is reached.
    """

    def __init__(self, maxsize: int = 1024) -> None:
        self.maxsize = maxsize
        self._memo: dict[Hashable, object] = {}

    def __call__(self, op: str, a: Sequence, validate: Callable[[Sequence, str], _T]) -> _T:
        """``validate(a, op)`` unless the signature of ``a`` passed before (then what it returned)."""
        key = (op, *signature(a))
        try:
            return self._memo[key]  # type: ignore[return-value]
        except KeyError:
            pass
        except TypeError:  # an unhashable argument: no memo
            return validate(a, op)
        result = validate(a, op)
        if len(self._memo) >= self.maxsize:
            self._memo.clear()
        self._memo[key] = result
        return result

    def clear(self) -> None:
        self._memo.clear()

    def __len__(self) -> int:
        return len(self._memo)


# --------------------------------------------------------------------------------------------
# Functionalization: in-place op -> functional twin + copy_ back into the mutated arguments.
# --------------------------------------------------------------------------------------------

def functionalize_enabled() -> bool:
    """``OFFLOAD_PASSES_FUNCTIONALIZE=0`` leaves the in-place ops to PyTorch's auto-functionalization."""
    return os.environ.get("OFFLOAD_PASSES_FUNCTIONALIZE", "1") != "0"


def register_functionalization(
    inplace: str,
    functional: str,
    mutated: Sequence[str],
    num_leading_outputs: int = 0,
) -> bool:
    """Register a ``Functionalize`` kernel for ``custom::<inplace>``.

    Under functionalization (AOTAutograd, ``make_fx(..., functionalize)``) the in-place op becomes
    ``custom::<functional>`` followed by ``copy_`` of its trailing outputs into the arguments named
    in ``mutated`` (in schema order). ``num_leading_outputs`` is the number of outputs the in-place op
    itself returns (0 or 1, as CANN's schemas have; they come first in the functional twin's outputs).
    """
    if num_leading_outputs not in (0, 1):
        raise ValueError(f"register_functionalization({inplace!r}): num_leading_outputs must be 0 or 1, "
                         f"got {num_leading_outputs}")
    if not functionalize_enabled() or has_kernel(inplace, "Functionalize"):
        return False
    arg_names = [a.name for a in torch.ops.custom.__getattr__(inplace).default._schema.arguments]
    positions = [arg_names.index(m) for m in mutated]
    functional_op = getattr(torch.ops.custom, functional).default

    def kernel(*args, **kwargs):
        sync = _compat.functionalize_sync
        args = list(args)
        unwrapped = []
        for a in args:
            if isinstance(a, torch.Tensor) and _compat.is_functional_tensor(a):
                sync(a)
                unwrapped.append(_compat.from_functional_tensor(a))
            else:
                unwrapped.append(a)
        with _compat.functionalize_excluded():
            outs = functional_op(*unwrapped, **kwargs)
        if not isinstance(outs, (tuple, list)):
            outs = (outs,)
        for pos, new in zip(positions, outs[num_leading_outputs:]):
            target = args[pos]
            _compat.functionalize_replace(target, new)
            _compat.functionalize_commit_update(target)
            sync(target)
        if num_leading_outputs == 0:
            return None
        return _compat.to_functional_tensor(outs[0])

    _lib.impl(inplace, kernel, "Functionalize")
    return True


def defined_ops() -> Iterable[str]:
    return sorted(_defined_here)


# --------------------------------------------------------------------------------------------
# One registration for an op and its functional twin, from its OpSpec.
# --------------------------------------------------------------------------------------------

def bind(spec: "OpSpec", args: Sequence, kwargs: dict) -> tuple:
    """The op's arguments in schema order, defaults filled in (``spec.binder``: ``opspec.Binder``)."""
    return spec.binder(args, kwargs)


def own_outputs(ret: object) -> tuple:
    """What a kernel returned, as a tuple (``()`` for None)."""
    return () if ret is None else tuple(ret) if isinstance(ret, (tuple, list)) else (ret,)


def run_twin(spec: "OpSpec", a: tuple, checked: object, run: Callable[[tuple, object], object],
             twin_outputs: Optional[Callable[[tuple], tuple]] = None) -> tuple:
    """The functional twin on the bound arguments ``a``, for every device (the CPU kernels here, the CUDA
    ones in ``cuda/_common.py``): ``run`` writes fresh buffers in place of the mutated arguments (clones of
    them, or what ``twin_outputs(a)`` gives) and the twin returns the op's own outputs, then those buffers
    (CANN's order, ``OpSpec.functional_schema``). The inputs are never written."""
    outs = tuple(twin_outputs(a)) if twin_outputs else tuple(a[i].clone() for i in spec.mutated_positions)
    b = list(a)
    for i, out in zip(spec.mutated_positions, outs):
        b[i] = out
    return own_outputs(run(tuple(b), checked)) + outs


def _registrars(namespace: str) -> tuple[Callable[[str, str, Callable], bool], Callable[[str, Callable], bool]]:
    """``(impl, register_fake)`` of the namespace's library (``custom`` here, ``offload_ref`` in
    ``_attention_common.py``)."""
    if namespace == NAMESPACE:
        return impl, register_fake
    from ._attention_common import REF_NAMESPACE, ref_impl, ref_register_fake

    if namespace != REF_NAMESPACE:
        raise ValueError(f"no registration helpers for namespace {namespace!r}")
    return ref_impl, ref_register_fake


def cpu_run(spec: "OpSpec", reference: Callable[..., object]) -> Callable[[tuple, object], object]:
    """The CPU computation on bound arguments: the op's C++ kernel (``offload_cpu::<op>``, the op's own
    arguments), or ``reference`` (called with the arguments by name; op modules pass a lambda, so that the
    module's ``reference_<op>`` is looked up per call) when ``OFFLOAD_PASSES_CPU_KERNELS=reference``."""
    names = spec.arg_names

    def run(a: tuple, _checked: object = None) -> object:
        if cpu_kernel_mode() == "reference":
            return reference(**dict(zip(names, a)))
        return cpu_kernel(spec.name)(*a)

    return run


# The C++ CPU entries (csrc/_entry.cpp): custom::<op>'s CPU kernel in C++, which runs the bare kernel for call
# signatures that passed the checked path (offload_cpu::<op>_checked: the Python kernel below) before.
_checked_lib = torch.library.Library(CPU_NAMESPACE, "FRAGMENT")
_entries: set[str] = set()
_entries_ok: Optional[bool] = None


def _entries_available() -> bool:
    """The C++ entries need the kernels' library when the op modules register: the prebuilt one, loaded at
    import (a JIT build happens on the first call, too late; those processes keep the Python kernels)."""
    global _entries_ok
    if _entries_ok is None:
        _entries_ok = False
        if _choose_origin()[0] == "prebuilt":
            try:
                load_cpu_kernels()
                _entries_ok = _compat.dispatcher_has_schema(f"{CPU_NAMESPACE}::_register_checked_entry")
            except (OSError, RuntimeError):  # a library built for another torch: the JIT path takes over
                log.warning("C++ CPU kernels: the prebuilt library did not load; Python CPU kernels",
                            exc_info=True)
    return _entries_ok


def register_cpu(spec: "OpSpec", kernel: Callable) -> str:
    """Register ``kernel`` (the op's Python CPU path) for ``spec``'s op, unless the op has a CPU kernel
    already (CANN's). With the C++ kernels loaded it becomes ``offload_cpu::<op>_checked`` behind the C++
    entry; returns ``"entry"``, ``"python"`` or ``""`` (nothing registered)."""
    name = spec.name
    if _compat.dispatcher_has_kernel(spec.qualname, "CPU"):
        return ""
    if _entries_available() and _compat.dispatcher_has_schema(f"{CPU_NAMESPACE}::{name}"):
        checked = f"{name}_checked"
        if not _compat.dispatcher_has_schema(f"{CPU_NAMESPACE}::{checked}"):
            _checked_lib.define(checked + spec.schema[len(name):])
            _checked_lib.impl(checked, kernel, "CPU")
        torch.ops.offload_cpu._register_checked_entry(spec.qualname)
        _entries.add(spec.qualname)
        return "entry"
    _registrars(spec.namespace)[0](name, "CPU", kernel)
    return "python"


def has_cpu_entry(spec: "OpSpec") -> bool:
    """True when ``spec``'s op runs through the C++ CPU entry in this process (csrc/_entry.cpp)."""
    return spec.qualname in _entries


def set_checked_bypass(spec: "OpSpec", on: bool) -> None:
    """While ``on``, every CPU call of the op takes its Python path (observers of the op's calls,
    ``custom_ops/dsa_plan.py``). No-op without the C++ entry (every call is Python then)."""
    if spec.qualname in _entries:
        torch.ops.offload_cpu._set_checked_bypass(spec.qualname, on)


def register_twins(
    spec: "OpSpec",
    *,
    validate: Callable[[tuple, str], object],
    run: Callable[[tuple, object], object],
    twin_outputs: Optional[Callable[[tuple], tuple]] = None,
    fake_returns: Optional[Callable[[tuple, object], object]] = None,
) -> None:
    """Register ``spec``'s op and, if it has one, its functional twin: CPU and fake kernels, Functionalize.

    Every callable takes the bound arguments (:func:`bind`) as one tuple ``a``, in schema order:

    * ``validate(a, op)``: every check of the op that reads no tensor data (``op`` names the op or its twin
      in the messages); the fake kernels run it on every call, the CPU kernels once per call signature
      (:class:`ValidationMemo`; the C++ entry of csrc/_entry.cpp for the op itself);
    * ``run(a, checked)``: the CPU computation (usually :func:`cpu_run`), writing the mutated arguments of
      ``a`` in place and returning the op's own outputs (None when the schema returns none); ``checked``
      is what ``validate`` returned;
    * ``twin_outputs(a)``: the buffers the twin writes instead of the mutated arguments, schema order;
      default clones of them (:func:`run_twin`);
    * ``fake_returns(a, checked)``: the op's own outputs on fake tensors; default None.

    The twin returns the op's own outputs, then the new value of each mutated argument (CANN's order,
    ``OpSpec.functional_schema``); its fake returns ``empty_like`` of each mutated argument.
    """
    reg_impl, reg_fake = _registrars(spec.namespace)
    memo = ValidationMemo()
    mutated = spec.mutated_positions

    def first_validation(a: tuple, op: str) -> object:
        checked = validate(a, op)
        warn_strided(op, spec, a)
        return checked

    def op_cpu(*args, **kwargs):
        a = spec.binder(args, kwargs)
        return run(a, memo(spec.name, a, first_validation))

    def op_fake(*args, **kwargs):
        a = spec.binder(args, kwargs)
        checked = validate(a, spec.name)
        return fake_returns(a, checked) if fake_returns else None

    reg_fake(spec.name, op_fake)
    register_cpu(spec, op_cpu)
    if spec.functional is None:
        return

    def twin_cpu(*args, **kwargs):
        a = spec.twin_binder(args, kwargs)
        return run_twin(spec, a, memo(spec.functional, a, first_validation), run, twin_outputs)

    def twin_fake(*args, **kwargs):
        a = spec.twin_binder(args, kwargs)
        checked = validate(a, spec.functional)
        own = own_outputs(fake_returns(a, checked)) if fake_returns else ()
        return own + tuple(torch.empty_like(a[i]) for i in mutated)

    reg_fake(spec.functional, twin_fake)
    reg_impl(spec.functional, "CPU", twin_cpu)
    if spec.namespace == NAMESPACE:
        register_functionalization(spec.name, spec.functional, spec.mutated, spec.num_leading_outputs)

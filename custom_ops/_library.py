"""Shared registration machinery for the ``custom::`` ops.

Every op module (``dsa_plan.py``, ``dsa_serve.py`` ...) uses these helpers so that:

* a schema already present in the process (CANN's ``custom_ops`` extension loaded first) is never
  redefined; we only add the kernels that are missing (CPU, Meta/fake, Functionalize);
* C++ CPU kernels (``csrc/*.cpp``, all ops in one library) are built by ``pip install`` (``setup.py``,
  ``BuildExtension``) and loaded on the first CPU call. Only when that prebuilt library is missing (a
  source checkout without build, another torch version) or ``OFFLOAD_PASSES_JIT_KERNELS=1`` is set are
  they JIT-built with ``torch.utils.cpp_extension.load`` + ninja, cached under ``TORCH_EXTENSIONS_DIR``
  (default ``~/.cache/torch_extensions``). Importing the package never invokes a compiler or loads them.
* ``OFFLOAD_PASSES_CPU_KERNELS=reference`` switches every CPU kernel to the pure-torch reference
  (for machines without a compiler); the default ``cpp`` uses the C++ kernels.

It also holds the small pieces every op's CPU wiring repeats: ``check`` (eager or lazily formatted
message), ``cpu_kernel`` (the resolved C++ entry point, cached), ``dense`` (contiguous copy of a
read-only input, logged once) and ``ValidationMemo`` (skip re-validating a signature that passed).
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

    ``msg`` may be a zero-argument callable: validation runs on every call, so hot paths format the
    message only when the check fails.
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


def dense(t: torch.Tensor, op: str, name: str) -> torch.Tensor:
    """A read-only input of ``custom::<op>`` as a dense tensor. Copying a non-contiguous KV cache every
    call is a silent bandwidth sink, so it is logged (once per op and argument)."""
    if t.is_contiguous():
        return t
    if (op, name) not in _warned_copy:
        _warned_copy.add((op, name))
        logging.getLogger(f"{log.name}.{op}").warning(
            "custom::%s: %s is not contiguous; the CPU kernel copies it on every call", op, name
        )
    return t.contiguous()


_T = TypeVar("_T")


class ValidationMemo:
    """Remembers what validation returned for signatures that passed.

    Validation depends only on shapes, dtypes and the int arguments, and costs more than the kernel
    launch on small inputs, so the CPU kernels skip it for a signature seen before (fake kernels
    always check). Failures are never stored. Bounded: cleared when ``maxsize`` is reached.
    """

    def __init__(self, maxsize: int = 1024) -> None:
        self.maxsize = maxsize
        self._memo: dict[Hashable, object] = {}

    @staticmethod
    def key(op: str, ints: Hashable, tensors: Iterable[torch.Tensor]) -> tuple:
        return (op, ints) + tuple((t.shape, t.dtype) for t in tensors)

    def __call__(self, key: Hashable, validate: Callable[[], _T]) -> _T:
        """The remembered result for ``key``, else ``validate()`` (stored if it returns)."""
        try:
            return self._memo[key]  # type: ignore[return-value]
        except KeyError:
            pass
        result = validate()
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
    """The op's arguments in schema order, defaults filled in.

    The dispatcher hands a Python kernel the keyword-only arguments by name and may leave out those equal
    to their defaults, so kernels written against the schema take ``(*args, **kwargs)`` and bind here.
    """
    params = spec.parsed.arguments
    if len(args) > len(params):
        raise TypeError(f"{spec.qualname}: {len(args)} positional arguments, the schema has {len(params)}")
    out = list(args)
    for p in params[len(args):]:
        if p.name in kwargs:
            out.append(kwargs[p.name])
        elif p.default_value is not None or p.type.kind() == "OptionalType":
            out.append(p.default_value)
        else:
            raise TypeError(f"{spec.qualname}: missing argument {p.name!r}")
    unknown = set(kwargs) - {p.name for p in params}
    if unknown:
        raise TypeError(f"{spec.qualname}: unknown arguments {sorted(unknown)}")
    return tuple(out)


def register_twins(
    spec: "OpSpec",
    *,
    validate: Callable[[tuple, str], object],
    run: Callable[[tuple, object], object],
    cpu_validate: Optional[Callable[[tuple, str], object]] = None,
    twin_outputs: Optional[Callable[[tuple], tuple]] = None,
    fake_returns: Optional[Callable[[tuple, object], object]] = None,
) -> None:
    """Register ``spec``'s op and, if it has one, its functional twin: CPU and fake kernels, Functionalize.

    Every callable takes the bound arguments (:func:`bind`) as one tuple ``a``, in schema order:

    * ``validate(a, op)``: every check of the op (``op`` names the op or its twin in the messages); the
      fake kernels run it on every call;
    * ``cpu_validate(a, op)``: what the CPU kernels run instead (a ``ValidationMemo`` over ``validate``);
      its result is handed to ``run``; default ``validate``;
    * ``run(a, checked)``: the CPU computation, writing the mutated arguments of ``a`` in place and
      returning the op's own outputs (None when the schema returns none);
    * ``twin_outputs(a)``: the buffers the twin writes instead of the mutated arguments, schema order;
      default clones of them (the twin's outputs start from the inputs);
    * ``fake_returns(a, checked)``: the op's own outputs on fake tensors (``checked``: what ``validate``
      returned); default None.

    The twin returns the op's own outputs, then the new value of each mutated argument (CANN's order,
    ``OpSpec.functional_schema``); its fake returns ``empty_like`` of each mutated argument.
    """
    cpu_check = cpu_validate or validate
    mutated = spec.mutated_positions

    def op_cpu(*args, **kwargs):
        a = bind(spec, args, kwargs)
        return run(a, cpu_check(a, spec.name))

    def op_fake(*args, **kwargs):
        a = bind(spec, args, kwargs)
        checked = validate(a, spec.name)
        return fake_returns(a, checked) if fake_returns else None

    register_fake(spec.name, op_fake)
    impl(spec.name, "CPU", op_cpu)
    if spec.functional is None:
        return

    def own_outputs(ret: object) -> tuple:
        return () if ret is None else tuple(ret) if isinstance(ret, (tuple, list)) else (ret,)

    def twin_cpu(*args, **kwargs):
        a = bind(spec, args, kwargs)
        checked = cpu_check(a, spec.functional)
        outs = tuple(twin_outputs(a)) if twin_outputs else tuple(a[i].clone() for i in mutated)
        b = list(a)
        for i, out in zip(mutated, outs):
            b[i] = out
        return own_outputs(run(tuple(b), checked)) + outs

    def twin_fake(*args, **kwargs):
        a = bind(spec, args, kwargs)
        checked = validate(a, spec.functional)
        own = own_outputs(fake_returns(a, checked)) if fake_returns else ()
        return own + tuple(torch.empty_like(a[i]) for i in mutated)

    register_fake(spec.functional, twin_fake)
    impl(spec.functional, "CPU", twin_cpu)
    register_functionalization(spec.name, spec.functional, spec.mutated, spec.num_leading_outputs)

"""Shared pieces of the Triton (CUDA) kernels: triton import, block sizes, bit views, registration.

The kernels move payload rows as raw integer bit patterns (``int16`` for f16/bf16, ``int8`` for int8),
like the C++ twins' ``memcpy``: the copy is bit-exact for every value, NaN included, and runs unchanged
in Triton's interpreter (``TRITON_INTERPRET=1``), which cannot hold bfloat16 in numpy.
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Callable

import torch

log = logging.getLogger("offload_passes.custom_ops.cuda")

INT32_MAX = 2 ** 31 - 1


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (the ``[cuda]`` extra)."""
    return importlib.util.find_spec("triton") is not None


def require_triton():
    """Import triton or raise naming the extra that installs it."""
    if not triton_available():
        raise RuntimeError("offload_passes CUDA kernels need the `triton` package: pip install 'offload_passes[cuda]'")
    import triton  # noqa: F401

    return triton


# Elements per program of the copy kernels' [rows, BLOCK_D] tiles (dsa_serve, dsa_install's copy): 64 per
# thread with 4 warps. The install's copy once took its rows from the record capacity instead (512K
# elements, 87 KB spilled per thread); tests/cuda/test_cuda_compile.py compiles both for sm_90.
COPY_TILE = 8192


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1) (Triton block sizes must be powers of two)."""
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same storage seen as integers of the element's width (payloads are moved bit for bit)."""
    if t.element_size() == 2:
        return t.view(torch.int16)
    if t.element_size() == 1:
        return t.view(torch.int8)
    raise RuntimeError(f"unsupported payload element size {t.element_size()} ({t.dtype})")


def out_buffer(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when dense, else a dense copy the kernel writes (copied back by :func:`commit`)."""
    return t if t.is_contiguous() else t.contiguous()


def commit(dst: torch.Tensor, buf: torch.Tensor) -> None:
    if buf is not dst:
        dst.copy_(buf)


def int32_words(buf: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``buf[:nbytes]`` (1-D int8) as int32 words; a misaligned view is copied first (read-only use)."""
    window = buf[:nbytes]
    if window.storage_offset() % 4 != 0 or not window.is_contiguous():
        window = window.clone()
    return window.view(torch.int32)


# ------------------------------------------------------------------------------ host tensors on CUDA

#: ``(data_ptr, nbytes)`` of host tensors already checked as pinned: ``Tensor.is_pinned()`` asks the CUDA
#: driver on every call, so a launcher asks once per allocation (also keeps the query out of graph capture)
_PINNED: set = set()


def host_operand(t: torch.Tensor, op: str, name: str) -> torch.Tensor:
    """``t`` itself when it may be read or written by a CUDA kernel: a device tensor, or a pinned, dense host
    tensor (its address is valid on the device under unified virtual addressing, docs/cuda.md). Raises
    before any launch otherwise."""
    if t.device.type != "cpu":
        return t
    key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    if key not in _PINNED:
        if not (t.is_contiguous() and t.is_pinned()):
            raise RuntimeError(f"{op}: {name} is a host tensor that is not pinned and contiguous; a CUDA kernel "
                               "reads and writes host caches zero-copy (offload_passes.cuda.place_full_caches)")
        _PINNED.add(key)
    elif not t.is_contiguous():
        raise RuntimeError(f"{op}: {name} is a host tensor that is not contiguous")
    return t


# ------------------------------------------------------------------------------ device error flags

#: Error words kernels set through :func:`error_flags`. ``ERR_GUARD`` holds the largest code
#: (:func:`guard_code`) of an in-graph guard of the ``cuda`` mode that failed; ``ERR_GATHER_TABLE`` starts a
#: record of :data:`GATHER_TABLE_WORDS` words (a block-table entry the baseline gather would dereference out
#: of range: ``cuda/npu_gather_selection_kv_cache.py``, whose module registers how the record reads).
ERR_CACHE_INDEX = 0
ERR_GUARD = 1
ERR_CACHE_POSITION = 2
ERR_GATHER_TABLE = 3
GATHER_TABLE_WORDS = 9
ERR_WORDS = 16
_ERR_TEXT = {
    ERR_CACHE_INDEX: ("offload_ref::npu_mla_prolog_cache_write_", "cache_index had values outside [0, rows): "
                      "those rows were not written"),
    ERR_CACHE_POSITION: ("offload_ref::static_cache_write_", "cache_position had values outside [0, T): "
                         "those positions were not written"),
}
#: first word of a multi-word error record -> (its words, the message of a record whose first word is set)
_RECORDS: dict = {}
_FLAGS: dict = {}
_GUARD_MSGS: list = []


def guard_code(msg: str) -> int:
    """The code (>= 1) of a guard message, stable for the process (what the guard kernel writes)."""
    if msg not in _GUARD_MSGS:
        _GUARD_MSGS.append(msg)
    return _GUARD_MSGS.index(msg) + 1


def error_record(first: int, words: int, message: Callable[[list], str]) -> None:
    """Words ``[first, first + words)`` of the error flags hold one record; ``message(record)`` is its text."""
    _RECORDS[first] = (words, message)


def error_flags(device: torch.device) -> torch.Tensor:
    """The ``int32 [ERR_WORDS]`` error words kernels on ``device`` set (``atomic_max`` to 1, or a record)
    instead of a device-side assert, which would lose the CUDA context. On a CUDA device they live in pinned
    host memory written over UVA: :func:`raise_device_errors` reads them with no copy and no synchronisation,
    so the check is legal between graph replays. Allocated once per device (a stable address for captures)."""
    key = str(device)
    f = _FLAGS.get(key)
    if f is None:
        f = torch.zeros(ERR_WORDS, dtype=torch.int32)
        if device.type == "cuda":
            f = f.pin_memory()
        _FLAGS[key] = f
    return f


def raise_device_errors() -> None:
    """Raise ``RuntimeError`` naming the op for every error word a kernel set since the last call, and clear
    them. What a kernel flags has finished by the time the host sees it; a flag still in flight is reported
    by the next call (one step late)."""
    msgs = []
    for key, f in _FLAGS.items():
        words = f.tolist()
        code = 0
        while code < len(words):
            v = words[code]
            if code in _RECORDS:
                n, message = _RECORDS[code]
                if v:
                    msgs.append(f"{message(words[code:code + n])} (on {key}; checked on the device, reported on the host)")
                code += n
                continue
            if v and code == ERR_GUARD:
                msgs.append(f"{_GUARD_MSGS[v - 1]} (on {key}; checked on the device, reported on the host)")
            elif v:
                op, text = _ERR_TEXT.get(code, (f"error word {code}", "set by a kernel"))
                msgs.append(f"{op} on {key}: {text}")
            code += 1
        if any(words):
            f.zero_()
    if msgs:
        raise RuntimeError("device-side check failed: " + "; ".join(msgs))


# ------------------------------------------------------------------------------ one registration per op

class CudaOp:
    """The CUDA kernels of one op and its functional twin, written once against the op's schema.

    ``spec``: the op's ``OpSpec``. ``validate(a, op)``: the op's checks on the bound arguments ``a``
    (``OpSpec.binder``: schema order, defaults filled in), and whatever the launch needs that depends on
    the call signature only (block sizes, grids, strides); it runs once per signature
    (``_library.ValidationMemo``, the CPU kernels' memo) and what it returns is handed to
    ``launch(a, checked)``, which writes the mutated arguments of ``a`` in place and returns the op's own
    outputs (None when the schema returns none). Checks that read tensor data run in the kernels and set an
    error word (:func:`error_flags`), never a host synchronisation. ``twin_outputs(a)``: the buffers the twin
    writes instead of the mutated arguments (default clones; ``_library.run_twin``). :meth:`run` /
    :meth:`run_functional` take the arguments as the schema does (positional or by name); :meth:`register`
    adds them as the ops' CUDA kernels.
    """

    def __init__(self, spec, validate, launch, twin_outputs=None):
        from .. import _library as L

        self.spec, self.launch, self.twin_outputs = spec, launch, twin_outputs
        self._memo = L.ValidationMemo()
        self._run_twin = L.run_twin

        def first_validation(a: tuple, op: str) -> object:
            checked = validate(a, op)
            L.warn_strided(op, spec, a)  # the launchers copy strided tensors on every call
            return checked

        self.validate = first_validation

    def run(self, *args, **kwargs):
        a = self.spec.binder(args, kwargs)
        return self.launch(a, self._memo(self.spec.name, a, self.validate))

    def run_functional(self, *args, **kwargs) -> tuple:
        spec = self.spec
        a = spec.twin_binder(args, kwargs)
        return self._run_twin(spec, a, self._memo(spec.functional, a, self.validate), self.launch, self.twin_outputs)

    def register(self) -> list:
        """CUDA kernels of the op and its twin (skipped where one is already registered)."""
        from .. import _library as L

        impl = L._registrars(self.spec.namespace)[0]
        pairs = [(self.spec.name, self.run)]
        if self.spec.functional is not None:
            pairs.append((self.spec.functional, self.run_functional))
        return [n for n, fn in pairs if impl(n, "CUDA", fn)]

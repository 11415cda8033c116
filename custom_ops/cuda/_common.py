"""Shared pieces of the Triton (CUDA) kernels: triton import, block sizes, bit views, registration.

The kernels move payload rows as raw integer bit patterns (``int16`` for f16/bf16, ``int8`` for int8),
like the C++ twins' ``memcpy``: the copy is bit-exact for every value, NaN included, and runs unchanged
in Triton's interpreter (``TRITON_INTERPRET=1``), which cannot hold bfloat16 in numpy.
"""
from __future__ import annotations

import importlib.util
import logging

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

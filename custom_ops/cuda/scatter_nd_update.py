"""Triton kernel of ``offload_ref::npu_scatter_nd_update_`` (twin of the CPU kernel in
``custom_ops/cache_write.py``): ``self[tuple(indices[i])] := updates[i]``.

The recipe's graph (``cache_write: inplace``) writes the indexer's key cache, and the int8 indexer's
dequant-scale cache, with this op every decode step (``models/glm/modeling.py`` ``write_key_cache``). One
launch: a program per ``BLOCK_T`` update rows computes each row's flat position in ``self`` from its ``k``
indices (``self`` contiguous; its first ``k`` dims address rows of ``prod(self.shape[k:])`` elements) and
copies the row as raw bits. ``self`` may be a pinned host tensor (the copy is a device store through its
address, as ``cache_write.py``).

Checks: shapes and dtypes on the host, once per signature (the CPU kernel's ``_check_scatter``); the index
ranges on the device: a row with an index outside ``[0, self.shape[d])`` is not written and sets the
``cuda`` mode's guard word with the CPU kernel's message for that dim (raised on the host by
``offload_passes.cuda.raise_device_errors``). Duplicate indices in one call: which row wins is not defined,
as for ``index_put_`` (the model writes distinct slots).
"""
from __future__ import annotations

import math

import torch

from .. import cache_write as M
from .._attention_common import ref_check, ref_qualname
from . import _attention as A
from ._common import CudaOp, guard_code, host_operand, next_pow2, require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402

OP = M.SCATTER
QUALNAME = ref_qualname(OP)
#: index dims ``k`` the kernel takes (scalar arguments); the model uses 2
MAX_DIMS = 4
BLOCK_T = 16
#: elements of a program's copy tile (``BLOCK_T`` rows)
COPY_ELEMS = 8192
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _pick(d: tl.constexpr, a, b, c, e):
    """The ``d``-th of four scalar arguments (``d`` known at compile time)."""
    x = a
    if d == 1:
        x = b
    if d == 2:
        x = c
    if d == 3:
        x = e
    return x


@triton.jit
def _scatter_kernel(idx_ptr, upd_ptr, self_ptr, flag_ptr, NROWS, E, s0, s1, s2, s3, c0, c1, c2, c3,
                    KD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    im = i < NROWS
    r = tl.zeros([BLOCK_T], tl.int64)  # the flat row, Horner over the index dims
    ok = im
    bad = tl.zeros([BLOCK_T], tl.int32)  # the largest code of a dim out of range
    for d in tl.static_range(KD):
        size = _pick(d, s0, s1, s2, s3)
        x = tl.load(idx_ptr + i * KD + d, mask=im, other=0).to(tl.int64)
        out = (x < 0) | (x >= size)
        bad = tl.where(im & out, tl.maximum(bad, _pick(d, c0, c1, c2, c3)), bad)
        r = r * size + x
        ok = ok & ~out
    tl.atomic_max(flag_ptr + i * 0, bad, mask=bad > 0)
    e0 = 0
    while e0 < E:
        e = e0 + tl.arange(0, BLOCK_E)
        m = ok[:, None] & (e[None, :] < E)
        v = tl.load(upd_ptr + i[:, None] * E + e[None, :], mask=m)
        tl.store(self_ptr + r[:, None] * E + e[None, :], v, mask=m)
        e0 += BLOCK_E


def _validate(a: tuple, op: str) -> tuple:
    self, indices, updates = a
    M._check_scatter(self, indices, updates)
    k = indices.size(1)
    ref_check(k <= MAX_DIMS, OP, f"indices' last dim k must be <= {MAX_DIMS} for the CUDA kernel, got {k}")
    sizes = [int(s) for s in self.shape[:k]]
    codes = [guard_code(f"{QUALNAME}: indices[:, {d}] must be in [0, {sizes[d]})") for d in range(k)]
    pad = MAX_DIMS - k
    return tuple(sizes) + (1,) * pad, tuple(codes) + (0,) * pad


def _launch(a: tuple, checked: tuple) -> None:
    self, indices, updates = a
    sizes, codes = checked
    if updates.is_cuda:  # a host destination must be pinned (its address valid on the device)
        host_operand(self, QUALNAME, "self")
    ref_check(self.is_contiguous(), OP, "self must be contiguous on CUDA")
    n = indices.size(0)
    if n == 0:
        return
    E = math.prod(updates.shape[1:])
    bits = _BITS[self.element_size()]
    block_e = max(1, min(next_pow2(E), COPY_ELEMS // BLOCK_T))
    _scatter_kernel[(triton.cdiv(n, BLOCK_T),)](
        indices.contiguous(), updates.contiguous().view(bits), self.view(bits), A.guard_word(updates.device),
        n, E, *sizes, *codes, KD=indices.size(1), BLOCK_T=BLOCK_T, BLOCK_E=block_e)


#: ``offload_ref::npu_scatter_nd_update_`` on CUDA (``_common.CudaOp``: shapes checked once per signature, the
#: index ranges on the device every launch)
KERNELS = CudaOp(M.SCATTER_SPEC, _validate, _launch)
run, register = KERNELS.run, KERNELS.register

"""Pieces the device implementations of the decode-path ops share (``npu_lightning_indexer.py``,
``npu_quant_lightning_indexer.py``, ``npu_sparse_flash_attention.py`` of this folder), as
``custom_ops/_attention_common.py`` is for their CPU references.

* :func:`token_map`: the query-token map of ``_attention_common.token_positions`` inside a kernel
  (``TND``: batch ``b`` = how many cumulative lengths are ``<= t``; ``BSND``: ``t // S``).
* :func:`check_lengths`: the references' data checks of the length tensors, run by one program of a
  kernel. The CPU references raise on them before computing anything; a kernel cannot raise, and a host
  check would read device memory (a synchronisation, no CUDA graph). So a failed check sets the ``cuda``
  mode's guard word (``_common.error_flags``, ``_common.guard_code``) with the reference's own message
  (without the values it quotes), and ``offload_passes.cuda.raise_device_errors`` raises it on the host.
  The kernels never read through a bad id: they mask it.
* :class:`DataChecks`: those messages and their codes, computed once per signature (the validation memo of
  ``_common.CudaOp``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._attention_common import ref_qualname
from ._common import ERR_GUARD, error_flags, guard_code, next_pow2, require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402

#: ``(2**32 - 1)``: the low half of an indexer sort key holds ``LOW - id`` (equal scores: smaller id first)
LOW = tl.constexpr(2 ** 32 - 1)


@dataclass(frozen=True)
class DataChecks:
    """Guard codes (``_common.guard_code``) of one op's data checks for one signature; 0 = not checked."""

    start: int = 0
    cumulative: int = 0
    last: int = 0
    bsnd_lengths: int = 0
    kv_negative: int = 0
    beyond: int = 0
    block: int = 0

    @classmethod
    def of(cls, op: str, *, T: int, S, layout_query: str, has_query_lengths: bool, check_kv_negative: bool,
           lengths_arg: str, maxblk: int, block_size: int, num_blocks: int) -> "DataChecks":
        """The reference's messages (``_attention_common``) for ``op``, prefixed ``offload_ref::<op>: ``."""
        def code(msg: str) -> int:
            return guard_code(f"{ref_qualname(op)}: {msg}")

        tnd = layout_query == "TND"
        return cls(
            start=code("actual_seq_lengths_query must start at >= 0") if tnd else 0,
            cumulative=code("actual_seq_lengths_query must be cumulative (non-decreasing)") if tnd else 0,
            last=code(f"actual_seq_lengths_query[-1] must equal the query token count T={T}") if tnd else 0,
            bsnd_lengths=(code(f"layout_query 'BSND' supports only actual_seq_lengths_query == S={S} for every batch")
                          if not tnd and has_query_lengths else 0),
            kv_negative=code(f"{lengths_arg} must be >= 0") if check_kv_negative else 0,
            beyond=code(f"a position that must be read lies beyond block_table's {maxblk} blocks (block_size "
                        f"{block_size})"),
            block=code(f"block_table holds a block id outside [0, {num_blocks}) for a position that must be read"),
        )

    def args(self) -> tuple:
        return (self.start, self.cumulative, self.last, self.bsnd_lengths, self.kv_negative, self.beyond, self.block)


def guard_word(device: torch.device) -> torch.Tensor:
    """The guard word the kernels set (``atomic_max`` of a code) on ``device`` (pinned host memory on CUDA)."""
    return error_flags(device)[ERR_GUARD:]


def block_b(B: int) -> int:
    return next_pow2(max(B, 1))


@triton.jit
def token_map(t, cu_ptr, B, S, TND: tl.constexpr, BLOCK_B: tl.constexpr):
    """``(b, i, sq)`` of query token ``t`` (int64): its batch row, its position among that row's ``sq`` tokens.
    A token past the last cumulative length (a malformed ``cu``, flagged by :func:`check_lengths`) is
    mapped into row ``B - 1``, so that nothing reads out of range."""
    if TND:
        bi = tl.arange(0, BLOCK_B)
        cu = tl.load(cu_ptr + bi, mask=bi < B, other=0).to(tl.int64)
        b = tl.sum(((cu <= t) & (bi < B)).to(tl.int64), axis=0)
        b = tl.minimum(b, B - 1)
        end = tl.load(cu_ptr + b).to(tl.int64)
        start = tl.load(cu_ptr + tl.maximum(b - 1, 0)).to(tl.int64)
        start = tl.where(b > 0, start, 0)
        i = t - start
        sq = end - start
    else:
        b = t // S
        i = t - b * S
        sq = t * 0 + S
    return b, i, sq


@triton.jit
def check_lengths(cu_ptr, kvlen_ptr, flag_ptr, B, S, T, c_start, c_cum, c_last, c_bsnd, c_kvneg,
                  TND: tl.constexpr, HAS_QLEN: tl.constexpr, HAS_KVLEN: tl.constexpr, BLOCK_B: tl.constexpr):
    """The references' checks of the length tensors (``query_token_map``, ``token_positions``, the indexer's
    ``kv_len >= 0``), each failure setting its code in the guard word. ``c_kvneg == 0``: not checked."""
    bi = tl.arange(0, BLOCK_B)
    bm = bi < B
    if HAS_QLEN:
        cu = tl.load(cu_ptr + bi, mask=bm, other=0).to(tl.int64)
        if TND:
            first = tl.load(cu_ptr).to(tl.int64)
            tl.atomic_max(flag_ptr, c_start, mask=first < 0)
            prev = tl.load(cu_ptr + bi - 1, mask=bm & (bi > 0), other=0).to(tl.int64)
            down = tl.sum((bm & (bi > 0) & (cu < prev)).to(tl.int32), axis=0)
            tl.atomic_max(flag_ptr, c_cum, mask=down > 0)
            last = tl.load(cu_ptr + B - 1).to(tl.int64)
            tl.atomic_max(flag_ptr, c_last, mask=last != T)
        else:
            off = tl.sum((bm & (cu != S)).to(tl.int32), axis=0)
            tl.atomic_max(flag_ptr, c_bsnd, mask=off > 0)
    if HAS_KVLEN:
        kv = tl.load(kvlen_ptr + bi, mask=bm, other=0).to(tl.int64)
        neg = tl.sum((bm & (kv < 0)).to(tl.int32), axis=0)
        tl.atomic_max(flag_ptr, c_kvneg, mask=(neg > 0) & (c_kvneg > 0))

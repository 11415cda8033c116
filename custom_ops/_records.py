"""``install_records`` layout arithmetic, decoder and encoder (docs/ops.md §2.2-2.3, §4.2).

``dsa_plan`` writes, per microtask ``mt = (b*S + s)*8 + m`` (m covers top-k columns
``[m*K/8, (m+1)*K/8)``), a slab of 16-byte records ``[set, id, seq, dst_pos]`` (int32) and a 32-byte
count cell; ``dsa_install`` reads them back. Layout (all offsets relative to ``base``)::

    stride    = align(ceil(K/8)*16, 4096)          # bytes per microtask slab (4096 for every legal K)
    MT        = B*S*8
    rec_bytes = align(MT*stride, 4096)             # records area at [0, rec_bytes)
    cnt_bytes = align(MT*32, 4096)                 # counts at rec_bytes + mt*32 (int32 + 7 zero int32)
    required  = rec_bytes + cnt_bytes
    alloc     = required + 4095                    # what dsa_plan allocates

``base``: the NPU kernels use the first 4096-aligned address inside the buffer, so their layout depends
on the buffer's address (any clone between plan and install corrupts decoding there). **Our CPU kernels
use ``base = 0``** (byte 0 of the tensor), which makes them address independent; every function here
takes ``base`` (default 0) so that an NPU buffer can be decoded too (``npu_base(buf)``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

__all__ = [
    "RecordsLayout",
    "records_layout",
    "npu_base",
    "decode_records",
    "record_counts",
    "encode_records",
    "record_cap",
]

_PAGE = 4096
MICROTASKS = 8  # microtasks per (b, s) work item
RECORD_BYTES = 16  # [set, id, seq, dst_pos] int32
COUNT_BYTES = 32  # int32 count + 7 zero int32


def _align(v, a: int):
    """``ceil(v/a)*a``; works on ints and SymInts (fake kernels)."""
    return ((v + a - 1) // a) * a


@dataclass(frozen=True)
class RecordsLayout:
    """Byte layout of ``install_records`` for one ``(B, S, K)``."""

    B: int
    S: int
    K: int
    stride: int  # bytes per microtask slab
    microtasks: int  # MT = B*S*8
    rec_bytes: int  # records area (counts start here)
    cnt_bytes: int
    required: int  # rec_bytes + cnt_bytes
    alloc: int  # required + 4095 (dsa_plan's allocation)

    @property
    def cap(self) -> int:
        """Records ``dsa_install`` reads at most per microtask: ``min(stride // 16, K)``."""
        return record_cap(self.stride, self.K)


def record_cap(stride: int, K: int) -> int:
    return min(stride // RECORD_BYTES, K)


def records_layout(B, S, K) -> RecordsLayout:
    """Layout for batch ``B``, ``S`` query tokens per row and top-k width ``K`` (ints or SymInts).

    >>> records_layout(4, 4, 2048).alloc
    532479
    """
    stride = _align(((K + 7) // 8) * RECORD_BYTES, _PAGE)
    mt = B * S * MICROTASKS
    rec_bytes = _align(mt * stride, _PAGE)
    cnt_bytes = _align(mt * COUNT_BYTES, _PAGE)
    required = rec_bytes + cnt_bytes
    return RecordsLayout(B, S, K, stride, mt, rec_bytes, cnt_bytes, required, required + _PAGE - 1)


def npu_base(buf: torch.Tensor) -> int:
    """Offset of the first 4096-aligned byte of ``buf`` (the NPU kernels' ``base``)."""
    return (_PAGE - buf.data_ptr() % _PAGE) % _PAGE


def _int32_window(buf: torch.Tensor, base: int, nbytes: int) -> torch.Tensor:
    """``buf[base:base+nbytes]`` reinterpreted as int32 (little-endian; copies if misaligned)."""
    if buf.dtype != torch.int8 or buf.dim() != 1:
        raise RuntimeError(f"install_records must be a 1-D int8 tensor, got {buf.dtype} {tuple(buf.shape)}")
    if base < 0 or base + nbytes > buf.numel():
        raise RuntimeError(
            f"install_records: window [{base}, {base + nbytes}) exceeds the buffer size {buf.numel()}"
        )
    window = buf[base : base + nbytes]
    try:
        return window.view(torch.int32)
    except RuntimeError:  # storage offset not a multiple of 4
        return window.clone().view(torch.int32)


def record_counts(buf: torch.Tensor, B: int, S: int, K: int, base: int = 0) -> torch.Tensor:
    """Raw count cell of every microtask, int32 ``[B*S*8]`` (cheap: reads only the counts area).

    ``record_counts(...).clamp(min=0).sum()`` is the step's number of FULL_OLD_MISS entries (misses).
    """
    lay = records_layout(B, S, K)
    cells = _int32_window(buf, base + lay.rec_bytes, lay.microtasks * COUNT_BYTES)
    return cells.view(lay.microtasks, COUNT_BYTES // 4)[:, 0].clone()


def decode_records(
    buf: torch.Tensor, B: int, S: int, K: int, base: int = 0, clamp_to_cap: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``install_records`` into ``(records, counts)``.

    * ``counts``: int64 ``[B*S*8]``, the raw count cell of every microtask.
    * ``records``: int64 ``[N, 5]`` rows ``(mt, set, id, seq, dst_pos)`` in slab order (mt ascending,
      then record index), reading ``min(max(count, 0), cap)`` records per microtask when
      ``clamp_to_cap`` (what ``dsa_install`` reads), else ``max(count, 0)`` (must fit the slab).
    """
    lay = records_layout(B, S, K)
    words = _int32_window(buf, base, lay.required).to(torch.int64)
    counts = words[lay.rec_bytes // 4 :][: lay.microtasks * 8].view(lay.microtasks, 8)[:, 0].clone()
    n = counts.clamp(min=0)
    slots = lay.stride // RECORD_BYTES
    if clamp_to_cap:
        n = n.clamp(max=lay.cap)
    elif n.numel() and int(n.max()) > slots:
        raise RuntimeError(f"install_records: a count exceeds the slab capacity {slots}")
    slabs = words[: lay.rec_bytes // 4][: lay.microtasks * lay.stride // 4]
    slabs = slabs.view(lay.microtasks, slots, 4)
    take = torch.arange(slots).unsqueeze(0) < n.unsqueeze(1)  # [MT, slots]
    mt_idx = torch.arange(lay.microtasks).unsqueeze(1).expand(-1, slots)[take]
    records = torch.cat([mt_idx.unsqueeze(1), slabs[take]], dim=1)
    return records, counts


def encode_records(
    records: Iterable[Sequence[int]] | torch.Tensor,
    counts: Sequence[int] | torch.Tensor | None,
    B: int,
    S: int,
    K: int,
    base: int = 0,
    size: int | None = None,
) -> torch.Tensor:
    """Build an ``install_records`` buffer (zeros elsewhere) from rows ``(mt, set, id, seq, dst_pos)``.

    Rows of one microtask are stored in the given order. ``counts`` overrides the count cells (to
    write counts that disagree with the stored records, e.g. negative or above the cap); default:
    the number of rows of each microtask. ``size`` defaults to ``alloc`` (plan's allocation).
    """
    lay = records_layout(B, S, K)
    size = lay.alloc if size is None else size
    if base + lay.required > size:
        raise RuntimeError(f"encode_records: base {base} + required {lay.required} > size {size}")
    rows = torch.as_tensor(records, dtype=torch.int64).reshape(-1, 5) if records is not None else None
    buf = torch.zeros(size, dtype=torch.int8)
    words = torch.zeros(lay.required // 4, dtype=torch.int32)
    slots = lay.stride // RECORD_BYTES
    fill = [0] * lay.microtasks
    if rows is not None:
        for mt, st, x, sq, pos in rows.tolist():
            if not 0 <= mt < lay.microtasks or fill[mt] >= slots:
                raise RuntimeError(f"encode_records: microtask {mt} out of range or slab full")
            off = (mt * lay.stride) // 4 + fill[mt] * 4
            words[off : off + 4] = torch.tensor([st, x, sq, pos], dtype=torch.int32)
            fill[mt] += 1
    cnt = torch.as_tensor(fill if counts is None else counts, dtype=torch.int64)
    if cnt.numel() != lay.microtasks:
        raise RuntimeError(f"encode_records: counts needs {lay.microtasks} entries, got {cnt.numel()}")
    cells = words[lay.rec_bytes // 4 :][: lay.microtasks * 8].view(lay.microtasks, 8)
    cells[:, 0] = cnt.to(torch.int32)
    buf[base : base + lay.required] = words.view(torch.int8)
    return buf

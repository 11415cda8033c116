"""Pool geometry checks shared by ``dsa_plan`` and ``dsa_install`` (docs/ops.md §2.1, §4.1).

Both ops address the same per-group pool (``PS`` slots in 16-way sets, ``NS = PS / 16`` sets, one LRU
counter per set), so they must agree on its limits; the checks live here once. ``dsa_serve`` reads the
pool payload only and keeps its own (different) limits.
"""
from __future__ import annotations

import torch

from . import _library as L
from .opspec import SHARED_LIMITS

MAX_POOL = SHARED_LIMITS["MAX_POOL"].value
WAYS = SHARED_LIMITS["WAYS"].value


def check_pool_size(op: str, what: str, PS: int) -> int:
    """Validate the pool size ``PS`` (``what`` names the tensor dim it came from); return ``NS``."""
    L.check(0 < PS <= MAX_POOL, op, f"{what} (PS) must be in (0, {MAX_POOL}], got {PS}")
    L.check(PS % WAYS == 0, op, f"{what} (PS) must be a multiple of {WAYS}, got {PS}")
    NS = PS // WAYS
    L.check(L.is_pow2(NS), op, f"{what} (PS) / 16 (sets) must be a power of two, got {NS}")
    return NS


def check_pool_metadata(
    op: str, B: int, NS: int, id_to_slot: torch.Tensor, lru_counter: torch.Tensor, got: str, b_src: str = ""
) -> int:
    """Validate ``id_to_slot`` ``[B, IR]`` and ``lru_counter`` ``[B, NS]``; return ``IR``.

    ``got`` is the word(s) before the offending shape in the messages (each op keeps its own wording);
    ``b_src`` names the tensor B comes from (appended, so a wrong B names its source too).
    """
    src = f" (B = {b_src})" if b_src else ""
    L.check(
        id_to_slot.dim() == 2 and id_to_slot.size(0) == B,
        op,
        f"id_to_slot must be [B={B}, IR], {got} {tuple(id_to_slot.shape)}{src}",
    )
    IR = id_to_slot.size(1)
    L.check(IR > 0, op, f"id_to_slot dim 1 (id_range) must be > 0, got {IR}")
    L.check(
        lru_counter.dim() == 2 and lru_counter.size(0) == B and lru_counter.size(1) == NS,
        op,
        f"lru_counter must be [B={B}, NS={NS}], {got} {tuple(lru_counter.shape)}{src}",
    )
    return IR

"""The pool geometry, one rule for every user (docs/ops.md §2.1, §4.1, §7).

``dsa_plan`` and ``dsa_install`` address the same per-group pool (``PS`` slots in 16-way sets,
``NS = PS / 16`` sets, one LRU counter per set) and an ``id_to_slot`` table ``IR`` ids wide, so the
ops, the options (``offload_passes/options.py``) and the planning passes (``passes/preconditions.py``,
``passes/frontends/hf/``) must agree on both; :func:`pool_size_problem` and :func:`id_range_for` are the
rule, with the numbers of the install's OpSpec (its ``MAX_POOL`` and ``WAYS`` are the shared limits of
``opspec.SHARED_LIMITS``; ``tests/ops/test_opspec.py`` checks each user binds them). ``dsa_serve`` reads
the pool payload only and keeps its own (different) limits.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _library as L
from .opspec import SHARED_LIMITS

MAX_POOL = SHARED_LIMITS["MAX_POOL"].value
WAYS = SHARED_LIMITS["WAYS"].value
#: Smallest ``id_to_slot`` width: the recipe's ``_DSA_MIN_ID_RANGE`` (docs/ops.md §7); a longer cache
#: widens the table to its length, so every position of the cache has an entry.
MIN_ID_RANGE = 131072


def pool_size_problem(PS: int, selection_block_size: Optional[int] = None) -> Optional[tuple[str, int]]:
    """Why ``PS`` is no valid pool size, as ``(phrase, the value the phrase is about)``; None if it is valid.

    A pool holds ``PS`` slots in (0, MAX_POOL], in sets of ``WAYS`` with a power-of-two number of sets
    (the kernels index a set by masking), and, given ``selection_block_size``, a whole number of
    selection blocks (install copies whole blocks: ``dst = b*(PS//sbs)*sbs + slot``).
    """
    if not 0 < PS <= MAX_POOL:
        return f"must be in (0, {MAX_POOL}]", PS
    if PS % WAYS:
        return f"must be a multiple of {WAYS}", PS
    if not L.is_pow2(PS // WAYS):
        return f"/ {WAYS} (sets) must be a power of two", PS // WAYS
    if selection_block_size and PS % selection_block_size:
        return f"must be a multiple of the selection block size {selection_block_size}", PS
    return None


def id_range_for(cache_len: int, id_range: Optional[int] = None) -> int:
    """The ``id_to_slot`` width ``IR``: ``id_range`` when configured, else ``max(MIN_ID_RANGE, cache_len)``."""
    return id_range if id_range is not None else max(MIN_ID_RANGE, cache_len)


def check_pool_size(op: str, what: str, PS: int) -> int:
    """Validate the pool size ``PS`` (``what`` names the tensor dim it came from); return ``NS``."""
    problem = pool_size_problem(PS)
    L.check(problem is None, op, lambda: f"{what} (PS) {problem[0]}, got {problem[1]}")
    return PS // WAYS


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

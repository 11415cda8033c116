"""The plan kinds: what ``custom::dsa_plan`` says about each top-k entry (docs/ops.md §2.4), one enum for all.

Column 0 of every plan row is one of these; serve, install, the rewrite's statistics and its paged-group
plan, the state's counters, the trace replay, the tools and the benchmarks read them by name. The C++
kernels read ``csrc/plan_kind.h`` (checked against this enum by ``tests/ops/test_plan_kind.py``), the
Triton kernels bind the values as ``tl.constexpr`` globals. Imports nothing (no torch): a tool or a
script can read it alone.
"""
from __future__ import annotations

import enum

__all__ = ["PlanKind", "NUM_PLAN_KINDS", "HEADER"]


class PlanKind(enum.IntEnum):
    """A plan row's source kind (``src_kind``)."""

    #: after a stop inside the microtask (or the previous microtask ended negative); value -1, serve writes zeros
    INVALID = 0
    #: resident and ``id <= max_valid``; value = the pool slot, serve copies the pool row (a hit)
    POOL_HIT = 1
    #: ``id <= max_valid``, not resident; value = the id, serve reads the full cache, install gets a record (a miss)
    FULL_OLD_MISS = 2
    #: ``max_valid < id <= max_sel`` (never cached); value = the id, serve reads the full cache (the window)
    DECODE_WINDOW = 3
    #: ``id > max_sel``, or the row is empty; value = the id, serve writes zeros
    FUTURE_SKIP = 4
    #: the first negative id of the microtask; value = that id, serve writes zeros, the row stops
    NEGATIVE_STOP = 5

#: How many kinds there are (the width of a one-hot count of them).
NUM_PLAN_KINDS = len(PlanKind)

#: The C++ header that mirrors :class:`PlanKind`, relative to this folder.
HEADER = "csrc/plan_kind.h"

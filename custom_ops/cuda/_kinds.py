"""The plan kinds (``custom_ops/plan_kind.py``) as Triton compile-time constants.

A ``@triton.jit`` kernel reads a module global only when it is a ``tl.constexpr``; the plan, serve and
install kernels import these instead of writing the numbers.
"""
from __future__ import annotations

from ..plan_kind import PlanKind
from ._common import require_triton

require_triton()
import triton.language as tl  # noqa: E402

INVALID = tl.constexpr(int(PlanKind.INVALID))
POOL_HIT = tl.constexpr(int(PlanKind.POOL_HIT))
FULL_OLD_MISS = tl.constexpr(int(PlanKind.FULL_OLD_MISS))
DECODE_WINDOW = tl.constexpr(int(PlanKind.DECODE_WINDOW))
FUTURE_SKIP = tl.constexpr(int(PlanKind.FUTURE_SKIP))
NEGATIVE_STOP = tl.constexpr(int(PlanKind.NEGATIVE_STOP))

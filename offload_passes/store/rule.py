"""When reloading a stored prefix beats recomputing it.

A tier's cost to bring back ``n`` tokens of ``b`` bytes each is ``fixed_s + n * b / bytes_per_s``; recomputing
them costs ``prefill_cost(n)``. Reload when the first is smaller. :func:`measure_tier` times a tier's get
(plus the store's verification) at two sizes to fill in a :class:`TierCost`.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

__all__ = ["TierCost", "ReuseRule"]


@dataclass(frozen=True)
class TierCost:
    """Cost of reading from one tier: a fixed part per reload and a bandwidth."""

    fixed_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        for arg in ("fixed_s", "bytes_per_s"):
            v = getattr(self, arg)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"TierCost: {arg} must be a finite number, got {v!r}")
        if self.fixed_s < 0:
            raise ValueError(f"TierCost: fixed_s must be >= 0, got {self.fixed_s}")
        if self.bytes_per_s <= 0:
            raise ValueError(f"TierCost: bytes_per_s must be > 0, got {self.bytes_per_s}")

    def seconds(self, n_bytes: int) -> float:
        return self.fixed_s + n_bytes / self.bytes_per_s


class ReuseRule:
    """Reload a prefix of ``n`` tokens from ``tier`` when ``fixed_s + n * bytes_per_token / bytes_per_s <
    prefill_cost(n)``."""

    def __init__(self, prefill_cost: Callable[[int], float], tiers: Mapping[str, TierCost]) -> None:
        if not callable(prefill_cost):
            raise TypeError(f"ReuseRule: prefill_cost must be a callable n_tokens -> seconds, got {prefill_cost!r}")
        if not isinstance(tiers, Mapping) or not all(isinstance(c, TierCost) for c in tiers.values()):
            raise TypeError("ReuseRule: tiers must be a mapping tier name -> TierCost")
        self.prefill_cost = prefill_cost
        self.tiers = dict(tiers)

    def _cost(self, call: str, tier: str, bytes_per_token: int) -> TierCost:
        if tier not in self.tiers:
            raise KeyError(f"ReuseRule.{call}: tier {tier!r} has no cost; known: {sorted(self.tiers)}")
        if isinstance(bytes_per_token, bool) or not isinstance(bytes_per_token, int) or bytes_per_token <= 0:
            raise ValueError(f"ReuseRule.{call}: bytes_per_token must be a positive int, got {bytes_per_token!r}")
        return self.tiers[tier]

    def reload(self, n_tokens: int, tier: str, bytes_per_token: int) -> bool:
        """True when reloading ``n_tokens`` from ``tier`` is faster than recomputing them."""
        cost = self._cost("reload", tier, bytes_per_token)
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"ReuseRule.reload: n_tokens must be an int >= 0, got {n_tokens!r}")
        if n_tokens == 0:
            return False
        return cost.seconds(n_tokens * bytes_per_token) < float(self.prefill_cost(n_tokens))

    def break_even(self, tier: str, bytes_per_token: int, max_tokens: int = 1 << 24) -> int:
        """The smallest prefix length where reload wins (assuming its margin grows with the length), or
        ``sys.maxsize`` when it does not win up to ``max_tokens``."""
        self._cost("break_even", tier, bytes_per_token)
        hi = 1
        while not self.reload(hi, tier, bytes_per_token):
            if hi >= max_tokens:
                return sys.maxsize
            hi = min(hi * 2, max_tokens)
        lo = hi // 2  # reload(lo) is False (or lo == 0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.reload(mid, tier, bytes_per_token):
                hi = mid
            else:
                lo = mid
        return hi

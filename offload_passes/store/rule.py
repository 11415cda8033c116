"""When reloading a stored prefix beats recomputing it.

A tier's cost to bring back ``n`` tokens of ``b`` bytes each is ``fixed_s + n * b / bytes_per_s``; recomputing
them costs ``prefill_cost(n)``. Reload when the first is smaller. :func:`measure_tier` times a tier's get
(plus the store's verification, or for the RAM tier the one copy into the cache) at two sizes to fill in a
:class:`TierCost`.
"""
from __future__ import annotations

import hashlib
import math
import os
import secrets
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .stats import Decision

if TYPE_CHECKING:
    from .tiers.base import Tier

__all__ = ["TierCost", "ReuseRule", "TierTiming", "measure_tier", "measure_tiers", "fit_prefill_cost"]


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

    def predict(self, n_tokens: int, tier: str, bytes_per_token: int, call: str = "predict") -> tuple[float, float]:
        """(reload seconds from ``tier``, recompute seconds) of a prefix of ``n_tokens``."""
        cost = self._cost(call, tier, bytes_per_token)
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"ReuseRule.{call}: n_tokens must be an int >= 0, got {n_tokens!r}")
        return cost.seconds(n_tokens * bytes_per_token), float(self.prefill_cost(n_tokens))

    def reload(self, n_tokens: int, tier: str, bytes_per_token: int) -> bool:
        """True when reloading ``n_tokens`` from ``tier`` is faster than recomputing them."""
        reload_s, recompute_s = self.predict(n_tokens, tier, bytes_per_token, "reload")
        return n_tokens > 0 and reload_s < recompute_s

    def decide(self, n_tokens: int, tiers: Sequence[str], bytes_per_token: int) -> Decision:
        """The decision for a prefix of ``n_tokens`` whose chunks sit in ``tiers`` (names, repeats allowed): the
        whole prefix is priced at the slowest of those tiers (the one predicting the longest reload), so a mix
        is never predicted cheaper than its worst part."""
        if not tiers:
            raise ValueError("ReuseRule.decide: tiers must name at least one tier")
        preds = {t: self.predict(n_tokens, t, bytes_per_token, "decide") for t in dict.fromkeys(tiers)}
        tier = max(preds, key=lambda t: preds[t][0])
        reload_s, recompute_s = preds[tier]
        return Decision(n_tokens, tier, reload_s, recompute_s, n_tokens > 0 and reload_s < recompute_s)

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


@dataclass(frozen=True)
class TierTiming:
    """Best-of-``repeats`` seconds to put and to get-and-verify one blob of each size, and the fitted cost."""

    tier: str
    put_s: dict
    get_s: dict
    cost: TierCost


def _round_trip(tier: "Tier", key: str, blob: bytes) -> tuple[Any, float, float, bool]:
    """Put ``blob`` (as a held chunk of one uint8 tensor for a tier that keeps chunks), get it back and do what a
    reload does with it: a byte tier's blob is hashed (the store's verification), a held chunk is copied once
    (into the cache). Returns (what put answered, put seconds, get seconds, whether it came back whole)."""
    import torch

    from .chunk import HeldChunk

    keeps = bool(getattr(tier, "keeps_chunks", False))
    item = HeldChunk.own(len(blob), {"x": torch.frombuffer(bytearray(blob), dtype=torch.uint8)}, copy=False) \
        if keeps else blob
    dst = torch.empty(len(blob), dtype=torch.uint8) if keeps else None
    t0 = time.perf_counter()
    kept = tier.put(key, item)
    t1 = time.perf_counter()
    got = tier.get(key)
    if got is not None:
        if keeps:
            dst.copy_(got.tensors["x"])
        else:
            hashlib.sha256(got).digest()
    t2 = time.perf_counter()
    whole = got is item if keeps else got == blob
    return kept, t1 - t0, t2 - t1, whole


def measure_tier(tier: "Tier", sizes: tuple = (1 << 20, 16 << 20), repeats: int = 3) -> TierTiming:
    """Time ``tier`` with random blobs of two ``sizes``: the reload cost (get plus the sha256 the store's
    verification costs; for a tier that keeps verified chunks, get plus the one copy into the cache) fitted as
    ``fixed_s + bytes / bytes_per_s`` through the two points. The blobs are deleted afterwards. A tier that
    does not keep a blob of that size raises ValueError naming the size."""
    if len(sizes) != 2 or not all(isinstance(s, int) and s > 0 for s in sizes) or sizes[0] >= sizes[1]:
        raise ValueError(f"measure_tier: sizes must be two increasing positive ints, got {sizes!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"measure_tier: repeats must be an int >= 1, got {repeats!r}")
    put_s, get_s = {}, {}
    for size in sizes:
        blob = os.urandom(size)
        best_put = best_get = math.inf
        for _ in range(repeats):
            key = secrets.token_hex(32)
            kept, tp, tg, whole = _round_trip(tier, key, blob)
            tier.delete(key)
            if kept is None or not whole:
                raise ValueError(f"measure_tier: tier {tier.name!r} did not keep a blob of {size} bytes")
            best_put, best_get = min(best_put, tp), min(best_get, tg)
        put_s[size], get_s[size] = best_put, best_get
    (s0, s1), (g0, g1) = sizes, (get_s[sizes[0]], get_s[sizes[1]])
    bw = (s1 - s0) / max(g1 - g0, 1e-9)  # the slope; timer noise can make it tiny, never negative
    return TierTiming(tier.name, put_s, get_s, TierCost(max(0.0, g0 - s0 / bw), bw))


def measure_tiers(tiers: Sequence["Tier"], **kw: Any) -> dict[str, TierTiming]:
    """:func:`measure_tier` of each tier, by name (``{n: t.cost}`` builds a :class:`ReuseRule`'s tiers)."""
    return {t.name: measure_tier(t, **kw) for t in tiers}


def best_time(fn: Callable[[], Any], repeats: int = 2) -> float:
    """The shortest of ``repeats`` timed calls of ``fn`` (seconds): the least disturbed by other load."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def fit_prefill_cost(points: Sequence[tuple[int, float]]) -> Callable[[int], float]:
    """``n -> a*n + b*n**2`` through two timed prefills ``[(n1, s1), (n2, s2)]`` (n1 < n2): the linear part
    (projections, experts) and the quadratic part (attention over the prefix). A negative coefficient (timer
    noise) is dropped and the other refitted through the longer point, so the cost never falls as n grows."""
    ok = (isinstance(points, Sequence) and len(points) == 2
          and all(isinstance(p, Sequence) and len(p) == 2 for p in points))
    if ok:
        (n1, s1), (n2, s2) = points
        ok = all(isinstance(n, int) and not isinstance(n, bool) for n in (n1, n2)) and 0 < n1 < n2 and \
            all(isinstance(s, (int, float)) and math.isfinite(s) and s >= 0 for s in (s1, s2))
    if not ok:
        raise ValueError(f"fit_prefill_cost: points must be [(n1, seconds), (n2, seconds)] with 0 < n1 < n2 and "
                         f"finite seconds >= 0, got {points!r}")
    det = n1 * n2 * (n2 - n1)
    a, b = (s1 * n2 * n2 - s2 * n1 * n1) / det, (n1 * s2 - n2 * s1) / det
    if b < 0:
        a, b = s2 / n2, 0.0
    elif a < 0:
        a, b = 0.0, s2 / (n2 * n2)

    def prefill_cost(n: int) -> float:
        return a * n + b * n * n

    prefill_cost.coefficients = (a, b)  # type: ignore[attr-defined]  # reported by the demo
    return prefill_cost

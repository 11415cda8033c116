"""What a :class:`~offload_passes.store.KVStore` did: counters a caller can print or assert on."""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

__all__ = ["StoreStats", "Lookup", "Decision"]


@dataclass(frozen=True)
class Decision:
    """One load's reload-or-recompute decision under a :class:`~offload_passes.store.ReuseRule`: the found
    prefix's ``tokens``, the slowest ``tier`` among its chunks, the predicted seconds of each way, and whether
    it was reloaded."""

    tokens: int
    tier: str
    reload_s: float
    recompute_s: float
    reload: bool


@dataclass
class StoreStats:
    """Counters since the store was built. Per-tier dicts are keyed by tier name.

    ``bytes`` is what each tier holds now; ``chunks_skipped`` counts chunks a put found already stored in
    every tier it writes to; ``chunks_rejected`` counts chunks that failed to verify on load (each ended a
    prefix); ``tier_faults`` counts failed tier calls (the store went on without the tier).
    ``decisions_reload`` / ``decisions_recompute`` count the loads a rule let reload or sent to recompute (a
    store without a rule, or a load that found nothing, decides nothing); ``last_decision`` is the latest."""

    lookups: int = 0
    loads: int = 0
    puts: int = 0
    tokens_loaded: int = 0
    chunks_loaded: dict[str, int] = field(default_factory=dict)
    chunks_stored: dict[str, int] = field(default_factory=dict)
    chunks_promoted: dict[str, int] = field(default_factory=dict)
    chunks_spilled: dict[str, int] = field(default_factory=dict)
    chunks_skipped: int = 0
    chunks_rejected: int = 0
    tier_faults: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    bytes_loaded: dict[str, int] = field(default_factory=dict)
    decisions_reload: int = 0
    decisions_recompute: int = 0
    last_decision: Optional[Decision] = None

    def count(self, counter: str, tier: str, n: int = 1) -> None:
        d = getattr(self, counter)
        d[tier] = d.get(tier, 0) + n

    def as_dict(self) -> dict[str, Any]:
        return copy.deepcopy(asdict(self))


@dataclass(frozen=True)
class Lookup:
    """The longest stored prefix of a token sequence, found without moving data: ``tokens`` is its length,
    ``chunks`` one (key, tier name, n_tokens) per chunk, top-most tier holding it."""

    tokens: int
    chunks: list[tuple[str, str, int]]

"""What a :class:`~offload_passes.store.KVStore` did: counters a caller can print or assert on."""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["StoreStats", "Lookup"]


@dataclass
class StoreStats:
    """Counters since the store was built. Per-tier dicts are keyed by tier name.

    ``bytes`` is what each tier holds now; ``chunks_skipped`` counts chunks a put found already stored in
    every tier it writes to; ``chunks_rejected`` counts chunks that failed to verify on load (each ended a
    prefix); ``tier_faults`` counts failed tier calls (the store went on without the tier)."""

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

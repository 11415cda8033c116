"""The KV store: a request's KV chunks outlive the request in tiers (host RAM, local disk, a shared Mooncake
Store), keyed by the token prefix and the model's :class:`Fingerprint`, so that a resumed conversation or a
shared prefix is reloaded instead of recomputed (docs/store.md).

This package never imports the passes, the tracer or the apps; the serving loop receives a store object.
"""
from .keys import Fingerprint
from .rule import ReuseRule, TierCost
from .stats import Lookup, StoreStats
from .store import KVStore
from .tiers import DiskTier, MooncakeTier, RamTier, Tier, TierFault

__all__ = ["KVStore", "Fingerprint", "RamTier", "DiskTier", "MooncakeTier", "Tier", "TierFault", "Lookup",
           "StoreStats", "ReuseRule", "TierCost"]

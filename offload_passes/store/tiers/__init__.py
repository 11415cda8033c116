"""Storage tiers of the KV store: each keeps key -> bytes within a budget (see :class:`.base.Tier`)."""
from .base import Tier, TierFault
from .disk import DiskTier
from .mooncake import MooncakeTier
from .ram import RamTier

__all__ = ["Tier", "TierFault", "RamTier", "DiskTier", "MooncakeTier"]

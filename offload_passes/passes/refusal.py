"""A refusal: a named reason why a DSA site (or group) is not rewritten, with the node and limit in its detail.

Detection (``passes/frontends/``), the precondition checks (``passes/preconditions.py``) and the pipeline
(``pipeline.py``, ``outcome.py``) all produce and read refusals; the report lists them
(``GraphReport.refusals``); under ``strict=True`` they raise :class:`OffloadRefused`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["Refusal", "OffloadRefused"]


@dataclass
class Refusal:
    reason: str  # a stable code (``raw_seq``, ``pool_size``, ``hf_site_not_verified``, ...)
    detail: str  # what failed: the node or argument and the limit
    layer: Optional[int] = None

    def to_dict(self) -> dict:
        return {"reason": self.reason, "detail": self.detail, "layer": self.layer}


class OffloadRefused(RuntimeError):
    """Raised under ``strict=True`` when a graph with DSA sites cannot be rewritten."""

"""What a graph with DSA sites becomes: :func:`decide`, a pure function of the facts the passes found.

Four outcomes: **rewritten** (the offload in every group that asked for it); **partial** (a front-end that
keeps its rewrite without the offload, ``PartialRefusal.SPARSE_WITHOUT_OFFLOAD``, offloads the groups whose
preconditions pass; a warning unless the refusals are the design); **dense** (unmodified by design: a
prefill, no warning, ``strict`` does not apply); **refused** (unmodified, a warning naming each reason;
``strict`` raises, as it does for a partial graph). The table of cases is ``tests/test_outcome.py``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, Optional

from .passes.frontends.protocol import PartialRefusal, Screening
from .passes.refusal import Refusal

__all__ = ["Verdict", "Facts", "Outcome", "decide", "offload_groups", "DISABLED"]

#: The refusal of a front-end whose rewrite is the offload when the configuration turns the offload off.
DISABLED = Refusal("disabled", "enable_offload / shared_indexer_offload is off in the config")


class Verdict(enum.Enum):
    REWRITTEN = "rewritten"
    PARTIAL = "partial"
    DENSE = "dense"
    REFUSED = "refused"

    @property
    def unmodified(self) -> bool:
        """The graph compiles as it is (no rewrite at all)."""
        return self in (Verdict.DENSE, Verdict.REFUSED)


@dataclass(frozen=True)
class Facts:
    """What the passes found about one graph (with DSA sites), before anything is rewritten."""

    #: what an offload refusal leaves of the front-end's rewrite (``FrontEnd.on_offload_refusal``)
    on_offload_refusal: PartialRefusal
    #: the detection's refusals and notes (``Detection.screening``)
    screening: Screening
    #: ``enable_offload`` and ``shared_indexer_offload`` of the options
    offload_enabled: bool
    #: every group's id, in order
    groups: tuple[int, ...]
    #: the unmet offload preconditions, as the front-end listed them (``PreconditionReport.refusals``)
    offload_refusals: tuple[Refusal, ...] = ()
    #: per group its unmet preconditions (empty: it passes; ``PreconditionReport.by_group``)
    group_refusals: Mapping[int, tuple[Refusal, ...]] = field(default_factory=dict)
    #: the offload refusals are the design, with this detail (``PreconditionReport.by_design``)
    by_design: Optional[str] = None

    @property
    def rewritable(self) -> bool:
        """Screening leaves the graph to the rewrite: the preconditions are worth checking."""
        return not self.screening.blocking and not self.screening.quiet


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    #: the groups that get plan / serve / install
    offload_groups: tuple[int, ...] = ()
    #: ``GraphReport.refusals`` (refused; dense: the quiet notes)
    refusals: tuple[Refusal, ...] = ()
    #: partial: the offload refusals the front-end's own report section lists
    offload_refusals: tuple[Refusal, ...] = ()
    #: ``GraphReport.dense``: ``(reason, detail)``
    dense: Optional[tuple[str, str]] = None
    #: the info line logged (the graph is dense or served without offload by design)
    note: Optional[str] = None
    #: one warning naming :attr:`refusals` (refused) or :attr:`offload_refusals` (partial); ``strict`` raises
    warn: bool = False


def offload_groups(f: Facts) -> tuple[int, ...]:
    """The groups a front-end whose offload was refused somewhere still offloads: every group with no
    refusal of its own (a refusal naming no layer refuses every group, ``PreconditionReport.by_group``)."""
    if not f.group_refusals:  # refusals not attributed to groups: none is proven to pass
        return ()
    return tuple(g for g in f.groups if not f.group_refusals.get(g, ()))


def decide(f: Facts) -> Outcome:
    """The outcome of a graph with DSA sites from the facts ``f`` (see the module doc)."""
    s = f.screening
    partial = f.on_offload_refusal is PartialRefusal.SPARSE_WITHOUT_OFFLOAD
    disabled = () if f.offload_enabled or partial else (DISABLED,)
    if s.blocking:
        if s.dense_by_design is not None:
            return Outcome(Verdict.DENSE, dense=("prefill", s.dense_by_design), note=s.dense_by_design)
        return Outcome(Verdict.REFUSED, refusals=disabled + s.blocking, warn=True)
    if s.quiet:
        return Outcome(Verdict.DENSE, refusals=s.quiet, dense=(s.quiet[0].reason, s.quiet[0].detail),
                       note="; ".join(r.detail for r in s.quiet))
    if disabled:
        return Outcome(Verdict.REFUSED, refusals=disabled, warn=True)
    if not f.offload_enabled:  # sparse only: the offload was not asked for
        return Outcome(Verdict.REWRITTEN)
    if not f.offload_refusals:
        return Outcome(Verdict.REWRITTEN, offload_groups=f.groups)
    if not partial:
        return Outcome(Verdict.REFUSED, refusals=f.offload_refusals, warn=True)
    if f.by_design is not None:
        return Outcome(Verdict.PARTIAL, offload_groups(f), offload_refusals=f.offload_refusals,
                       dense=("prefill", f.by_design), note=f.by_design)
    return Outcome(Verdict.PARTIAL, offload_groups(f), offload_refusals=f.offload_refusals, warn=True)

"""The front-end protocol (:class:`FrontEnd`) and the types its members take and return.

A front-end says how DSA sites look in one form of graph and how a site's attention is emitted; the
pipeline (``pipeline.py``) and the shared rewrite core (``passes/rewrite.py``) do everything else, and
decide from the facts a front-end states what a graph becomes (``outcome.py``). The registry of
front-ends is ``frontends/__init__.py`` (``FRONT_ENDS``); this module imports no front-end, and the
emission helpers a front-end builds with are ``passes/emit.py``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol, Sequence, runtime_checkable

from torch import fx

from ...options import OffloadOptions
from ..emit import GroupNodes, RewriteCtx, SelectionBuffers, SiteEmission
from ..group import Group, GroupedSite, GroupReport
from ..preconditions import GroupGeometry, PreconditionReport
from ..refusal import Refusal

__all__ = ["FrontEnd", "Detection", "Screening", "Summary", "PlanInputs", "PartialRefusal", "PassFiles"]


class PartialRefusal(enum.Enum):
    """What a front-end's rewrite keeps when the offload's preconditions fail but detection succeeded."""

    #: the graph compiles unmodified (the recipe form: its rewrite *is* the offload)
    NOTHING = "nothing"
    #: the sparse attention stays, without the offload (the Hugging Face form: sparse attention is exact)
    SPARSE_WITHOUT_OFFLOAD = "sparse_without_offload"


class PassFiles(NamedTuple):
    """The source file of each front-end pass, relative to ``offload_passes/`` (``GraphReport.passes``)."""

    detect: str
    preconditions: str  # the report names this pass "plan" (``timings["plan_s"]``)
    emit: str


@runtime_checkable
class Detection(Protocol):
    """What the pipeline reads of a front-end's detection report."""

    sites: Sequence[GroupedSite]  # verified sites in graph order (``layer``, ``producer``: the group key)
    refusals: list[Refusal]  # candidates that look like a site but failed a check

    @property
    def has_dsa(self) -> bool:
        """The graph has DSA candidates (sites or refused ones): this front-end owns it."""


class Summary(NamedTuple):
    """A detection's rows of the report."""

    detect: dict[str, Any]  # ``GraphReport.detect``: ``{"gathers", "sites", "indexers", "other_topk"}``
    #: the front-end's own section (``GraphReport.hf``), None when it has none; the pipeline adds
    #: ``offload_refusals`` and, after the rewrite, ``offload`` and ``RewriteReport.extra``
    own: Optional[dict[str, Any]]


@dataclass(frozen=True)
class Screening:
    """What a detection leaves of the graph before any precondition is checked."""

    #: refusals that leave the graph unmodified with a warning (``strict`` raises)
    blocking: tuple[Refusal, ...] = ()
    #: notes that leave the graph unmodified quietly (``GraphReport.dense``: dense by design)
    quiet: tuple[Refusal, ...] = ()
    #: with ``blocking``: the graph is dense by design (a prefill), this detail goes to ``GraphReport.dense``
    #: (reason ``prefill``) and no warning is given, ``strict`` does not apply; None: refused
    dense_by_design: Optional[str] = None


class PlanInputs(NamedTuple):
    """Where a group's plan goes and what it reads that the front-end computes."""

    anchor: fx.Node  # the node the plan (and the new-request invalidation) is inserted before
    lengths: fx.Node  # this step's cache length per row, ``[B]`` int32, emitted before ``anchor``


@runtime_checkable
class FrontEnd(Protocol):
    """One graph form: detection, screening, preconditions, emission, and what a refusal leaves."""

    name: str  # ``GraphReport.frontend``
    files: PassFiles
    #: what an offload precondition that fails leaves of the rewrite
    on_offload_refusal: PartialRefusal

    # -- detection --------------------------------------------------------------------------------
    def detect(self, gm: fx.GraphModule) -> Detection:
        """Every DSA site of the graph (data flow only), and every candidate refused with its reason."""

    def summarise(self, det: Detection) -> Summary:
        """The detection's rows of the report."""

    def screen(self, gm: fx.GraphModule, det: Detection) -> Screening:
        """The detection's refusals: which block the rewrite, which leave the graph dense by design."""

    # -- preconditions ------------------------------------------------------------------------------
    def check_preconditions(self, gm: fx.GraphModule, grp: GroupReport, example_inputs: Sequence[Any],
                            opts: OffloadOptions) -> PreconditionReport:
        """Each group's geometry (pool size, sets, id range) and every unmet limit as a refusal naming a
        layer of its group, through the shared checks of ``passes/preconditions.py``."""

    # -- emission (called by ``passes/rewrite.py::rewrite``) -------------------------------------------
    def plan_inputs(self, ctx: RewriteCtx, grp: Group, p: GroupGeometry) -> PlanInputs:
        """The node the group's plan goes before, and this step's lengths, emitted before it."""

    def selection(self, ctx: RewriteCtx, grp: Group, p: GroupGeometry) -> dict[int, SelectionBuffers]:
        """Per layer the selection buffers serve fills and install reads."""

    def add_guards(self, ctx: RewriteCtx, grp: GroupReport, plans: dict[int, GroupGeometry]) -> None:
        """Front-end specific run-time guards (the shared lengths guard is emitted by the core)."""

    def emit_site(self, ctx: RewriteCtx, grp: Group, gn: Optional[GroupNodes], site: GroupedSite) -> SiteEmission:
        """Layer ``site``: its serve (``gn`` given: the group is offloaded) and the attention."""

    def finish(self, ctx: RewriteCtx) -> dict[str, Any]:
        """After every group: clean-up (e.g. dead dense nodes); extra report facts."""

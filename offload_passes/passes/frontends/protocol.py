"""The front-end protocol (:class:`FrontEnd`) and the types its members take and return.

A front-end says what one form of graph looks like (detection, preconditions) and how a site's attention
is emitted; everything every form does alike is the core's (``pipeline.py``, ``passes/rewrite.py``).
The registry is ``frontends/__init__.py``; this module imports no front-end.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol, Sequence, runtime_checkable

from torch import fx

from ...options import OffloadOptions
from ..emit import GroupNodes, RewriteCtx, SiteEmission
from ..group import Group, GroupedSite, GroupReport
from ..preconditions import PreconditionReport
from ..refusal import Refusal

__all__ = ["FrontEnd", "Detection", "Screening", "Summary", "PartialRefusal", "PassFiles", "pass_files"]


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


@runtime_checkable
class Detection(Protocol):
    """A front-end's detection report, as the core reads it."""

    sites: Sequence[GroupedSite]  # verified sites in graph order (``layer``, ``producer``: the group key)
    refusals: list[Refusal]  # candidates that look like a site but failed a check

    @property
    def has_dsa(self) -> bool:
        """The graph has DSA candidates (sites or refused ones): this front-end owns it."""

    def summary(self) -> Summary:
        """The detection's rows of the report."""

    def screening(self) -> Screening:
        """Which refusals block the rewrite, which notes leave the graph dense by design."""


@runtime_checkable
class FrontEnd(Protocol):
    """One graph form: what it is called, what an offload refusal leaves, detection, preconditions, emission."""

    name: str  # ``GraphReport.frontend``
    #: what an offload precondition that fails leaves of the rewrite
    on_offload_refusal: PartialRefusal

    def detect(self, gm: fx.GraphModule) -> Detection:
        """Every DSA site of the graph (data flow only), and every candidate refused with its reason."""

    def check_preconditions(self, gm: fx.GraphModule, grp: GroupReport, example_inputs: Sequence[Any],
                            opts: OffloadOptions) -> PreconditionReport:
        """Each group's geometry and every unmet limit as a refusal naming a layer of its group, through the
        shared checks of ``passes/preconditions.py``. The geometry also says what the core reads: the
        lengths (or positions) the plan takes, the model's selection buffers (None: scratch), its tables."""

    def emit_site(self, ctx: RewriteCtx, grp: Group, gn: Optional[GroupNodes], site: GroupedSite) -> SiteEmission:
        """Layer ``site``: its serve (``gn`` given: the group is offloaded) and the attention."""

    def finish(self, ctx: RewriteCtx) -> dict[str, Any]:
        """After every group: clean-up (e.g. dead dense nodes); extra report facts."""


def _source(fn: Any) -> str:
    """The file of ``fn``'s module, relative to ``offload_passes/`` (``passes/frontends/recipe.py``)."""
    return fn.__module__.split(".", 1)[1].replace(".", "/") + ".py"


def pass_files(fe: FrontEnd) -> PassFiles:
    """Where ``fe``'s detection, preconditions and emission are written (the modules of its members)."""
    return PassFiles(_source(fe.detect), _source(fe.check_preconditions), _source(fe.emit_site))

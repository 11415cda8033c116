"""Front-ends: the graph forms the passes understand, behind one protocol, :class:`FrontEnd`.

A front-end says how DSA sites look in one form of graph and how a site's attention is emitted; the
pipeline (``pipeline.py``) and the shared rewrite core (``passes/rewrite.py``) do everything else. The
pipeline tries :data:`FRONT_ENDS` in order and the first whose detection finds DSA sites owns the graph:

* ``recipe`` (``frontends/recipe.py``): the graph of cann-recipes' GLM-5.2 modeling (and of models/glm):
  lightning indexer → ``npu_gather_selection_kv_cache`` → sparse flash attention;
* ``hf`` (``frontends/hf/``): transformers' DSA families, a dense attention under a top-k mask, rewritten
  to a sparse attention (with the offload when its preconditions hold).

A third form adds one module implementing :class:`FrontEnd` and one entry in :data:`FRONT_ENDS`;
``tests/passes/test_frontends.py`` checks that every entry implements every member.
"""
from __future__ import annotations

import enum
from typing import Any, NamedTuple, Optional, Protocol, Sequence, runtime_checkable

from torch import fx

from ..group import GroupReport
from ..preconditions import GroupGeometry, PreconditionReport
from ..refusal import Refusal
from ..rewrite import Builder, GroupNodes, RewriteCtx

__all__ = ["FrontEnd", "Detection", "PartialRefusal", "PassFiles", "FRONT_ENDS"]


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

    sites: Sequence[Any]  # verified sites in graph order, each with ``layer`` and ``producer`` (the group key)
    refusals: list[Refusal]  # candidates that look like a site but failed a check

    @property
    def has_dsa(self) -> bool:
        """The graph has DSA candidates (sites or refused ones): this front-end owns it."""


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

    def detect_summary(self, det: Detection) -> dict:
        """``GraphReport.detect``: ``{"gathers", "sites", "indexers", "other_topk"}``."""

    def report_extras(self, det: Detection) -> Optional[dict]:
        """The front-end's own section of the report (``GraphReport.hf``), None when it has none. The
        pipeline adds ``offload_refusals`` and, after the rewrite, ``offload`` and ``RewriteReport.extra``."""

    def screen(self, det: Detection) -> tuple[list[Refusal], list[Refusal]]:
        """``(blocking, quiet)``: refusals that leave the graph unmodified with a warning (``strict`` raises),
        and notes that leave it unmodified quietly (``GraphReport.dense``: dense by design)."""

    def dense_by_design(self, gm: fx.GraphModule, det: Detection, blocking: Sequence[Refusal]) -> Optional[str]:
        """When the graph ``blocking`` refused is dense by design (a prefill), the detail for
        ``GraphReport.dense`` (reason ``prefill``): no warning, ``strict`` does not apply. None: refused."""

    def sparse_by_design(self, det: Detection, offload_refusals: Sequence[Refusal]) -> Optional[str]:
        """Under :attr:`PartialRefusal.SPARSE_WITHOUT_OFFLOAD`: when these offload refusals are the design
        (a prefill of more query tokens than the offload serves), the detail for ``GraphReport.dense``
        (reason ``prefill``); None: they are refusals (a warning; ``strict`` raises)."""

    # -- preconditions ------------------------------------------------------------------------------
    def check_preconditions(self, gm: fx.GraphModule, grp: GroupReport, example_inputs: Sequence[Any],
                            opts: Any) -> PreconditionReport:
        """Each group's geometry (pool size, sets, id range) and every unmet limit as a refusal, through
        the shared checks of ``passes/preconditions.py``."""

    # -- emission (called by ``passes/rewrite.py::rewrite``) -------------------------------------------
    def plan_anchor(self, grp: Any) -> fx.Node:
        """The node the group's plan (and invalidation) is inserted before."""

    def lengths(self, b: Builder, p: GroupGeometry) -> fx.Node:
        """This step's cache length per row, ``[B]`` int32 (emitted before :meth:`plan_anchor`)."""

    def topk(self, b: Builder, p: GroupGeometry) -> fx.Node:
        """The group's top-k as ``[B, S, 1, K]`` int32."""

    def selection(self, ctx: RewriteCtx, grp: Any, p: GroupGeometry) -> dict[int, tuple[fx.Node, fx.Node, fx.Node]]:
        """Per layer the selection buffers serve fills and install reads: ``(kv, rope, block_table)``."""

    def ledger(self, p: GroupGeometry, layer: int) -> Optional[fx.Node]:
        """The model's gather ledger of ``layer`` (``[.., K+1]`` status), or None when it has none."""

    def add_guards(self, ctx: RewriteCtx, grp: GroupReport, plans: dict[int, GroupGeometry]) -> None:
        """Front-end specific run-time guards (the shared lengths guard is emitted by the core)."""

    def emit_site(self, ctx: RewriteCtx, grp: Any, gn: Optional[GroupNodes], site: Any) -> fx.Node:
        """Layer ``site``: its serve (``gn`` given) and the attention; records a ``SiteRewrite`` in
        ``ctx.sites`` / ``gn.by_layer`` and ``ctx.after``; returns the node installs go after."""

    def layer_nodes_before(self, grp: GroupReport) -> dict[int, list[str]]:
        """Per layer the names of the nodes the rewrite replaces (``GraphReport.layer_nodes["before"]``)."""

    def finish(self, ctx: RewriteCtx) -> dict:
        """After every group: clean-up (e.g. dead dense nodes); extra report facts."""


# The registry (after the protocol: the front-end modules read PartialRefusal / PassFiles from here).
from .hf import HF  # noqa: E402
from .recipe import RECIPE  # noqa: E402

#: The front-ends, tried in order; the first whose detection finds DSA sites rewrites the graph.
FRONT_ENDS: tuple[FrontEnd, ...] = (RECIPE, HF)

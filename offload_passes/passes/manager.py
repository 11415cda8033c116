"""The frame of a compile: its context, what a pass is, and the driver that runs a list of passes.

Every pass reads and fills one :class:`CompileContext` and returns a typed report (a dataclass), which the
driver keeps under the pass's name (``ctx.reports``) and times into ``GraphReport.timings[<timing>_s]``.
The list itself is ``pipeline.py``'s (the core's passes) plus the lowering's own (``Lowering.passes``).
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

from torch import fx

from ..options import OffloadOptions
from ..outcome import Outcome
from ..report import GraphReport
from ..state import OffloadState
from . import _fx
from .emit import InstallHook
from .frontends.protocol import Detection, FrontEnd, Screening
from .group import GroupReport
from .preconditions import GroupGeometry, PreconditionReport

__all__ = ["CompileContext", "Pass", "StepPass", "run_passes", "timed", "CORE_TIMINGS"]

log = logging.getLogger("offload_passes.passes.manager")

#: the core passes' timings, in every report (0.0 where the pass did not run)
CORE_TIMINGS = ("detect_s", "group_s", "plan_s", "rewrite_s")


@dataclass
class CompileContext:
    """One compile: the graph and its settings, then what each pass found, in the order they run."""

    gm: fx.GraphModule
    example_inputs: Sequence[Any]
    graph_id: str
    options: OffloadOptions
    report: GraphReport
    #: the state is per-call graph inputs chosen by the caches (CPU, CUDA), else private buffers (NPU)
    state_from_caches: bool = False
    #: the rewrite emits run-time guards (``modes.MODES[mode].guards``)
    in_graph_guards: bool = True
    #: set by a lowering's ``configure``; the rewrite pass hands it each layer's installs
    install_hook: Optional[InstallHook] = None
    # -- filled by the passes --------------------------------------------------------------------
    frontend: Optional[FrontEnd] = None  # detect: the front-end that owns the graph
    detection: Optional[Detection] = None
    groups: Optional[GroupReport] = None  # group
    screening: Optional[Screening] = None  # screen
    preconditions: PreconditionReport = field(default_factory=lambda: PreconditionReport([], []))
    outcome: Optional[Outcome] = None  # decide
    plans: list[GroupGeometry] = field(default_factory=list)  # decide: the groups that get the offload
    state: Optional[OffloadState] = None  # build state
    #: why the core passes stop early (the graph compiles unmodified); None: they go on
    stopped: Optional[str] = None
    reports: dict[str, Any] = field(default_factory=dict)  # pass name -> its report

    @classmethod
    def start(cls, gm: fx.GraphModule, example_inputs: Sequence[Any], graph_id: str, options: OffloadOptions,
              **kw: Any) -> "CompileContext":
        report = GraphReport(graph_id, options.exe_mode, options.to_dict())
        before = _fx.count_ops(gm.graph)
        report.ops = {"before": before, "after": before}  # "after": counted again once rewritten
        report.timings.update(dict.fromkeys(CORE_TIMINGS, 0.0))
        return cls(gm, example_inputs, graph_id, options, report, **kw)

    def use_options(self, options: OffloadOptions) -> None:
        """A lowering's settings for the passes (``Lowering.configure``); the report records them."""
        self.options = options
        self.report.options = options.to_dict()

    def stop(self, why: str) -> None:
        """The core passes end here: the graph stays as it is now."""
        self.stopped = why
        log.debug("%s: %s", self.graph_id, why)


class Pass(Protocol):
    """A step of the compile flow."""

    name: str  # its key in ``CompileContext.reports``
    timing: Optional[str]  # ``GraphReport.timings[<timing>_s]`` (summed); None: not timed

    def applies(self, ctx: CompileContext) -> bool:
        """Whether the pass runs on this compile (what the earlier passes found)."""

    def run(self, ctx: CompileContext) -> Any:
        """Do the step; return its report."""


@dataclass(frozen=True)
class StepPass:
    """A pass made of one function of the context, run on every compile (a lowering's steps)."""

    name: str
    fn: Callable[[CompileContext], Any]
    timing: Optional[str] = None

    def applies(self, ctx: CompileContext) -> bool:
        return True

    def run(self, ctx: CompileContext) -> Any:
        return self.fn(ctx)


def run_passes(ctx: CompileContext, passes: Sequence[Pass]) -> CompileContext:
    """Run each pass that applies, in order."""
    for p in passes:
        if p.applies(ctx):
            with timed(ctx.report, p.timing):
                ctx.reports[p.name] = p.run(ctx)
    return ctx


@contextlib.contextmanager
def timed(report: GraphReport, name: Optional[str]) -> Iterator[None]:
    """Time the block into ``report.timings[name + "_s"]`` (summed over calls) and log it; None: untimed."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if name is not None:
            dt = time.perf_counter() - t0
            report.timings[f"{name}_s"] = report.timings.get(f"{name}_s", 0.0) + dt
            log.debug("%s: %s pass %.2f ms", report.graph_id, name, dt * 1e3)

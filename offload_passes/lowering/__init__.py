"""The lowerings: one per platform of ``modes.MODES`` (``cpu`` for eager / inductor, ``npu`` for
ge_graph / npugraph_ex, ``cuda``), each behind :class:`Lowering`; ``side_stream`` holds the install
schedule the NPU and CUDA lowerings share. The backend core (``backend.py``) does everything else.

Importing this package imports no lowering: ``modes.lowering_for`` imports the one a mode names, so the
NPU lowering's TorchAir / npugraph_ex are needed only when used.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Sequence

from torch import fx

from ..dump import Dumper
from ..options import OffloadOptions
from ..passes.manager import CompileContext, Pass
from ..report import GraphReport
from ..state import OffloadState

__all__ = ["LowerContext", "Lowering"]

log = logging.getLogger("offload_passes.lowering")


@dataclass
class LowerContext:
    """What the core hands a lowering besides the graph (one compile)."""

    graph_id: str
    options: OffloadOptions
    state: Optional[OffloadState]
    report: GraphReport
    dumper: Optional[Dumper]
    kwargs: dict = field(default_factory=dict)  # extra arguments Dynamo passed to the backend
    #: torch.compile's ``mode`` (None: none or "default"); the lowering honours or refuses it
    compile_mode: Optional[str] = None
    final_graph: Optional[fx.Graph] = None  # set by a lowering that runs our reinplace

    @property
    def timings(self) -> dict:
        return self.report.timings

    @property
    def dump_dir(self) -> Optional[Path]:
        return self.dumper.root if self.dumper is not None else None

    def ignore_compile_mode(self) -> None:
        """A lowering whose platform has no use for torch.compile's ``mode`` accepts it with no effect (its
        lowering is the ``exe_mode``): one info line."""
        if self.compile_mode is not None:
            log.info("%s: torch.compile mode=%r has no effect (the lowering is exe_mode=%r)", self.graph_id,
                     self.compile_mode, self.options.exe_mode)


class Lowering(Protocol):
    """One exe_mode's part of the backend: everything else (graph ids, state binding, dumps, reports)
    is the core's. ``lowering.cpu.CpuLowering``, ``lowering.npu.NpuLowering``,
    ``lowering.cuda.CudaLowering`` (duck-typed)."""

    #: the state as per-call graph inputs chosen by the caches (CPU) or as private graph buffers (NPU)
    state_from_caches: bool

    def configure(self, ctx: CompileContext) -> None:
        """Before the passes: the options they read (``ctx.use_options``) and the install hook the rewrite
        hands each layer's installs (``ctx.install_hook``)."""

    def passes(self, ctx: CompileContext) -> list[Pass]:
        """Its own pre-AOT passes, run after the core's on every graph (rewritten or not)."""

    def lower(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: LowerContext) -> Callable:
        """The compiled step; honours or refuses ``ctx.compile_mode`` (torch.compile's ``mode``)."""

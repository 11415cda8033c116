"""The compile flow: one ordered list of passes over a :class:`CompileContext`, for every front-end and mode.

    detect → group → screen → specialise → preconditions → decide → build state → rewrite
           → the lowering's own passes (``Lowering.passes``: side-stream joins, bookkeeping, ...)

Each pass is a small object (``name``, ``timing``, ``applies``, ``run``) returning its typed report; the
driver (``passes/manager.py::run_passes``) runs those that apply, in order, timing each into
``report.timings[<timing>_s]``. A core pass that finds nothing to rewrite stops the core passes
(``CompileContext.stop``): the graph compiles unmodified; the lowering's passes still run. What a graph
becomes (rewritten, partial, dense, refused) is ``outcome.decide``, from the facts the passes found.
"""
from __future__ import annotations

import itertools
import logging
import warnings
from dataclasses import replace
from typing import Any, Optional, Sequence

import torch
from torch import fx

from .modes import MODES
from .options import OffloadOptions
from .outcome import Facts, Outcome, Verdict, decide
from .passes import _fx
from .passes.emit import RewriteSettings
from .passes.frontends import FRONT_ENDS
from .passes.frontends.protocol import Detection, FrontEnd, PassFiles, Screening, pass_files
from .passes.group import Group, GroupReport, group
from .passes.manager import CompileContext, Pass, run_passes
from .passes.preconditions import GroupGeometry, PreconditionReport
from .passes.refusal import OffloadRefused, Refusal
from .passes.rewrite import RewriteReport, rewrite
from .passes.state_build import build_state
from .passes.unserved import unserved_selection
from .report import GraphReport
from .state import OffloadState

log = logging.getLogger("offload_passes.pipeline")

__all__ = ["rewrite_for_offload", "CORE_PASSES", "CompileContext", "Pass", "run_passes", "FRONT_ENDS",
           "OffloadRefused", "OffloadWarning", "new_graph_id", "warn_once"]


class OffloadWarning(UserWarning):
    """A graph compiled without (some of) the offload: issued once per distinct reason, so a user who
    configured no logging sees it (``warnings`` shows it; the ``offload_passes`` loggers say it each time)."""


_warned: set = set()


def warn_once(key: Any, msg: str) -> None:
    """``warnings.warn(msg, OffloadWarning)`` the first time ``key`` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(msg, OffloadWarning, stacklevel=3)


_graph_ids = itertools.count()


def new_graph_id() -> str:
    return f"graph_{next(_graph_ids):03d}"


# ---------------------------------------------------------------------------------------- the passes
class _CorePass:
    """A core pass runs until one of them stops the core passes (``CompileContext.stop``)."""

    name: str
    timing: Optional[str] = None

    def applies(self, ctx: CompileContext) -> bool:
        return ctx.stopped is None


class DetectPass(_CorePass):
    """The front-ends in order (``FRONT_ENDS``); the first whose detection finds DSA candidates owns the graph.
    A graph none owns stops here, refused by name when it holds a selection no front-end serves."""

    name = timing = "detect"

    def run(self, ctx: CompileContext) -> Detection:
        for fe in FRONT_ENDS:
            det = fe.detect(ctx.gm)
            if det.has_dsa:
                break
        report = ctx.report
        if not det.has_dsa:  # the last one's detection summary, the first one's pass list
            report.detect = det.summary().detect
            report.passes = _passes(pass_files(FRONT_ENDS[0]))
            _no_site(ctx)
            return det
        ctx.frontend, ctx.detection = fe, det
        report.frontend = fe.name
        report.passes = _passes(pass_files(fe))
        report.detect, report.hf = det.summary()
        return det


def _no_site(ctx: CompileContext) -> None:
    unserved = unserved_selection(ctx.gm)
    if unserved is not None and ctx.options.enable_offload:
        ctx.report.refusals = [unserved.to_dict()]
        refuse(ctx.graph_id, [unserved], ctx.options.strict, "DSA offload not applied", "compiling the graph unmodified")
        ctx.stop(f"refused: {unserved.reason}")
        return
    ctx.stop("no DSA site in the graph; passing it through")


class GroupPass(_CorePass):
    """Sites sharing one top-k producer form a group (``passes/group.py``)."""

    name = timing = "group"

    def run(self, ctx: CompileContext) -> GroupReport:
        ctx.groups = group(ctx.detection)
        return ctx.groups


class ScreenPass(_CorePass):
    """Which detection refusals block the rewrite, which leave the graph dense by design."""

    name = "screen"

    def run(self, ctx: CompileContext) -> Screening:
        ctx.screening = ctx.detection.screening()
        return ctx.screening


def _rewritable(ctx: CompileContext) -> bool:
    s = ctx.screening
    return ctx.stopped is None and not s.blocking and not s.quiet


def _offload_asked(opts: OffloadOptions) -> bool:
    return opts.enable_offload and opts.shared_indexer_offload


class SpecialisePass(_CorePass):
    """Dynamo's dynamic sizes of the sites (B, S, T, K, ...) become concrete, with guards: the state, its
    selection buffers and the ops' limits are per geometry, so Dynamo recompiles for another one."""

    name = "specialise"

    def applies(self, ctx: CompileContext) -> bool:
        return _rewritable(ctx)

    def run(self, ctx: CompileContext) -> dict:
        spec = _specialise(ctx.detection)
        if spec:
            ctx.report.specialised = spec
            fe_summary = ctx.detection.summary()[1]  # the sites' sizes as the rewrite reads them now
            if ctx.report.hf is not None and fe_summary is not None and "sites" in fe_summary:
                ctx.report.hf["sites"] = fe_summary["sites"]
        return spec


class PreconditionsPass(_CorePass):
    """The front-end's checks of each group's limits and geometry (``FrontEnd.check_preconditions``)."""

    name, timing = "preconditions", "plan"

    def applies(self, ctx: CompileContext) -> bool:
        return _rewritable(ctx) and _offload_asked(ctx.options)

    def run(self, ctx: CompileContext) -> PreconditionReport:
        ctx.preconditions = ctx.frontend.check_preconditions(ctx.gm, ctx.groups, ctx.example_inputs, ctx.options)
        return ctx.preconditions


class DecidePass(_CorePass):
    """What the graph becomes (``outcome.decide``); the refusals and warnings; which groups get the offload.
    A graph left unmodified stops the core passes here."""

    name = "decide"

    def run(self, ctx: CompileContext) -> Outcome:
        facts = _facts(ctx)
        out = decide(facts)
        report = ctx.report
        report.groups = [p.to_dict() for p in ctx.preconditions.groups]
        if out.dense is not None:
            report.dense = {"reason": out.dense[0], "detail": out.dense[1]}
        if out.note is not None:
            log.info("%s: %s", ctx.graph_id, out.note)
        ctx.outcome = out
        if out.verdict.unmodified:
            _unmodified(ctx, out)
        elif out.verdict is Verdict.PARTIAL:
            _partial(ctx, out)
        ctx.plans = [p for p in ctx.preconditions.groups if p.group_id in out.offload_groups]
        return out


def _facts(ctx: CompileContext) -> Facts:
    facts = Facts(ctx.frontend.on_offload_refusal, ctx.screening, _offload_asked(ctx.options),
                  tuple(g.group_id for g in ctx.groups.groups))
    pr = ctx.reports.get("preconditions")
    if pr is None:  # not checked: screening blocked, or the offload was not asked for
        return facts
    return replace(facts, offload_refusals=tuple(pr.refusals), group_refusals=pr.by_group(ctx.groups),
                   by_design=pr.by_design)


def _unmodified(ctx: CompileContext, out: Outcome) -> None:
    if out.refusals:
        ctx.report.refusals = [r.to_dict() for r in out.refusals]
    if out.warn:
        refuse(ctx.graph_id, out.refusals, ctx.options.strict, "DSA offload not applied",
               "compiling the graph unmodified")
    ctx.stop(out.verdict.value)


def _partial(ctx: CompileContext, out: Outcome) -> None:
    """The front-end's rewrite stays, without the offload in some groups."""
    if ctx.report.hf is not None:
        ctx.report.hf["offload_refusals"] = [r.to_dict() for r in out.offload_refusals]
    if out.warn:
        what, fallback = _partial_words(ctx.frontend, ctx.groups, out.offload_groups)
        refuse(ctx.graph_id, out.offload_refusals, ctx.options.strict, what, fallback)


class BuildStatePass(_CorePass):
    """The offload state of the offloaded groups: pools and metadata (``passes/state_build.py``)."""

    name, timing = "build_state", "alloc"

    def applies(self, ctx: CompileContext) -> bool:
        return ctx.stopped is None and bool(ctx.plans)

    def run(self, ctx: CompileContext) -> OffloadState:
        ctx.state = build_state(ctx.gm, ctx.plans, ctx.example_inputs, ctx.graph_id, ctx.state_from_caches)
        return ctx.state


class RewritePass(_CorePass):
    """The rewrite core (``passes/rewrite.py``) through the front-end's ``emit_site``; the report's rows."""

    name = timing = "rewrite"

    def run(self, ctx: CompileContext) -> RewriteReport:
        opts = ctx.options
        settings = RewriteSettings(opts.update_ledger, ctx.in_graph_guards, True, opts.resolved_replacement_policy,
                                   ctx.install_hook)
        rr = rewrite(ctx.gm, ctx.frontend, ctx.groups, ctx.plans, ctx.state, settings)
        _file_rewrite(ctx, rr)
        return rr


def _file_rewrite(ctx: CompileContext, rr: RewriteReport) -> None:
    report, state, grp = ctx.report, ctx.state, ctx.groups
    report.groups = _group_rows(grp, ctx.plans if rr.offload else [], _group_refusals(ctx))
    report.rewritten = True
    report.sites = [s.to_dict() for s in rr.sites]
    report.layer_nodes = {"before": rr.layer_nodes_before, "after": rr.layer_nodes_after}
    report.ops["after"] = _fx.count_ops(ctx.gm.graph)
    report.state = state.describe() if state is not None else []
    report.state_bytes = state.total_bytes if state is not None else 0
    report.buffers = rr.buffers
    report.guards = rr.guards
    if report.hf is not None:
        report.hf.update({"offload": rr.offload, **rr.extra})
    log.info("%s: %s form: rewrote %d DSA layers in %d groups %s%s", ctx.graph_id, ctx.frontend.name, len(rr.sites),
             len(grp.groups), [g.layers for g in grp.groups], "" if rr.offload else " (sparse attention, no offload)")


def _group_refusals(ctx: CompileContext) -> dict[int, tuple[Refusal, ...]]:
    pr = ctx.reports.get("preconditions")
    return pr.by_group(ctx.groups) if pr is not None else {}


#: The core's passes, in order; a backend appends its lowering's (``Lowering.passes``).
CORE_PASSES: tuple[Pass, ...] = (DetectPass(), GroupPass(), ScreenPass(), SpecialisePass(), PreconditionsPass(),
                                 DecidePass(), BuildStatePass(), RewritePass())


def rewrite_for_offload(gm: fx.GraphModule, example_inputs: Sequence[Any], options: OffloadOptions | None = None,
                        graph_id: Optional[str] = None, *, state_from_caches: bool = False,
                        in_graph_guards: Optional[bool] = None,
                        ) -> tuple[fx.GraphModule, Optional[OffloadState], GraphReport]:
    """The core passes on ``gm`` (in place), without a lowering: ``(gm, state, report)``, ``state`` None when
    nothing was offloaded. Raises ``OffloadRefused`` under ``options.strict`` when DSA sites are refused.
    ``state_from_caches``: the state of ``state.REGISTRY`` for the example inputs' caches (passed as graph
    inputs, ``passes/state_inputs.py``), else private buffers; ``in_graph_guards`` defaults to the mode's."""
    opts = options or OffloadOptions()
    guards = MODES[opts.exe_mode].guards if in_graph_guards is None else in_graph_guards
    ctx = CompileContext.start(gm, example_inputs, graph_id or new_graph_id(), opts,
                               state_from_caches=state_from_caches, in_graph_guards=guards)
    with _fx.paused_gc():  # a full sweep of the compiler's heap is never charged to a pass at random
        run_passes(ctx, CORE_PASSES)
    return ctx.gm, ctx.state, ctx.report


def _partial_words(fe: FrontEnd, grp: GroupReport, offloaded: Sequence[int]) -> tuple[str, str]:
    """The warning's subject and fallback for a graph whose offload was refused in some groups: which
    groups (with their layers) keep sparse attention only, which are offloaded."""
    def names(gs: Sequence[Group]) -> str:
        return ", ".join(f"group {g.group_id} (layers {', '.join(map(str, g.layers))})" for g in gs)

    kept = [g for g in grp.groups if g.group_id not in offloaded]
    done = [g for g in grp.groups if g.group_id in offloaded]
    if not done:
        return f"shared-indexer offload not applied to the {fe.name} graph", "sparse attention only"
    return (f"shared-indexer offload not applied to {names(kept)} of the {fe.name} graph",
            f"sparse attention only there; offloaded: {names(done)}")


def _group_rows(grp: GroupReport, plans: Sequence[GroupGeometry],
                refusals: Optional[dict[int, tuple[Refusal, ...]]] = None) -> list[dict]:
    """``GraphReport.groups`` of a rewritten graph: an offloaded group's geometry; a group rewritten without
    the offload (the HF form's sparse attention) its layers and sizes, and the refusals that kept it there
    (``offload_refusals``; empty when the offload was not asked for). ``offload`` says which it is."""
    geo = {p.group_id: p for p in plans}
    rows = []
    for g in grp.groups:
        if g.group_id in geo:
            rows.append({**geo[g.group_id].to_dict(), "offload": True})
        else:
            mine = (refusals or {}).get(g.group_id, ())
            rows.append({**_sparse_row(g), "offload": False, "offload_refusals": [r.to_dict() for r in mine]})
    return rows


def _sparse_row(g: Group) -> dict:
    d = g.owner.dims  # only the HF form rewrites a group without the offload; its sites carry their sizes
    return {"group_id": g.group_id, "owner_layer": g.owner.layer, "layers": g.layers, "topk_node": g.producer.name,
            "K": d["K"], "S": d["S"], "B": d["B"]}


def _specialise(det: Detection) -> dict:
    """Symbolic sizes of the DSA sites -> concrete ints. ``guard_int`` records the guard in Dynamo's
    ShapeEnv, so Dynamo checks it before reusing the graph and recompiles for other sizes."""
    from torch.fx.experimental.symbolic_shapes import guard_int

    done: dict = {}
    for s in det.sites:
        dims = getattr(s, "dims", None)  # the HF form's sites carry their sizes (B, S, T, K, ...)
        if not isinstance(dims, dict):
            continue
        # a grown cache keeps its symbolic length, and the top-k width min(index_topk, length) it bounds
        keep = ("T", "K") if getattr(s, "grown", False) else ()
        for k, v in list(dims.items()):
            if isinstance(v, torch.SymInt) and k not in keep:
                dims[k] = guard_int(v)
                done.setdefault(k, {"symbol": str(v), "value": dims[k]})
    return done


def _passes(files: PassFiles) -> list[dict]:
    """``GraphReport.passes``: each pass and its source file, in the order they run."""
    return [{"name": "detect", "file": files.detect}, {"name": "group", "file": "passes/group.py"},
            {"name": "plan", "file": files.preconditions}, {"name": "rewrite", "file": "passes/rewrite.py"},
            {"name": "emit", "file": files.emit}, {"name": "reinplace", "file": "passes/reinplace.py"}]


def refusal_message(refusals: Sequence[Refusal]) -> str:
    """Each reason once, with its layers and its first detail: ``reason (layers 1, 3): detail``."""
    by: dict[str, list[Refusal]] = {}
    for r in refusals:
        by.setdefault(r.reason, []).append(r)
    parts = []
    for reason, rs in by.items():
        layers = sorted({r.layer for r in rs if r.layer is not None})
        where = f" (layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))})" if layers else ""
        parts.append(f"{reason}{where}: {rs[0].detail}")
    return "; ".join(parts)


def refuse(graph_id: str, refusals: Sequence[Refusal], strict: bool, what: str, fallback: str) -> None:
    """One warning naming each reason once with its layers; ``OffloadRefused`` under strict."""
    msg = f"{graph_id}: {what}: {refusal_message(refusals)}"
    if strict:
        raise OffloadRefused(msg)
    log.warning("%s; %s", msg, fallback)
    warn_once((what, tuple(sorted({r.reason for r in refusals}))), f"{msg}; {fallback} (warned once per reason; "
              "the backend's reports list every graph)")

"""The one orchestrator: detect → group → preconditions → rewrite, for every front-end and every exe_mode.

``rewrite_for_offload(gm, example_inputs, options, install_hook)`` tries the front-ends in order
(``passes/frontends/``, ``FRONT_ENDS``: the recipe form, then the Hugging Face form); the first that finds
DSA sites owns the graph. Preconditions, refusals and ``strict``, state allocation, the shared rewrite core
(``passes/rewrite.py``: guards, new-request invalidation, plan / serve / install, ``replacement_policy``,
``install_hook``) and the report exist once, here; a front-end adds only what its protocol declares
(``frontends/protocol.py::FrontEnd``: detection, screening, preconditions, emission, what a refusal
leaves). :func:`_run` does the passes, direct calls in order, each inside :func:`timed`
(``report.timings[<pass>_s]``, a debug log line), and asks ``outcome.decide`` what the graph becomes
(rewritten, partial, dense, refused) from the facts they found; Python's cyclic GC is paused while they
run (``passes/_fx.paused_gc``: a full sweep of the compiler's heap is never charged to a pass at random).
"""
from __future__ import annotations

import ast
import contextlib
import functools
import itertools
import logging
import re
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import fx

from .options import OffloadOptions
from .outcome import Facts, Verdict, decide
from .passes import _fx
from .passes.emit import InstallHook
from .passes.frontends import FRONT_ENDS
from .passes.frontends.protocol import Detection, FrontEnd
from .passes.group import Group, GroupReport, group
from .passes.preconditions import GroupGeometry, PreconditionReport
from .passes.refusal import OffloadRefused, Refusal
from .passes.rewrite import rewrite
from .passes.state_build import build_state
from .report import GraphReport
from .state import OffloadState

log = logging.getLogger("offload_passes.pipeline")

__all__ = ["rewrite_for_offload", "FRONT_ENDS", "OffloadRefused", "OffloadWarning", "new_graph_id"]


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


def rewrite_for_offload(gm: fx.GraphModule, example_inputs: Sequence[Any], options: OffloadOptions | None = None,
                        install_hook: Optional[InstallHook] = None, graph_id: Optional[str] = None,
                        state_from_caches: bool = False, in_graph_guards: Optional[bool] = None,
                        ) -> tuple[fx.GraphModule, Optional[OffloadState], GraphReport]:
    """Detect, group, check the preconditions of and rewrite ``gm`` in place.

    Returns ``(gm, state, report)``: ``state`` is None when nothing was offloaded. Raises
    ``OffloadRefused`` under ``options.strict`` when there are DSA sites but a precondition fails.
    ``state_from_caches``: take the state from ``state.REGISTRY`` for the example inputs' full caches (the
    caller passes it as graph inputs, ``passes/state_inputs.py``); else the graph gets a private state
    (buffers). ``in_graph_guards`` (default: the mode's ``guards`` flag in ``modes.MODES``) emits the
    run-time checks (``aten._assert_async``; GE has no converter for it).
    """
    opts = options or OffloadOptions()
    if in_graph_guards is None:
        from .modes import MODES

        in_graph_guards = MODES[opts.exe_mode].guards
    with _fx.paused_gc():
        return _run(gm, example_inputs, opts, install_hook, graph_id or new_graph_id(), state_from_caches,
                    in_graph_guards)


@contextlib.contextmanager
def timed(report: GraphReport, name: str) -> Iterator[None]:
    """Time the pass ``name`` into ``report.timings[name + "_s"]`` (summed over calls) and log it."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        dt = time.perf_counter() - t0
        report.timings[f"{name}_s"] = report.timings.get(f"{name}_s", 0.0) + dt
        log.debug("%s: %s pass %.2f ms", report.graph_id, name, dt * 1e3)


def _run(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: OffloadOptions, install_hook: Optional[InstallHook],
         graph_id: str, state_from_caches: bool, in_graph_guards: bool,
         ) -> tuple[fx.GraphModule, Optional[OffloadState], GraphReport]:
    report = GraphReport(graph_id, opts.exe_mode, opts.to_dict())
    report.ops = {"before": _fx.count_ops(gm.graph), "after": None}
    fe: Optional[FrontEnd] = None
    for cand in FRONT_ENDS:
        with timed(report, "detect"):
            det = cand.detect(gm)
        if det.has_dsa:
            fe = cand
            break
    for k in ("group_s", "plan_s", "rewrite_s"):
        report.timings.setdefault(k, 0.0)
    report.ops["after"] = report.ops["before"]
    if fe is None:
        # no front-end owns the graph: the last one's detection summary, the first one's pass list
        report.detect = cand.summarise(det).detect
        report.passes = _passes(FRONT_ENDS[0])
        # a selection no front-end serves: an indexer's part of a step split over graphs (graph breaks), or an
        # attention's own top-k of another shape
        unserved = indexer_without_site(gm) or attention_topk_without_site(gm)
        if unserved is not None and opts.enable_offload:
            report.refusals = [unserved.to_dict()]
            _refuse(graph_id, [unserved], opts.strict, "DSA offload not applied", "compiling the graph unmodified")
            return gm, None, report
        log.debug("%s: no DSA site in the graph; passing it through", graph_id)
        return gm, None, report
    report.frontend = fe.name
    report.passes = _passes(fe)
    report.detect, extras = fe.summarise(det)
    report.hf = extras
    with timed(report, "group"):
        grp = group(det)
    offload_on = opts.enable_offload and opts.shared_indexer_offload
    facts = Facts(fe.on_offload_refusal, fe.screen(gm, det), offload_on, tuple(g.group_id for g in grp.groups))
    pr = PreconditionReport([], [])
    if facts.rewritable:
        # Dynamo's dynamic shapes: the sites' sizes (B, S, T, K, ...) become concrete here, with guards
        # (docs/hf.md "Dynamic shapes"): the offload state, its selection buffers and the ops' limits are
        # per geometry, so the rewritten graph is static and Dynamo recompiles for another geometry.
        spec = _specialise(det)
        if spec:
            report.specialised = spec
        if offload_on:
            with timed(report, "plan"):
                pr = fe.check_preconditions(gm, grp, example_inputs, opts)
            facts = replace(facts, offload_refusals=tuple(pr.refusals), group_refusals=pr.by_group(grp),
                            by_design=pr.by_design)
    report.groups = [p.to_dict() for p in pr.groups]
    out = decide(facts)
    if out.dense is not None:
        report.dense = {"reason": out.dense[0], "detail": out.dense[1]}
    if out.note is not None:
        log.info("%s: %s", graph_id, out.note)
    if out.verdict.unmodified:
        if out.refusals:
            report.refusals = [r.to_dict() for r in out.refusals]
        if out.warn:
            _refuse(graph_id, out.refusals, opts.strict, "DSA offload not applied", "compiling the graph unmodified")
        return gm, None, report
    if out.verdict is Verdict.PARTIAL:  # the front-end's rewrite stays, without the offload in some groups
        if extras is not None:
            extras["offload_refusals"] = [r.to_dict() for r in out.offload_refusals]
        if out.warn:
            what, fallback = _partial_words(fe, grp, out.offload_groups)
            _refuse(graph_id, out.offload_refusals, opts.strict, what, fallback)
    plans = [p for p in pr.groups if p.group_id in out.offload_groups]
    state = None
    if plans:
        with timed(report, "alloc"):
            state = build_state(gm, plans, example_inputs, graph_id, state_from_caches)
    with timed(report, "rewrite"):
        rr = rewrite(gm, fe, grp, plans, state, opts.update_ledger, install_hook, in_graph_guards, True,
                     opts.resolved_replacement_policy)
    report.groups = _group_rows(grp, plans if rr.offload else [], facts.group_refusals)
    report.rewritten = True
    report.sites = [s.to_dict() for s in rr.sites]
    report.layer_nodes = {"before": rr.layer_nodes_before, "after": rr.layer_nodes_after}
    report.ops["after"] = _fx.count_ops(gm.graph)
    report.state = state.describe() if state is not None else []
    report.state_bytes = state.total_bytes if state is not None else 0
    report.buffers = rr.buffers
    report.guards = rr.guards
    if extras is not None:
        extras.update({"offload": rr.offload, **rr.extra})
    log.info("%s: %s form: rewrote %d DSA layers in %d groups %s%s", graph_id, fe.name, len(rr.sites),
             len(grp.groups), [g.layers for g in grp.groups], "" if rr.offload else " (sparse attention, no offload)")
    return gm, state, report


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


#: what names an indexer in a graph: a graph input named after one (Dynamo names inputs by their source:
#: transformers' DSA caches keep ``indexer_keys``, the models an ``indexer`` submodule), or a node traced
#: from code of a class named ``*Indexer`` (the classes models/hf/survey.py counts): its module in
#: ``nn_module_stack``, or (a frame resumed after a graph break has no module stack) the class around a
#: line of its ``stack_trace``
_INDEXER = "indexer"
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


@functools.lru_cache(maxsize=64)
def _class_spans(path: str) -> tuple[tuple[int, int, str], ...]:
    """``(first line, last line, class name)`` of every class in the source file ``path`` (none if unreadable)."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return ()
    return tuple((c.lineno, c.end_lineno or c.lineno, c.name) for c in ast.walk(tree) if isinstance(c, ast.ClassDef))


def _indexer_classes(gm: fx.GraphModule) -> list[str]:
    out: set[str] = set()
    frames: set[tuple[str, int]] = set()
    for n in gm.graph.nodes:
        out.update(name for name in map(_class_name, (n.meta.get("nn_module_stack") or {}).values())
                   if name.endswith("Indexer"))
        frames.update((f, int(line)) for f, line in _FRAME.findall(n.meta.get("stack_trace") or ""))
    for path, line in frames:
        out.update(name for lo, hi, name in _class_spans(path) if lo <= line <= hi and name.endswith("Indexer"))
    return sorted(out)


def indexer_without_site(gm: fx.GraphModule) -> Optional[Refusal]:
    """The ``indexer_split`` refusal of a graph that holds part of an indexer (its cache or its code) but
    no DSA site any front-end detects; None for any other graph."""
    names = [n.name for n in gm.graph.nodes if n.op in ("placeholder", "get_attr") and _INDEXER in n.name.lower()]
    classes = _indexer_classes(gm)
    if not names and not classes:
        return None
    what = f"the indexer's {'code (' + classes[0] + ')' if classes else 'cache ' + names[0]}"
    return Refusal("indexer_split", f"the graph holds {what} but no sparse attention that reads its top-k: the "
                   "decode step is split over several graphs (graph breaks: torch.compile without fullgraph=True, "
                   "or Python that Dynamo cannot trace in one graph), so the indexer and the attention it selects "
                   "for are never in one graph to rewrite; torch.compile(..., fullgraph=True) names the break")


def _class_name(entry: Any) -> str:
    """The class of an ``nn_module_stack`` entry (``(path, class or its qualified name)``)."""
    return entry[1].__name__ if isinstance(entry[1], type) else str(entry[1]).rsplit(".", 1)[-1]


def attention_topk_without_site(gm: fx.GraphModule) -> Optional[Refusal]:
    """The ``attention_topk`` refusal of a graph with no DSA site where an attention module ranks keys with a
    top-k of its own (the innermost module of the ``topk`` node is an ``*Attention`` class; an MoE router's
    top-k sits in its own module); None for any other graph."""
    for n in gm.graph.nodes:
        stack = list((n.meta.get("nn_module_stack") or {}).values())
        if _fx.calls(n, "topk") and stack and _class_name(stack[-1]).endswith("Attention"):
            owner = _class_name(stack[-1])
            return Refusal("attention_topk", f"{owner} selects keys with a top-k of its own ({n.name}), which no "
                           "front-end recognises as an indexer's selection feeding sparse attention: the offload "
                           "serves one indexer top-k per query row, shared by the heads of a group of layers; a "
                           "selection of another shape (per head, over scores the attention computes itself) "
                           "would need a plan per head over its KV heads' caches")
    return None


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
        for k, v in list(dims.items()):
            if isinstance(v, torch.SymInt):
                dims[k] = guard_int(v)
                done.setdefault(k, {"symbol": str(v), "value": dims[k]})
    return done


def _passes(fe: FrontEnd) -> list[dict]:
    """``GraphReport.passes``: each pass and its source file, in the order they run."""
    return [{"name": "detect", "file": fe.files.detect}, {"name": "group", "file": "passes/group.py"},
            {"name": "plan", "file": fe.files.preconditions}, {"name": "rewrite", "file": "passes/rewrite.py"},
            {"name": "emit", "file": fe.files.emit}, {"name": "reinplace", "file": "passes/reinplace.py"}]


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


def _refuse(graph_id: str, refusals: Sequence[Refusal], strict: bool, what: str, fallback: str) -> None:
    """One warning naming each reason once with its layers; ``OffloadRefused`` under strict."""
    msg = f"{graph_id}: {what}: {refusal_message(refusals)}"
    if strict:
        raise OffloadRefused(msg)
    log.warning("%s; %s", msg, fallback)
    warn_once((what, tuple(sorted({r.reason for r in refusals}))), f"{msg}; {fallback} (warned once per reason; "
              "the backend's reports list every graph)")

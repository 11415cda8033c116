"""The ``dsa_offload`` torch.compile backend: detect → group → plan → rewrite → lower.

Design decisions (copied into the README's design section):

1. **Pre-AOT rewrite of the Dynamo graph.** The rewrite inserts *mutating* ops
   (``custom.dsa_plan`` / ``dsa_serve`` / ``dsa_install``) and new state (pools, metadata), so it runs
   on the Dynamo FX graph, where state can be added as buffers of the GraphModule (``get_attr``);
   AOT (``aot_module_simplified``, ``keep_inference_input_mutations=True``) then lifts the buffers as
   inputs and functionalizes the ops through our Functionalize kernels into ``*_functional`` twins +
   ``copy_`` epilogues, with correct mutated-input bookkeeping. A post-AOT rewrite (TorchAir's
   ``post_grad_custom_pre_pass``) would have to introduce input mutations after
   ``mutated_user_inputs`` is computed (spec/torchair.md §2). One backend core for every mode:
   :class:`OffloadBackend` (graph ids, the rewrite :func:`rewrite_for_offload`, state binding and the
   stale-state rule, dumps, reports); the modes differ only in their lowering (:data:`LOWERINGS`:
   ``eager`` / ``inductor`` here, ``ge_graph`` / ``npugraph_ex`` in ``npu_modes.py``, which hands the
   graph to TorchAir / npugraph_ex and whose ``install_hook`` wraps each layer's installs in a
   side-stream scope). ``npu_modes.py`` never imports this module.
2. **Small passes with typed reports**: ``passes/detect.py`` (``DetectReport``), ``group.py``
   (``GroupReport``), ``preconditions.py`` (``PlanReport``), ``rewrite.py`` (``RewriteReport``),
   ``reinplace.py`` (``ReinplaceReport``). This module only chains them and lowers.
3. **Ordering on CPU = program order + data dependencies**: installs are placed after their
   layer's attention, Z's own install before the owner's metadata install; the next step's plan and
   serves belong to the next graph call. That is the join the recipe lacks; NPU modes need events.
4. **State belongs to the model's caches, not to a graph** (``state.py``): pools and metadata are
   extra graph inputs, chosen per call by the identity of the full caches (``StateBinder`` /
   ``state.REGISTRY``): one graph serving two models (or two cache sets) gives each its own state;
   graphs with the same group layout on the same caches share it (warm across recompiles); it is
   freed when the caches die or when no graph uses it. One stale-state rule for every mode: group
   state whose caches were last served by other state is reset before it runs (cold, never stale);
   the NPU modes keep the state as graph buffers and apply the same rule. New requests are detected
   in the graph (a row's length went down, or the model reset its gather ledger: that row's metadata
   is invalidated); ``reset(rows=[...])`` stays for explicitness. Compile-time assumptions (identity
   block tables, lengths within ``[0, min(F, id_range)]``) are checked in the graph every step
   (``aten._assert_async``: a clear RuntimeError, never a wrong step; CPU modes).
5. **Reinplace only graph inputs / state buffers** (never intermediates); what cannot be reinplaced
   stays functional and is reported; tests assert the final graph holds no functional twin and no
   copy of a cache, pool or selection buffer.
6. **Never silently wrong**: any refusal leaves the graph unmodified (it still compiles and runs),
   logs one warning naming the reasons and lands in the report; ``strict=True`` raises instead.
7. **Passes linear in the graph**: one walk per pass plus per-site work on the site's neighbourhood,
   one ``lint`` and one (lazy) ``recompile``; Python's cyclic GC is paused while a pass runs, so a
   full sweep of the compiler's heap (seconds for 78 layers) is never charged to a pass at random.
   ``tests/backend/test_pass_scaling.py`` counts node visits / calls; ``benchmarks/bench_compile.py``
   reports the per-pass times and growth.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import torch
from torch import fx

from . import _compat
from .dump import Dumper
from .options import CPU_EXE_MODES, EXE_MODES, OffloadOptions
from .passes import _fx
from .passes.detect import DetectReport, Refusal, detect
from .passes.group import GroupReport, group
from .passes.preconditions import PlanReport, plan as plan_pass
from .passes.inductor_targets import define_aliases, retarget_for_inductor
from .passes.reinplace import ReinplaceReport, reinplace
from .passes.rewrite import InstallHook, OffloadRefused, rewrite
from .passes.rewrite_hf import rewrite_hf
from .state import REGISTRY, OffloadState, StateBinder, build_state

log = logging.getLogger("offload_passes.backend")

__all__ = ["OffloadBackend", "NpuOffloadBackend", "offload_backend", "make_offload_backend",
           "dsa_offload_backend", "rewrite_for_offload", "OffloadRefused", "LOWERINGS", "LowerContext"]

_graph_ids = itertools.count()
PASS_FILES = {
    "detect": "passes/detect.py", "group": "passes/group.py", "plan": "passes/preconditions.py",
    "rewrite": "passes/rewrite.py", "reinplace": "passes/reinplace.py",
}
NPU_EXE_MODES = ("ge_graph", "npugraph_ex")  # npu_modes.NPU_MODES, without importing it


def _new_graph_id() -> str:
    return f"graph_{next(_graph_ids):03d}"


# ------------------------------------------------------------------------------- the rewrite core
def rewrite_for_offload(gm: fx.GraphModule, example_inputs: Sequence[Any], options: OffloadOptions | None = None,
                        install_hook: Optional[InstallHook] = None, graph_id: Optional[str] = None,
                        shared_state: bool = False,
                        ) -> tuple[fx.GraphModule, Optional[OffloadState], dict]:
    """Detect, group, plan and rewrite ``gm`` in place; the shared core of every exe_mode.

    Returns ``(gm, state, report)``: ``state`` is None when nothing was rewritten. ``report`` is the
    GraphReport dict of docs/ARCHITECTURE.md §5 without the lowering parts. Raises
    ``OffloadRefused`` under ``options.strict`` when there are DSA sites but a precondition fails.
    Every pass is linear in the graph size; the cyclic GC is paused meanwhile (``_fx.paused_gc``).

    ``shared_state``: take the state from ``state.REGISTRY`` for the example inputs' full caches (graphs
    on the same caches share it; the caller passes it as graph inputs, see ``state_as_inputs``); else
    the graph gets a private state (buffers). Either way ``state.layouts`` / ``state.cache_refs`` say
    how to build a :class:`~offload_passes.state.StateBinder` for it. In-graph run-time guards are
    emitted for the CPU modes only (GE has no converter for ``aten._assert_async``).
    """
    with _fx.paused_gc():
        return _rewrite_for_offload(gm, example_inputs, options or OffloadOptions(), install_hook,
                                    graph_id or _new_graph_id(), shared_state)


def _base_report(graph_id: str, opts: OffloadOptions, det: DetectReport, pr: PlanReport, refusals: list,
                 ops_before: dict, timings: dict) -> dict:
    """The GraphReport of a graph before (or without) its rewrite."""
    return {
        "graph_id": graph_id, "rewritten": False, "mode": opts.exe_mode, "options": opts.to_dict(),
        "groups": [p.to_dict() for p in pr.groups], "sites": [],
        "layer_nodes": {"before": {}, "after": {}}, "ops": {"before": ops_before, "after": ops_before},
        "state": [], "refusals": [r.to_dict() for r in refusals], "timings": timings,
        "passes": [{"name": k, "file": v} for k, v in PASS_FILES.items()],
        "detect": {"gathers": det.gathers, "sites": len(det.sites), "indexers": det.indexers,
                   "other_topk": det.other_topk},
    }


def _refusals(det: DetectReport, pr: PlanReport, opts: OffloadOptions) -> list[Refusal]:
    refusals: list[Refusal] = list(det.refusals) + list(pr.refusals)
    if det.has_dsa and not (opts.enable_offload and opts.shared_indexer_offload):
        refusals.insert(0, Refusal("disabled", "enable_offload / shared_indexer_offload is off in the config"))
    return refusals


def _refuse(graph_id: str, refusals: list[Refusal], strict: bool) -> None:
    """One warning naming the reasons (the graph compiles unmodified); ``OffloadRefused`` under strict."""
    reasons = sorted({r.reason for r in refusals})
    msg = (f"{graph_id}: DSA offload not applied ({', '.join(reasons)}): "
           + "; ".join(r.detail for r in refusals[:4]) + (" ..." if len(refusals) > 4 else ""))
    if strict:
        raise OffloadRefused(msg)
    log.warning("%s; compiling the graph unmodified", msg)


def _rewrite_for_offload(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: OffloadOptions,
                         install_hook: Optional[InstallHook], graph_id: str, shared_state: bool,
                         ) -> tuple[fx.GraphModule, Optional[OffloadState], dict]:
    t: dict = {}
    t0 = time.perf_counter()
    ops_before = _fx.count_ops(gm.graph)
    det = detect(gm)
    t["detect_s"] = time.perf_counter() - t0
    if not det.has_dsa:  # no recipe-form site: the Hugging Face dense form? (passes/rewrite_hf.py)
        hf = rewrite_hf(gm, example_inputs, opts, graph_id, t, ops_before, shared_state)
        if hf is not None:
            return hf
    t1 = time.perf_counter()
    grp = group(det)
    t["group_s"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    pr = plan_pass(gm, grp, example_inputs, opts)
    t["plan_s"] = time.perf_counter() - t1
    refusals = _refusals(det, pr, opts)
    report = _base_report(graph_id, opts, det, pr, refusals, ops_before, t)
    t["rewrite_s"] = 0.0
    if not det.has_dsa:
        log.debug("%s: no DSA gather in the graph; passing it through", graph_id)
        return gm, None, report
    if refusals:
        _refuse(graph_id, refusals, opts.strict)
        return gm, None, report
    t1 = time.perf_counter()
    state = build_state(gm, pr.groups, example_inputs, graph_id, shared_state)
    t["alloc_s"] = time.perf_counter() - t1  # zero-filling pools: memory bandwidth, not pass work
    _apply_rewrite(gm, grp, pr, state, opts, install_hook, report)
    return gm, state, report


def _apply_rewrite(gm: fx.GraphModule, grp: GroupReport, pr: PlanReport, state: OffloadState,
                   opts: OffloadOptions, install_hook: Optional[InstallHook], report: dict) -> None:
    t1 = time.perf_counter()
    rr = rewrite(gm, grp, pr, state, update_ledger=opts.update_ledger, install_hook=install_hook,
                 in_graph_guards=opts.exe_mode in CPU_EXE_MODES, replacement_policy=opts.replacement_policy)
    report["timings"]["rewrite_s"] = time.perf_counter() - t1
    report.update({
        "rewritten": True,
        "sites": [s.to_dict() for s in rr.sites],
        "layer_nodes": {"before": rr.layer_nodes_before, "after": rr.layer_nodes_after},
        "ops": {"before": report["ops"]["before"], "after": _fx.count_ops(gm.graph)},
        "state": state.describe(),
        "state_bytes": state.total_bytes,
        "buffers": rr.buffers,
        "guards": rr.guards,
    })
    log.info("%s: rewrote %d DSA layers in %d groups %s", report["graph_id"], len(rr.sites), len(pr.groups),
             [p.layers for p in pr.groups])


# ---------------------------------------------------------------------------- the CPU lowerings
class _ReinplacePass:
    """Inductor ``post_grad_custom_pre_pass``: our reinplace, with a stable uuid for the FX cache."""

    def __init__(self, on_graph: Callable[[fx.Graph, str], None]):
        self.on_graph = on_graph

    def __call__(self, graph: fx.Graph) -> None:
        self.on_graph(graph, "functional")
        self.on_graph(graph, "reinplace")

    def uuid(self) -> str:
        h = hashlib.sha256()
        for f in ("reinplace.py", "inductor_targets.py"):
            h.update((Path(__file__).parent / "passes" / f).read_bytes())
        return h.hexdigest()


def _custom_op_overloads() -> list:
    """The default overloads of our ``custom::`` ops (custom_ops.CUSTOM_OPS)."""
    from .custom_ops import CUSTOM_OPS

    return [getattr(torch.ops.custom, name).default for name in CUSTOM_OPS]


def _inductor_pass(on_graph: Callable[[fx.Graph, str], None]):
    CustomGraphPass = _compat.custom_graph_pass_base()

    class ReinplaceGraphPass(_ReinplacePass, CustomGraphPass):
        pass

    return ReinplaceGraphPass(on_graph)


def state_as_inputs(gm: fx.GraphModule, state: OffloadState) -> tuple[fx.GraphModule, list[str]]:
    """A copy of ``gm`` whose state buffers (``_offload_<name>``, ``name`` in ``state.tensors()``) are
    graph inputs appended after the original ones; returns it and the state names in input order.

    A copy: Dynamo keeps using its own graph's placeholders after the backend returns. The buffers are
    removed from ``gm`` so that no compiled artifact holds the pools (they live with the caches).
    """
    names = list(state.tensors())
    attrs = {f"_offload_{n}": n for n in names}
    g = fx.Graph()
    g._codegen = gm.graph._codegen
    env: dict = {}
    out = g.graph_copy(gm.graph, env)
    g.output(out)
    used = _attrs_to_placeholders(g, attrs, state)
    for old, copied in env.items():
        if old.op == "placeholder" and hasattr(old, "_dynamo_source"):
            copied._dynamo_source = old._dynamo_source  # AOT reads Dynamo's metadata (static shapes)
    new = fx.GraphModule(gm, g)
    new.meta.update(gm.meta)
    for a in attrs:
        gm._buffers.pop(a, None)
        if hasattr(gm, "_param_name_to_source"):
            gm._param_name_to_source.pop(a, None)
    if hasattr(gm, "_param_name_to_source"):
        new._param_name_to_source = {k: v for k, v in gm._param_name_to_source.items()
                                     if hasattr(new, k.split(".")[0])}
    return new, used


def _attrs_to_placeholders(g: fx.Graph, attrs: dict[str, str], state: OffloadState) -> list[str]:
    """Replace the ``get_attr`` of each state buffer by a new last placeholder; the state names in order."""
    last = [n for n in g.nodes if n.op == "placeholder"][-1]
    used: list[str] = []
    for n in list(g.nodes):
        if n.op == "get_attr" and n.target in attrs:
            name = attrs[n.target]
            with g.inserting_after(last):
                ph = g.placeholder(f"offload_{name}")
            ph._dynamo_source = None  # not a user value: no Dynamo source, no guard
            t = state.tensors()[name]
            ph.meta["example_value"] = torch.empty_like(t, device="meta")
            n.replace_all_uses_with(ph)
            g.erase_node(n)
            last = ph
            used.append(name)
    return used


def _static_fakes(example_inputs: Sequence[Any], tensors: Sequence[torch.Tensor]) -> list:
    """``tensors`` as static-shape fake tensors of the compile's fake mode (AOT would otherwise make
    the extra state inputs dynamic), or as they are outside a fake mode."""
    fm = _compat.detect_fake_mode(example_inputs)
    if fm is None:
        return list(tensors)
    return [fm.from_tensor(t, static_shapes=True) for t in tensors]


@dataclass
class LowerContext:
    """What the core hands a lowering besides the graph (one compile)."""

    graph_id: str
    options: OffloadOptions
    state: Optional[OffloadState]
    report: dict
    dumper: Optional[Dumper]
    kwargs: dict = field(default_factory=dict)  # extra arguments Dynamo passed to the backend
    final_graph: Optional[fx.Graph] = None  # set by a lowering that runs our reinplace

    @property
    def timings(self) -> dict:
        return self.report["timings"]

    @property
    def dump_dir(self) -> Optional[Path]:
        return self.dumper.root if self.dumper is not None else None


class Lowering(Protocol):
    """One exe_mode's part of the backend: everything else (graph ids, state binding, dumps, reports)
    is the core's. CPU: :class:`CpuLowering`; NPU: ``npu_modes.NpuLowering`` (duck-typed: that module
    never imports this one)."""

    #: the state as per-call graph inputs chosen by the caches (CPU) or as private graph buffers (NPU)
    shared_state: bool

    def prepare(self, options: OffloadOptions, graph_id: str, install_hook: Optional[InstallHook]
                ) -> tuple[OffloadOptions, Optional[InstallHook]]: ...

    def after_rewrite(self, gm: fx.GraphModule, state: Optional[OffloadState], report: dict,
                      options: OffloadOptions, install_hook: Optional[InstallHook]) -> None: ...

    def lower(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: LowerContext) -> Callable: ...


class CpuLowering:
    """``eager`` (AOT + our reinplace, run op by op) and ``inductor`` (our reinplace as Inductor's
    ``post_grad_custom_pre_pass``, in-place custom ops retargeted to their ``offload_inductor::`` aliases)."""

    shared_state = True

    def __init__(self, mode: str):
        if mode not in CPU_EXE_MODES:
            raise ValueError(f"exe_mode must be one of {CPU_EXE_MODES} for the CPU lowering, got {mode!r}")
        self.mode = mode

    def prepare(self, options: OffloadOptions, graph_id: str, install_hook: Optional[InstallHook]
                ) -> tuple[OffloadOptions, Optional[InstallHook]]:
        return options, install_hook

    def after_rewrite(self, gm: fx.GraphModule, state: Optional[OffloadState], report: dict,
                      options: OffloadOptions, install_hook: Optional[InstallHook]) -> None:
        return None

    def lower(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: LowerContext) -> Callable:
        timings, report = ctx.timings, ctx.report
        if not report["detect"]["gathers"] or (ctx.state is None and self.mode == "eager"):
            # untouched: no DSA at all, or refused (the model's own in-place ops run as written)
            timings["aot_s"] = 0.0
            timings["reinplace_s"] = 0.0
            return gm.forward
        rinfo: dict = {}
        on_graph = self._on_graph(ctx, rinfo)
        if self.mode == "eager":
            fn = _lower_eager(gm, example_inputs, on_graph, timings)
        else:
            fn = _lower_inductor(gm, example_inputs, on_graph, timings)
        if "report" in rinfo:
            report["reinplace"] = rinfo["report"].to_dict()
            report["ops"]["after"] = rinfo["ops_after"]
            ctx.final_graph = rinfo["final_graph"]
        elif ctx.state is not None and self.mode == "inductor":
            report["reinplace"] = {"cached": True}
        return fn

    @staticmethod
    def _on_graph(ctx: LowerContext, rinfo: dict) -> Callable[[fx.Graph, str], None]:
        """The post-AOT callback: dump the functional graph, reinplace it, dump the result."""
        def on_graph(graph: fx.Graph, stage: str) -> None:
            if stage == "functional":
                if ctx.dumper:
                    ctx.dumper.graph(ctx.graph_id, "functional", graph)
                rinfo["t0"] = time.perf_counter()
                return
            with _fx.paused_gc():
                rep: ReinplaceReport = reinplace(graph)
            ctx.timings["reinplace_s"] = time.perf_counter() - rinfo.pop("t0")
            rinfo.update(report=rep, ops_after=_fx.count_ops(graph), final_graph=graph)
            if ctx.dumper:
                ctx.dumper.graph(ctx.graph_id, "reinplace", graph)

        return on_graph


def _lower_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], on_graph, timings: dict) -> Callable:
    aot_module_simplified, make_boxed_func = _compat.aot_module_simplified(), _compat.make_boxed_func()

    def inner(fx_gm: fx.GraphModule, ex: Sequence[Any]):
        timings["aot_s"] = time.perf_counter() - t0
        on_graph(fx_gm.graph, "functional")
        on_graph(fx_gm.graph, "reinplace")
        fx_gm.recompile()
        return make_boxed_func(fx_gm.forward)

    t0 = time.perf_counter()
    return aot_module_simplified(gm, example_inputs, fw_compiler=inner, inference_compiler=inner,
                                 keep_inference_input_mutations=True)


def _lower_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], on_graph, timings: dict) -> Callable:
    compile_fx = _compat.inductor_compile_fx()

    t0 = time.perf_counter()

    def hook(graph: fx.Graph, stage: str) -> None:
        if stage == "functional":
            timings["aot_s"] = time.perf_counter() - t0
        on_graph(graph, stage)
        if stage == "reinplace":  # in-place custom ops as every Inductor version runs them
            retarget_for_inductor(graph)

    define_aliases(_custom_op_overloads())  # a warm FX-graph cache calls them without our pass
    kw = {}
    if not _compat.inductor_lowers_assert_async():  # torch 2.8: keep the guards (see inductor_targets)
        kw["decompositions"] = _compat.inductor_decompositions_keeping_asserts()
    return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_pre_pass": _inductor_pass(hook)},
                      **kw)


def _npu_lowering(mode: str, **npu_kw: Any) -> Lowering:
    from .npu_modes import NpuLowering  # lazy: the NPU modes' glue is only needed for them

    return NpuLowering(mode, **npu_kw)


def _cpu_lowering(mode: str, **npu_kw: Any) -> Lowering:
    given = sorted(k for k, v in npu_kw.items() if v not in (None, {}, True))
    if given:
        raise ValueError(f"{given} only apply to the NPU exe_modes {NPU_EXE_MODES}, not {mode!r}")
    return CpuLowering(mode)


#: exe_mode -> lowering factory ``(mode, compiler_config=, npu_options=, side_stream=) -> Lowering``.
LOWERINGS: dict[str, Callable[..., Lowering]] = {
    "eager": _cpu_lowering, "inductor": _cpu_lowering, "ge_graph": _npu_lowering, "npugraph_ex": _npu_lowering,
}


# ---------------------------------------------------------------------------------- the backend
class _Compiled:
    """What Dynamo calls: picks the offload state for the call's caches (``StateBinder``: per-call
    inputs, or the graph's own buffers after the stale-state rule), then runs."""

    def __init__(self, fn: Callable, binder: Optional[StateBinder], backend: "OffloadBackend", graph_id: str):
        self.fn = fn
        self.binder = binder  # owns a private state: the backend holds it weakly
        self.backend_ref = weakref.ref(backend)
        self.graph_id = graph_id
        if binder is not None and binder.input_names is not None:
            weakref.finalize(self, REGISTRY.drop_graph, graph_id)

    def __call__(self, *args: Any) -> Any:
        b = self.binder
        if b is None:
            return self.fn(*args)
        extra = b.extra_inputs(args)
        be = self.backend_ref()
        if be is not None:
            be._last = weakref.ref(b)
        return self.fn(*args, *extra)


class OffloadBackend:
    """A Dynamo backend instance: ``torch.compile(model, backend=OffloadBackend(pool_size=...))``; the one
    core of every exe_mode (the modes differ only in their lowering, :data:`LOWERINGS`).

    Exposes ``state`` (the state of the most recently run rewritten graph), ``states`` (all live
    ones), ``reports`` (GraphReport dicts), ``reset_state(rows=None)``. NPU modes also take
    ``compiler_config`` (``torchair.CompilerConfig`` / ``npugraph_ex.CompilerConfig``), ``npu_options``
    (npugraph_ex options) and ``side_stream`` (installs on a side stream, default); with ``dump_dir``
    ge_graph also writes TorchAir's GE graph dump ``<dump_dir>/<graph_id>/dynamo_optimized_*.txt``.
    """

    #: the exe_modes this class accepts (all of them; :class:`NpuOffloadBackend` narrows it)
    modes: tuple[str, ...] = EXE_MODES

    def __init__(self, options: OffloadOptions | Mapping | str | Path | None = None, *,
                 compiler_config: Any = None, npu_options: Optional[Mapping[str, Any]] = None,
                 side_stream: bool = True, **kw: Any):
        self.options = OffloadOptions.from_any(options, **kw)
        mode = self.options.exe_mode
        if mode not in self.modes:
            raise ValueError(f"exe_mode must be one of {self.modes} for {type(self).__name__}, got {mode!r}")
        self.lowering: Lowering = LOWERINGS[mode](mode, compiler_config=compiler_config,
                                                  npu_options=dict(npu_options or {}), side_stream=side_stream)
        # weak: a compiled graph owns its binder; the state lives with the caches (state.REGISTRY) or,
        # private, with the compiled graph
        self._binders: "weakref.WeakValueDictionary[str, StateBinder]" = weakref.WeakValueDictionary()
        self._last: Optional[weakref.ref] = None  # binder of the rewritten graph that ran last
        self.reports: list[dict] = []
        self.install_hook: Optional[InstallHook] = None  # CPU modes; the NPU lowerings bring their own
        self._final_graphs: dict[str, Optional[fx.Graph]] = {}  # post-reinplace graphs, for tests / inspection

    # -- public ---------------------------------------------------------------------------
    @property
    def states(self) -> list[OffloadState]:
        """Every live state of this backend's graphs (one per graph and set of full caches)."""
        out: list[OffloadState] = []
        for _, b in sorted(self._binders.items()):
            out.extend(s for s in b.states() if not any(s is o for o in out))
        return out

    @property
    def state(self) -> Optional[OffloadState]:
        """The state of the most recently run rewritten graph (of its last call's caches)."""
        b = self._last() if self._last is not None else None
        st = b.last_state if b is not None else None
        if st is None:
            states = self.states
            st = states[-1] if states else None
        return st

    def reset_state(self, rows: Optional[Sequence[int]] = None) -> None:
        """``OffloadState.reset(rows)`` on every live state. (Not named ``reset``: Dynamo calls
        ``backend.reset()`` from ``torch._dynamo.reset()``.)"""
        for st in self.states:
            st.reset(rows)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        return self.compile(gm, example_inputs, **kwargs)

    def final_graph(self, graph_id: Optional[str] = None) -> Optional[fx.Graph]:
        if graph_id is None:
            graph_id = self.reports[-1]["graph_id"] if self.reports else None
        return self._final_graphs.get(graph_id)

    # -- compile --------------------------------------------------------------------------
    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        """Rewrite (every mode alike), bind the state, record / dump the report, lower per mode."""
        t_start = time.perf_counter()
        graph_id = _new_graph_id()
        dump_dir = self.options.resolved_dump_dir
        dumper = Dumper(dump_dir) if dump_dir else None
        if dumper:
            dumper.graph(graph_id, "dynamo", gm)
        opts, hook = self.lowering.prepare(self.options, graph_id, self.install_hook)
        gm, state, report = rewrite_for_offload(gm, example_inputs, opts, hook, graph_id,
                                                shared_state=self.lowering.shared_state)
        self.lowering.after_rewrite(gm, state, report, opts, hook)
        binder = None
        if state is not None:
            if dumper:
                dumper.graph(graph_id, "rewrite", gm)
            gm, example_inputs, binder = self._bind(gm, example_inputs, state, graph_id)
            report["state_per_caches"] = binder.input_names is not None
        self.reports.append(report)
        if dumper:  # before lowering too: a lowering that stops (no CANN here) leaves the report
            dumper.report(report)
        ctx = LowerContext(graph_id, opts, state, report, dumper, dict(kwargs))
        timings = report["timings"]
        t_lower = time.perf_counter()
        fn = self.lowering.lower(gm, example_inputs, ctx)
        timings["lower_s"] = time.perf_counter() - t_lower
        timings["total_s"] = time.perf_counter() - t_start
        timings["pass_s"] = sum(timings.get(k, 0.0) for k in ("detect_s", "group_s", "plan_s", "rewrite_s",
                                                              "reinplace_s"))
        self._final_graphs[graph_id] = ctx.final_graph
        if dumper:
            dumper.report(report)
        return _Compiled(fn, binder, self, graph_id)

    def _bind(self, gm: fx.GraphModule, example_inputs: Sequence[Any], state: OffloadState, graph_id: str
              ) -> tuple[fx.GraphModule, Sequence[Any], StateBinder]:
        """The binder that applies the stale-state rule before every call (and, for shared state, picks
        the state of the call's caches as extra graph inputs)."""
        names = None
        if state.shared and state.cache_refs is not None:
            gm, names = state_as_inputs(gm, state)
            example_inputs = list(example_inputs) + _static_fakes(example_inputs, state.flat(names))
        if state.cache_refs is None or state.layouts is None:
            # caches not identifiable (e.g. the HF form): the graph's own state, tracked but no switch rule
            b = StateBinder(graph_id, [], [], None, state)
        else:
            b = StateBinder(graph_id, state.layouts, state.cache_refs, names, state)
        self._binders[graph_id] = b
        return gm, example_inputs, b


class NpuOffloadBackend(OffloadBackend):
    """The core configured with an NPU exe_mode (``ge_graph`` / ``npugraph_ex``); rejects the CPU ones:
    ``torch.compile(model, backend=NpuOffloadBackend(exe_mode="ge_graph", pool_size=8192))``."""

    modes = NPU_EXE_MODES


def make_offload_backend(config: OffloadOptions | Mapping | str | Path | None = None, **kw: Any) -> OffloadBackend:
    """A new backend from keyword options and/or the recipe's yaml config (path or dict).

    ``exe_mode`` ``eager``/``inductor`` give an :class:`OffloadBackend`; ``ge_graph``/``npugraph_ex`` an
    :class:`NpuOffloadBackend` (imports torchair / npugraph_ex lazily, on first compile).
    """
    npu_kw = {k: kw.pop(k) for k in ("compiler_config", "npu_options", "side_stream") if k in kw}
    opts = OffloadOptions.from_any(config, **kw)
    cls = OffloadBackend if opts.exe_mode in CPU_EXE_MODES else NpuOffloadBackend
    return cls(opts, **npu_kw)


#: The default backend (pool 8192, eager): ``torch.compile(model, backend=offload_backend)``.
offload_backend = OffloadBackend()

_named: dict[tuple, OffloadBackend] = {}


def backend_for_options(options: Optional[Mapping] = None) -> Any:
    """The (cached) backend instance the named ``dsa_offload`` backend uses for ``options``."""
    key = tuple(sorted((k, repr(v)) for k, v in (options or {}).items()))
    if key not in _named:
        _named[key] = make_offload_backend(dict(options or {}))
    return _named[key]


def dsa_offload_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Optional[Mapping] = None,
                        **kw: Any) -> Callable:
    """Entry point of ``torch.compile(m, backend="dsa_offload", options={...})``."""
    opts = dict(options or {})
    opts.update(kw)
    return backend_for_options(opts)(gm, example_inputs)

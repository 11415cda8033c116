"""The ``dsa_offload`` torch.compile backend: detect → group → plan → rewrite → lower.

Design decisions (copied into the README's design section):

1. **Pre-AOT rewrite of the Dynamo graph.** The rewrite inserts *mutating* ops
   (``custom.dsa_plan`` / ``dsa_serve`` / ``dsa_install``) and new state (pools, metadata), so it runs
   on the Dynamo FX graph, where state can be added as buffers of the GraphModule (``get_attr``);
   AOT (``aot_module_simplified``, ``keep_inference_input_mutations=True``) then lifts the buffers as
   inputs and functionalizes the ops through our Functionalize kernels into ``*_functional`` twins +
   ``copy_`` epilogues, with correct mutated-input bookkeeping. A post-AOT rewrite (TorchAir's
   ``post_grad_custom_pre_pass``) would have to introduce input mutations after
   ``mutated_user_inputs`` is computed (spec/torchair.md §2). One rewrite core for every mode:
   :func:`rewrite_for_offload` (``gm, example_inputs, options -> gm, state, report``), which the NPU
   modes (``npu_modes.py``) call before handing the graph to TorchAir / npugraph_ex; its
   ``install_hook`` receives each layer's install nodes to wrap them in a side-stream scope.
2. **Small passes with typed reports**: ``passes/detect.py`` (``DetectReport``), ``group.py``
   (``GroupReport``), ``preconditions.py`` (``PlanReport``), ``rewrite.py`` (``RewriteReport``),
   ``reinplace.py`` (``ReinplaceReport``). This module only chains them and lowers.
3. **Ordering on CPU = program order + data dependencies**: installs are placed after their
   layer's attention, Z's own install before the owner's metadata install; the next step's plan and
   serves belong to the next graph call. That is the join the recipe lacks; NPU modes need events.
4. **State is owned by the compiled artifact** (buffers of the rewritten GraphModule, exposed as
   ``OffloadState``); each compiled graph has its own. The backend keeps only weak references. When
   a graph runs on full caches that another graph of this backend used since its own last call
   (Dynamo switched graphs, e.g. after a recompilation for new shapes), its state is reset first:
   cold, never stale. New requests are explicit: ``reset()`` / ``reset(rows=[...])``.
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
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from torch import fx

from .dump import Dumper
from .options import CPU_EXE_MODES, OffloadOptions
from .passes import _fx
from .passes.detect import Refusal, detect
from .passes.group import group
from .passes.preconditions import plan as plan_pass
from .passes.reinplace import ReinplaceReport, reinplace
from .passes.rewrite import InstallHook, rewrite
from .state import OffloadState

log = logging.getLogger("offload_passes.backend")

__all__ = ["OffloadBackend", "offload_backend", "make_offload_backend", "dsa_offload_backend",
           "rewrite_for_offload", "OffloadRefused"]

_graph_ids = itertools.count()
PASS_FILES = {
    "detect": "passes/detect.py", "group": "passes/group.py", "plan": "passes/preconditions.py",
    "rewrite": "passes/rewrite.py", "reinplace": "passes/reinplace.py",
}


class OffloadRefused(RuntimeError):
    """Raised under ``strict=True`` when a graph with DSA sites cannot be rewritten."""


def _new_graph_id() -> str:
    return f"graph_{next(_graph_ids):03d}"


def rewrite_for_offload(gm: fx.GraphModule, example_inputs: Sequence[Any], options: OffloadOptions | None = None,
                        install_hook: Optional[InstallHook] = None, graph_id: Optional[str] = None,
                        ) -> tuple[fx.GraphModule, Optional[OffloadState], dict]:
    """Detect, group, plan and rewrite ``gm`` in place; the shared core of every exe_mode.

    Returns ``(gm, state, report)``: ``state`` is None when nothing was rewritten. ``report`` is the
    GraphReport dict of docs/ARCHITECTURE.md §5 without the lowering parts. Raises
    ``OffloadRefused`` under ``options.strict`` when there are DSA sites but a precondition fails.
    Every pass is linear in the graph size; the cyclic GC is paused meanwhile (``_fx.paused_gc``).
    """
    with _fx.paused_gc():
        return _rewrite_for_offload(gm, example_inputs, options, install_hook, graph_id)


def _rewrite_for_offload(gm: fx.GraphModule, example_inputs: Sequence[Any], options: OffloadOptions | None,
                         install_hook: Optional[InstallHook], graph_id: Optional[str],
                         ) -> tuple[fx.GraphModule, Optional[OffloadState], dict]:
    opts = options or OffloadOptions()
    graph_id = graph_id or _new_graph_id()
    t = {}
    t0 = time.perf_counter()
    ops_before = _fx.count_ops(gm.graph)
    det = detect(gm)
    t["detect_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    grp = group(det)
    t["group_s"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    pr = plan_pass(gm, grp, example_inputs, opts)
    t["plan_s"] = time.perf_counter() - t1
    refusals: list[Refusal] = list(det.refusals) + list(pr.refusals)
    if det.has_dsa and not (opts.enable_offload and opts.shared_indexer_offload):
        refusals.insert(0, Refusal("disabled", "enable_offload / shared_indexer_offload is off in the config"))
    report: dict = {
        "graph_id": graph_id, "rewritten": False, "mode": opts.exe_mode, "options": opts.to_dict(),
        "groups": [p.to_dict() for p in pr.groups], "sites": [],
        "layer_nodes": {"before": {}, "after": {}}, "ops": {"before": ops_before, "after": ops_before},
        "state": [], "refusals": [r.to_dict() for r in refusals], "timings": t,
        "passes": [{"name": k, "file": v} for k, v in PASS_FILES.items()],
        "detect": {"gathers": det.gathers, "sites": len(det.sites), "indexers": det.indexers,
                   "other_topk": det.other_topk},
    }
    state = None
    t["rewrite_s"] = 0.0
    if not det.has_dsa:
        log.debug("%s: no DSA gather in the graph; passing it through", graph_id)
        return gm, None, report
    if refusals:
        reasons = sorted({r.reason for r in refusals})
        msg = (f"{graph_id}: DSA offload not applied ({', '.join(reasons)}): "
               + "; ".join(r.detail for r in refusals[:4]) + (" ..." if len(refusals) > 4 else ""))
        if opts.strict:
            raise OffloadRefused(msg)
        log.warning("%s; compiling the graph unmodified", msg)
        return gm, None, report
    t1 = time.perf_counter()
    device = _fx.example(pr.groups[0].geometry[pr.groups[0].owner_layer].full_kv)
    state = OffloadState.allocate(graph_id, pr.groups, device=device.device if device is not None else None)
    t["alloc_s"] = time.perf_counter() - t1  # zero-filling pools: memory bandwidth, not pass work
    t1 = time.perf_counter()
    rr = rewrite(gm, grp, pr, state, update_ledger=opts.update_ledger, install_hook=install_hook)
    t["rewrite_s"] = time.perf_counter() - t1
    report.update({
        "rewritten": True,
        "sites": [s.to_dict() for s in rr.sites],
        "layer_nodes": {"before": rr.layer_nodes_before, "after": rr.layer_nodes_after},
        "ops": {"before": ops_before, "after": _fx.count_ops(gm.graph)},
        "state": state.describe(),
        "state_bytes": state.total_bytes,
        "buffers": rr.buffers,
    })
    log.info("%s: rewrote %d DSA layers in %d groups %s", graph_id, len(rr.sites), len(pr.groups),
             [p.layers for p in pr.groups])
    return gm, state, report


class _ReinplacePass:
    """Inductor ``post_grad_custom_pre_pass``: our reinplace, with a stable uuid for the FX cache."""

    def __init__(self, on_graph: Callable[[fx.Graph, str], None]):
        self.on_graph = on_graph

    def __call__(self, graph: fx.Graph) -> None:
        self.on_graph(graph, "functional")
        self.on_graph(graph, "reinplace")

    def uuid(self) -> str:
        h = hashlib.sha256()
        h.update((Path(__file__).parent / "passes" / "reinplace.py").read_bytes())
        return h.hexdigest()


def _inductor_pass(on_graph: Callable[[fx.Graph, str], None]):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class ReinplaceGraphPass(_ReinplacePass, CustomGraphPass):
        pass

    return ReinplaceGraphPass(on_graph)


class _Compiled:
    """What Dynamo calls: the lowered function plus the state switching check."""

    def __init__(self, fn: Callable, state: Optional[OffloadState], backend: "OffloadBackend",
                 cache_positions: list[int], graph_id: str):
        self.fn = fn
        self.state = state
        self.backend = backend
        self.cache_positions = cache_positions
        self.graph_id = graph_id

    def __call__(self, *args: Any) -> Any:
        if self.state is not None:
            self.backend._activate(self, args)
        return self.fn(*args)


class OffloadBackend:
    """A Dynamo backend instance: ``torch.compile(model, backend=OffloadBackend(pool_size=...))``.

    Exposes ``state`` (the state of the most recently run rewritten graph), ``states`` (all live
    ones), ``reports`` (GraphReport dicts), ``reset_state(rows=None)``.
    """

    def __init__(self, options: OffloadOptions | Mapping | str | Path | None = None, **kw: Any):
        self.options = OffloadOptions.from_any(options, **kw)
        if self.options.exe_mode not in CPU_EXE_MODES:
            raise ValueError(f"exe_mode {self.options.exe_mode!r} needs offload_passes.npu_modes "
                             f"(torchair); this backend runs {CPU_EXE_MODES}")
        self._states: "weakref.WeakValueDictionary[str, OffloadState]" = weakref.WeakValueDictionary()
        self._owner: dict[int, str] = {}  # full-cache data_ptr -> graph_id that used it last
        self._last: Optional[weakref.ref] = None
        self.reports: list[dict] = []
        self.install_hook: Optional[InstallHook] = None
        self._final_graphs: dict[str, Optional[fx.Graph]] = {}  # post-reinplace graphs, for tests / inspection

    # -- public ---------------------------------------------------------------------------
    @property
    def states(self) -> list[OffloadState]:
        return [s for _, s in sorted(self._states.items())]

    @property
    def state(self) -> Optional[OffloadState]:
        st = self._last() if self._last is not None else None
        if st is None:
            states = self.states
            st = states[-1] if states else None
        return st

    def reset_state(self, rows: Optional[Sequence[int]] = None) -> None:
        """``OffloadState.reset(rows)`` on every live state. (Not named ``reset``: Dynamo calls
        ``backend.reset()`` from ``torch._dynamo.reset()``.)"""
        for st in self.states:
            st.reset(rows)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        return self.compile(gm, example_inputs)

    # -- compile --------------------------------------------------------------------------
    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        opts = self.options
        t_start = time.perf_counter()
        graph_id = _new_graph_id()
        dump_dir = opts.resolved_dump_dir
        dumper = Dumper(dump_dir) if dump_dir else None
        if dumper:
            dumper.graph(graph_id, "dynamo", gm)
        phs = _fx.placeholders(gm.graph)
        gm, state, report = rewrite_for_offload(gm, example_inputs, opts, self.install_hook, graph_id)
        timings = report["timings"]
        cache_positions: list[int] = []
        if state is not None:
            if dumper:
                dumper.graph(graph_id, "rewrite", gm)
            full = set()
            for n in gm.graph.nodes:
                if _fx.is_op(n, "dsa_serve"):
                    full.add(_fx.strip_views(n.args[1]))
            cache_positions = [i for i, p in enumerate(phs) if p in full]
            self._states[graph_id] = state
        rinfo: dict = {}

        def on_graph(graph: fx.Graph, stage: str) -> None:
            if stage == "functional":
                if dumper:
                    dumper.graph(graph_id, "functional", graph)
                rinfo["t0"] = time.perf_counter()
                return
            with _fx.paused_gc():
                rep: ReinplaceReport = reinplace(graph)
            timings["reinplace_s"] = time.perf_counter() - rinfo.pop("t0")
            rinfo["report"] = rep
            rinfo["ops_after"] = _fx.count_ops(graph)
            rinfo["final_graph"] = graph
            if dumper:
                dumper.graph(graph_id, "reinplace", graph)

        t_lower = time.perf_counter()
        if not report["detect"]["gathers"] or (state is None and opts.exe_mode == "eager"):
            # untouched: no DSA at all, or refused (the model's own in-place ops run as written)
            fn = gm.forward
            timings["aot_s"] = 0.0
            timings["reinplace_s"] = 0.0
        elif opts.exe_mode == "eager":
            fn = self._lower_eager(gm, example_inputs, on_graph, timings)
        else:
            fn = self._lower_inductor(gm, example_inputs, on_graph, timings)
        timings["lower_s"] = time.perf_counter() - t_lower
        timings["total_s"] = time.perf_counter() - t_start
        timings["pass_s"] = sum(timings.get(k, 0.0) for k in ("detect_s", "group_s", "plan_s", "rewrite_s",
                                                              "reinplace_s"))
        if "report" in rinfo:
            report["reinplace"] = rinfo["report"].to_dict()
            report["ops"]["after"] = rinfo["ops_after"]
        elif state is not None and opts.exe_mode == "inductor":
            report["reinplace"] = {"cached": True}
        self.reports.append(report)
        self._final_graphs[graph_id] = rinfo.get("final_graph")
        if dumper:
            dumper.report(report)
        compiled = _Compiled(fn, state, self, cache_positions, graph_id)
        return compiled

    def final_graph(self, graph_id: Optional[str] = None) -> Optional[fx.Graph]:
        if graph_id is None:
            graph_id = self.reports[-1]["graph_id"] if self.reports else None
        return self._final_graphs.get(graph_id)

    @staticmethod
    def _lower_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], on_graph, timings: dict) -> Callable:
        from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

        def inner(fx_gm: fx.GraphModule, ex: Sequence[Any]):
            timings["aot_s"] = time.perf_counter() - t0
            on_graph(fx_gm.graph, "functional")
            on_graph(fx_gm.graph, "reinplace")
            fx_gm.recompile()
            return make_boxed_func(fx_gm.forward)

        t0 = time.perf_counter()
        return aot_module_simplified(gm, example_inputs, fw_compiler=inner, inference_compiler=inner,
                                     keep_inference_input_mutations=True)

    @staticmethod
    def _lower_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], on_graph, timings: dict) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        t0 = time.perf_counter()

        def hook(graph: fx.Graph, stage: str) -> None:
            if stage == "functional":
                timings["aot_s"] = time.perf_counter() - t0
            on_graph(graph, stage)

        return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_pre_pass": _inductor_pass(hook)})

    def _activate(self, compiled: _Compiled, args: Sequence[Any]) -> None:
        gid = compiled.graph_id
        ptrs = [args[i].data_ptr() for i in compiled.cache_positions]
        stale = any(self._owner.get(p, gid) != gid for p in ptrs)
        if stale and compiled.state is not None:
            log.info("%s: caches were used by another compiled graph since its last run; resetting its "
                     "offload state (cold start)", gid)
            compiled.state.reset(counters=False)
        for p in ptrs:
            self._owner[p] = gid
        self._last = weakref.ref(compiled.state)


def make_offload_backend(config: OffloadOptions | Mapping | str | Path | None = None, **kw: Any) -> Any:
    """A new backend from keyword options and/or the recipe's yaml config (path or dict).

    ``exe_mode`` ``eager``/``inductor`` give an :class:`OffloadBackend`; ``ge_graph``/``npugraph_ex``
    give ``npu_modes.NpuOffloadBackend`` (imports torchair / npugraph_ex lazily, on first compile).
    """
    opts = OffloadOptions.from_any(config, **kw)
    if opts.exe_mode not in CPU_EXE_MODES:
        from .npu_modes import NpuOffloadBackend

        return NpuOffloadBackend(opts)
    return OffloadBackend(opts)


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

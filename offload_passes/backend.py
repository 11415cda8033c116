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
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import fx

from . import _compat
from .dump import Dumper
from .options import CPU_EXE_MODES, OffloadOptions
from .passes import _fx
from .passes.detect import Refusal, detect
from .passes.group import group
from .passes.preconditions import plan as plan_pass
from .passes.inductor_targets import define_aliases, retarget_for_inductor
from .passes.reinplace import ReinplaceReport, reinplace
from .passes.rewrite import InstallHook, rewrite
from .passes.rewrite_hf import rewrite_hf
from .state import REGISTRY, GroupLayout, OffloadState, StateBinder

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
        return _rewrite_for_offload(gm, example_inputs, options, install_hook, graph_id, shared_state)


def _cache_refs(gm: fx.GraphModule, plans: Sequence[Any], example_inputs: Sequence[Any]
                ) -> Optional[tuple[list[list[tuple]], list[list[Any]]]]:
    """Per group, per layer the full kv / rope caches as ``("arg", i)`` / ``("const", tensor)`` refs and
    the example tensors; None when a cache is neither a graph input nor an attribute."""
    index = {p: i for i, p in enumerate(_fx.placeholders(gm.graph))}
    refs: list[list[tuple]] = []
    tensors: list[list[Any]] = []
    for p in plans:
        r, t = [], []
        for l in p.layers:
            for node in (p.geometry[l].full_kv, p.geometry[l].full_rope):
                root = _fx.strip_views(node)
                if root in index and index[root] < len(example_inputs):
                    r.append(("arg", index[root]))
                    t.append(example_inputs[index[root]])
                elif isinstance(root, fx.Node) and root.op == "get_attr":
                    obj: Any = gm
                    for part in str(root.target).split("."):
                        obj = getattr(obj, part)
                    r.append(("const", obj))
                    t.append(obj)
                else:
                    return None
        refs.append(r)
        tensors.append(t)
    if not all(hasattr(x, "data_ptr") for ts in tensors for x in ts):
        return None
    return refs, tensors


def _rewrite_for_offload(gm: fx.GraphModule, example_inputs: Sequence[Any], options: OffloadOptions | None,
                         install_hook: Optional[InstallHook], graph_id: Optional[str], shared_state: bool,
                         ) -> tuple[fx.GraphModule, Optional[OffloadState], dict]:
    opts = options or OffloadOptions()
    graph_id = graph_id or _new_graph_id()
    t = {}
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
    layouts = [GroupLayout.from_plan(p) for p in pr.groups]
    found = _cache_refs(gm, pr.groups, example_inputs)
    if shared_state and found is not None:
        state = REGISTRY.bind(graph_id, layouts, found[1])
    else:
        device = _fx.example(pr.groups[0].geometry[pr.groups[0].owner_layer].full_kv)
        state = OffloadState.allocate(graph_id, layouts, device=device.device if device is not None else None)
    state.layouts = layouts
    state.cache_refs = found[0] if found is not None else None
    state.shared = bool(shared_state and found is not None)
    t["alloc_s"] = time.perf_counter() - t1  # zero-filling pools: memory bandwidth, not pass work
    t1 = time.perf_counter()
    rr = rewrite(gm, grp, pr, state, update_ledger=opts.update_ledger, install_hook=install_hook,
                 in_graph_guards=opts.exe_mode in CPU_EXE_MODES, replacement_policy=opts.replacement_policy)
    t["rewrite_s"] = time.perf_counter() - t1
    report.update({
        "rewritten": True,
        "sites": [s.to_dict() for s in rr.sites],
        "layer_nodes": {"before": rr.layer_nodes_before, "after": rr.layer_nodes_after},
        "ops": {"before": ops_before, "after": _fx.count_ops(gm.graph)},
        "state": state.describe(),
        "state_bytes": state.total_bytes,
        "buffers": rr.buffers,
        "guards": rr.guards,
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


def _static_fakes(example_inputs: Sequence[Any], tensors: Sequence[torch.Tensor]) -> list:
    """``tensors`` as static-shape fake tensors of the compile's fake mode (AOT would otherwise make
    the extra state inputs dynamic), or as they are outside a fake mode."""
    fm = _compat.detect_fake_mode(example_inputs)
    if fm is None:
        return list(tensors)
    return [fm.from_tensor(t, static_shapes=True) for t in tensors]


class _Compiled:
    """What Dynamo calls: picks the offload state for the call's caches (``StateBinder``), then runs."""

    def __init__(self, fn: Callable, binder: Optional[StateBinder], backend: "OffloadBackend", graph_id: str):
        self.fn = fn
        self.binder = binder
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
    """A Dynamo backend instance: ``torch.compile(model, backend=OffloadBackend(pool_size=...))``.

    Exposes ``state`` (the state of the most recently run rewritten graph), ``states`` (all live
    ones), ``reports`` (GraphReport dicts), ``reset_state(rows=None)``.
    """

    def __init__(self, options: OffloadOptions | Mapping | str | Path | None = None, **kw: Any):
        self.options = OffloadOptions.from_any(options, **kw)
        if self.options.exe_mode not in CPU_EXE_MODES:
            raise ValueError(f"exe_mode {self.options.exe_mode!r} needs offload_passes.npu_modes "
                             f"(torchair); this backend runs {CPU_EXE_MODES}")
        # weak: a compiled graph owns its binder; the state lives with the caches (state.REGISTRY)
        self._binders: "weakref.WeakValueDictionary[str, StateBinder]" = weakref.WeakValueDictionary()
        self._last: Optional[weakref.ref] = None  # binder of the rewritten graph that ran last
        self.reports: list[dict] = []
        self.install_hook: Optional[InstallHook] = None
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
        gm, state, report = rewrite_for_offload(gm, example_inputs, opts, self.install_hook, graph_id,
                                                shared_state=True)
        timings = report["timings"]
        binder = None
        if state is not None:
            if dumper:
                dumper.graph(graph_id, "rewrite", gm)
            names = None
            if state.shared and state.cache_refs is not None:
                gm, names = state_as_inputs(gm, state)
                example_inputs = list(example_inputs) + _static_fakes(example_inputs, state.flat(names))
            binder = self._binder(state, graph_id, names)
            report["state_per_caches"] = bool(binder is not None and binder.input_names is not None)
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
        compiled = _Compiled(fn, binder, self, graph_id)
        return compiled

    def _binder(self, state: OffloadState, graph_id: str, names: Optional[list[str]]) -> StateBinder:
        if state.cache_refs is None or state.layouts is None:
            # caches not identifiable (e.g. the HF form): the graph's own state, tracked but no switch rule
            b = StateBinder(graph_id, [], [], None, state)
        else:
            b = StateBinder(graph_id, state.layouts, state.cache_refs, names, state)
        self._binders[graph_id] = b
        return b

    def final_graph(self, graph_id: Optional[str] = None) -> Optional[fx.Graph]:
        if graph_id is None:
            graph_id = self.reports[-1]["graph_id"] if self.reports else None
        return self._final_graphs.get(graph_id)

    @staticmethod
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

    @staticmethod
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

"""The ``dsa_offload`` torch.compile backend: the class Dynamo calls, its factories and the default instance.

One core for every exe_mode (:class:`OffloadBackend`): a compile runs the pass list (``pipeline.py``: the
core's passes, then the lowering's own), binds the state (``state.StateBinder``: the stale-state rule and
the outside-write check), records and dumps the report, and lowers. The modes differ only in their lowering
(``modes.MODES``).
"""
from __future__ import annotations

import collections
import logging
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import torch
from torch import fx

from . import _compat
from .dump import Dumper
from .hf_reorder import follow_cache_reorders
from .lowering import LowerContext, Lowering
from .modes import CPU_EXE_MODES, EXE_MODES, MODES, NPU_EXE_MODES, check_exe_mode, lowering_for
from .options import OffloadOptions
from .passes import _fx
from .passes.manager import CompileContext
from .passes.refusal import OffloadRefused
from .passes.state_inputs import state_as_inputs, static_fakes
from .pipeline import CORE_PASSES, OffloadWarning, new_graph_id, rewrite_for_offload, run_passes, warn_once
from .report import GraphReport
from .state import REGISTRY, OffloadState, StateBinder

log = logging.getLogger("offload_passes.backend")

__all__ = ["OffloadBackend", "NpuOffloadBackend", "offload_backend", "make_offload_backend",
           "dsa_offload_backend", "offload_compile_config", "rewrite_for_offload", "OffloadRefused", "OffloadWarning",
           "LowerContext", "Lowering", "state_as_inputs"]

#: torch.compile's ``mode`` values. They tune Inductor (and CUDA graphs for "reduce-overhead"); this backend
#: lowers by its own ``exe_mode``: the mode reaches the lowering (``LowerContext.compile_mode``), which
#: honours or refuses it (the CPU and NPU lowerings accept it with no effect, HF's CompileConfig passes
#: mode="reduce-overhead" by default; the CUDA lowering refuses the Inductor modes).
TORCH_COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_torch_mode(mode: Any) -> Optional[str]:
    """torch.compile's ``mode`` (``"default"`` is None), for the lowering; anything else is refused with what to
    pass instead."""
    if mode not in TORCH_COMPILE_MODES:
        raise ValueError(f"dsa_offload: mode={mode!r} is not a torch.compile mode {TORCH_COMPILE_MODES[1:]}; the "
                         "backend's own lowering is the exe_mode option (make_offload_backend(exe_mode=...))")
    return None if mode == "default" else mode


def _dynamo_frame() -> Optional[dict]:
    """Dynamo's compile id of the frame being compiled and its recompile limit (None outside Dynamo)."""
    return _compat.dynamo_frame_compile()


#: how many GraphReports a backend keeps (the newest); a long-lived backend must not grow without bound
MAX_REPORTS = 256
#: how many of the newest post-reinplace graphs a backend keeps after their compiled graph is gone
KEEP_GRAPHS = 4


#: per Dynamo frame (a code object, ``frame_id``): the models whose compiles counted against its
#: recompile_limit in this process, by the storage of their first parameter. Every transformers model's
#: ``forward`` is one wrapper function (transformers/utils/generic.py), so models compiled through it
#: share one budget; ``decorator.own_forward`` gives a model a code object of its own.
_FRAME_MODELS: dict[int, set] = {}
#: frames whose recompile_limit was reached by a compile of this package (frame_id -> models that shared it)
_LIMIT_REACHED: dict[int, int] = {}


def _model_key(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Optional[int]:
    """The storage address of the compiled model's first parameter (what tells two models apart)."""
    params = [t for t in example_inputs if isinstance(t, torch.nn.Parameter)] or list(gm.parameters())
    for t in params[:1]:
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage (a fake tensor): unknown
            return None
    return None


def _count_frame_compile(frame: dict, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    key = _model_key(gm, example_inputs)
    models = _FRAME_MODELS.setdefault(frame["frame_id"], set())
    if key is not None:
        models.add(key)
    frame["models"] = len(models)
    if frame["last_allowed"]:
        _LIMIT_REACHED[frame["frame_id"]] = len(models)


def _recompile_limit_message(graph_id: str, frame: dict, hf: bool) -> str:
    """What the compile that reaches Dynamo's recompile_limit says: to a Hugging Face user or to an engine,
    and, when several models compiled through the same code object, that they share the budget."""
    head = (f"{graph_id}: Dynamo's recompile_limit ({frame['recompile_limit']}) is reached for this frame (compile "
            f"#{frame['frame_compile_id'] + 1}): calls with new shapes will run the model unmodified, without the "
            "offload.")
    shared = frame.get("models", 1)
    if shared > 1:
        why = (f" The limit counts compiles per code object, and {shared} models compiled in this process share this "
               "one" + (" (every transformers model's forward is one wrapper function, transformers/utils/generic.py)"
                        if hf else "") + ": give each model its own with offload_passes.decorator.own_forward(model) "
               "(offload(model) does), or raise torch._dynamo.config.recompile_limit (docs/hf.md).")
    elif hf:
        why = (" For a Hugging Face model use offload(model).generate(...): it supplies a StaticCache of bucketed "
               "lengths and compiles each decode (batch, cache length) under a budget of its own. Otherwise reuse "
               "one StaticCache (fixed max_cache_len: one decode graph per batch size) or raise "
               "torch._dynamo.config.recompile_limit (docs/hf.md).")
    else:
        why = (" An engine compiles one graph per batch bucket and cache geometry: keep their number under the limit "
               "or raise torch._dynamo.config.recompile_limit (docs/new-requests.md).")
    return head + why


# ---------------------------------------------------------------------------------- the backend
class _Compiled:
    """What Dynamo calls: picks the offload state for the call's caches (``StateBinder``: per-call
    inputs, or the graph's own buffers after the stale-state rule and the outside-write check), runs,
    then records the caches' versions. A graph without offload whose lowering may hide its input
    writes from autograd (``bump``: graph replay in the NPU modes) moves the version counters of the
    inputs it writes itself, so the decode graph sees a compiled prefill as an outside write."""

    def __init__(self, fn: Callable, binder: Optional[StateBinder], backend: "OffloadBackend", graph_id: str,
                 bump: Sequence[int] = (), final_graph: Optional[fx.Graph] = None, report: Any = None):
        self.fn = fn
        self.report = report  # its cold_resets follows the binder's (state.StateBinder.cold_resets)
        self.binder = binder  # owns a private state: the backend holds it weakly
        self.backend_ref = weakref.ref(backend)
        self.graph_id = graph_id
        self.bump = tuple(bump)
        self.final_graph = final_graph  # held as long as the compiled graph is (for inspection)
        if binder is not None and binder.input_names is not None:
            weakref.finalize(self, REGISTRY.drop_graph, graph_id)

    def __call__(self, *args: Any) -> Any:
        b = self.binder
        if b is None:
            out = self.fn(*args)
            if self.bump:
                _bump_versions([args[i] for i in self.bump])
            return out
        extra = b.extra_inputs(args)
        be = self.backend_ref()
        if be is not None:
            be._last = weakref.ref(b)
        out = self.fn(*args, *extra)
        b.after_call(args, out)
        if self.report is not None and b.cold_resets != (self.report.cold_resets or 0):
            self.report.cold_resets = b.cold_resets
        return out


def _no_graph_message() -> str:
    """What reading the state of a backend that compiled nothing says: the generic fact, then only the causes
    that can apply in this process (a Hugging Face ``generate()`` loaded; a recompile limit reached)."""
    msg = ("backend.state is None: this dsa_offload backend has compiled no graph yet (the first call of the "
           "compiled model compiles; module_state(model) / offload_state are empty until then).")
    if _LIMIT_REACHED:
        msg += (" Dynamo's recompile_limit was reached in this process for a code object that "
                + ("several models share" if max(_LIMIT_REACHED.values()) > 1 else "a model uses")
                + ": a model compiled through it afterwards runs unmodified and never reaches this backend "
                "(offload_passes.decorator.own_forward gives a model its own).")
    if "transformers.generation.utils" in sys.modules:  # only where Hugging Face generate() is in use
        msg += (" Hugging Face: torch.compile(model).generate() compiles nothing (torch's compiled wrapper hands "
                "generate() to the original model); use offload(model).generate(...), model.forward = "
                "torch.compile(model.forward, backend=...) or generate(compile_config=...) (docs/hf.md)")
    return msg


def _bump_versions(tensors: Sequence[Any]) -> None:
    ts = [t for t in tensors if isinstance(t, torch.Tensor) and not t.is_inference()]
    if ts:
        torch.autograd.graph.increment_version(ts)


class OffloadBackend:
    """A Dynamo backend instance: ``torch.compile(model, backend=OffloadBackend(pool_size=...))``; the one
    core of every exe_mode (the modes differ only in their lowering, ``modes.MODES``).

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
        check_exe_mode(mode, self.modes, where=f" for {type(self).__name__}")
        self.lowering: Lowering = lowering_for(mode, compiler_config=compiler_config,
                                               npu_options=dict(npu_options or {}), side_stream=side_stream)
        # weak: a compiled graph owns its binder; the state lives with the caches (state.REGISTRY) or,
        # private, with the compiled graph
        self._binders: "weakref.WeakValueDictionary[str, StateBinder]" = weakref.WeakValueDictionary()
        self._last: Optional[weakref.ref] = None  # binder of the rewritten graph that ran last
        # the newest MAX_REPORTS GraphReports (a process-long backend must not grow per compile)
        self.reports: "collections.deque[GraphReport]" = collections.deque(maxlen=MAX_REPORTS)
        # graph id -> its compiled callable, weakly: the post-reinplace graph lives as long as Dynamo keeps
        # the compiled graph (torch._dynamo.reset() and deleting the model free it)
        self._compiled: "weakref.WeakValueDictionary[str, _Compiled]" = weakref.WeakValueDictionary()
        # the newest few post-reinplace graphs, for inspection after the model is gone; bounded, and
        # emptied by torch._dynamo.reset() (which calls reset() on the backends it cached)
        self._recent_graphs: "collections.deque[tuple[str, fx.Graph]]" = collections.deque(maxlen=KEEP_GRAPHS)

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
        if not self.reports:
            warn_once(("no_graph", id(self)), _no_graph_message())
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

    def __deepcopy__(self, memo: dict) -> "OffloadBackend":
        # a backend is process state (compiled graphs, their pools), like a compiled function: a deep copy of
        # what holds it shares it. transformers' CompileConfig.to_dict() deep-copies its backend before
        # torch.compile; a copy would collect the reports and states the user reads on the original.
        return self

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        return self.compile(gm, example_inputs, **kwargs)

    def final_graph(self, graph_id: Optional[str] = None) -> Optional[fx.Graph]:
        """The post-reinplace graph of ``graph_id`` (default: the newest), while it is compiled."""
        if graph_id is None:
            graph_id = self.reports[-1].graph_id if self.reports else None
        c = self._compiled.get(graph_id) if graph_id is not None else None
        if c is not None:
            return c.final_graph
        return next((g for gid, g in self._recent_graphs if gid == graph_id), None)

    def reset(self) -> None:
        """Called by ``torch._dynamo.reset()``: drop the graphs kept for inspection (not the reports)."""
        self._recent_graphs.clear()

    # -- compile --------------------------------------------------------------------------
    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        """The pass list (the core's, then the lowering's), the state bound, the report kept and dumped, the
        lowered step. ``kwargs``: what Dynamo passes; torch.compile's ``mode`` goes to the lowering."""
        compile_mode = check_torch_mode(kwargs.pop("mode", None))
        t_start = time.perf_counter()
        graph_id = new_graph_id()
        dump_dir = self.options.resolved_dump_dir
        dumper = Dumper(dump_dir) if dump_dir else None
        if dumper:
            dumper.graph(graph_id, "dynamo", gm)
        ctx = CompileContext.start(gm, example_inputs, graph_id, self.options,
                                   state_from_caches=self.lowering.state_from_caches,
                                   in_graph_guards=MODES[self.options.exe_mode].guards)
        self.lowering.configure(ctx)
        with _fx.paused_gc():  # a full sweep of the compiler's heap is never charged to a pass at random
            run_passes(ctx, [*CORE_PASSES, *self.lowering.passes(ctx)])
        self._note_frame(ctx)
        gm, example_inputs, binder, bump = self._bind_state(ctx, dumper)
        self.reports.append(ctx.report)
        if dumper:  # before lowering too: a lowering that stops (no CANN here) leaves the report
            dumper.report(ctx.report.to_dict())
        lctx = LowerContext(graph_id, ctx.options, ctx.state, ctx.report, dumper, dict(kwargs), compile_mode)
        fn = self._lower(gm, example_inputs, lctx, t_start)
        compiled = _Compiled(fn, binder, self, graph_id, bump, lctx.final_graph, ctx.report)
        if lctx.final_graph is not None:
            self._recent_graphs.append((graph_id, lctx.final_graph))
        self._compiled[graph_id] = compiled
        return compiled

    @staticmethod
    def _note_frame(ctx: CompileContext) -> None:
        """Dynamo's compile id of the frame; the compile that reaches its recompile_limit warns: past it Dynamo
        runs the frame as it is (no graph, no offload) for any shape its guards reject."""
        report = ctx.report
        report.dynamo = _dynamo_frame()
        if report.dynamo is None:
            return
        _count_frame_compile(report.dynamo, ctx.gm, ctx.example_inputs)
        if report.dynamo["last_allowed"] and (report.rewritten or report.dense):
            msg = _recompile_limit_message(ctx.graph_id, report.dynamo, report.frontend == "hf" or bool(report.hf))
            log.warning(msg)
            warn_once(("recompile_limit", ctx.graph_id), msg)  # the last allowed compile: once per frame

    def _bind_state(self, ctx: CompileContext, dumper: Optional[Dumper]
                    ) -> tuple[fx.GraphModule, Sequence[Any], Optional[StateBinder], list[int]]:
        """A rewritten graph's binder (its dump first); a graph without offload whose lowering may hide its
        input writes (graph replay off the CPU) gets the inputs it writes, whose versions it moves itself."""
        state, report = ctx.state, ctx.report
        if state is None:
            bump = _fx.mutated_placeholders(ctx.gm) if MODES[ctx.options.exe_mode].platform != "cpu" else []
            return ctx.gm, ctx.example_inputs, None, bump
        if dumper:
            dumper.graph(ctx.graph_id, "rewrite", ctx.gm)
        gm, example_inputs, binder = self._bind(ctx.gm, ctx.example_inputs, state, ctx.graph_id)
        binder.frontend = report.frontend or "recipe"
        report.state_per_caches = binder.input_names is not None
        report.cold_resets = 0  # counted by the binder (a pattern that keeps the pools cold)
        if report.frontend == "hf":  # beam search moves every cache row each step: the pools follow
            follow_cache_reorders()
        return gm, example_inputs, binder, []

    def _lower(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: LowerContext, t_start: float
               ) -> Callable:
        """The lowering's compiled step; the lowering and total timings; the report dumped again."""
        timings = ctx.report.timings
        t_lower = time.perf_counter()
        fn = self.lowering.lower(gm, example_inputs, ctx)
        timings["lower_s"] = time.perf_counter() - t_lower
        timings["total_s"] = time.perf_counter() - t_start
        timings["pass_s"] = sum(timings.get(k, 0.0) for k in ("detect_s", "group_s", "plan_s", "rewrite_s",
                                                              "reinplace_s"))
        if ctx.dumper:
            ctx.dumper.report(ctx.report.to_dict())
        return fn

    def _bind(self, gm: fx.GraphModule, example_inputs: Sequence[Any], state: OffloadState, graph_id: str
              ) -> tuple[fx.GraphModule, Sequence[Any], StateBinder]:
        """The binder that applies the stale-state rule before every call (and, for shared state, picks
        the state of the call's caches as extra graph inputs)."""
        names = None
        if state.shared and state.cache_refs is not None:
            gm, names = state_as_inputs(gm, state)
            example_inputs = list(example_inputs) + static_fakes(example_inputs, state.flat(names))
        if state.cache_refs is None or state.layouts is None:
            # full caches that are neither graph inputs nor attributes: the graph's own state; outside
            # writes cannot be seen, so the binder invalidates every row before every step (cold, correct)
            log.warning("%s: the full caches are neither graph inputs nor module buffers; the offload pools "
                        "are invalidated before every step (docs/new-requests.md)", graph_id)
            b = StateBinder(graph_id, [], [], None, state)
        else:
            b = StateBinder(graph_id, state.layouts, state.cache_refs, names, state, grown=state.grown)
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
    cls = NpuOffloadBackend if opts.exe_mode in NPU_EXE_MODES else OffloadBackend
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
    """Entry point of ``torch.compile(m, backend="dsa_offload", options={...})``; torch.compile's ``mode``
    reaches the lowering as with a backend instance."""
    mode = check_torch_mode(kw.pop("mode", None))
    opts = dict(options or {})
    opts.update(kw)
    return backend_for_options(opts)(gm, example_inputs, mode=mode)


def offload_compile_config(*, fullgraph: bool = False, dynamic: Optional[bool] = None, **options: Any) -> Any:
    """A ``transformers.CompileConfig`` for ``model.generate(compile_config=...)`` that compiles the decode
    step with this backend (``options`` as :func:`make_offload_backend`). ``mode`` is None: torch.compile
    takes either a mode or options, and HF's default mode "reduce-overhead" would do nothing here. It also
    compiles on CPU (HF compiles on accelerators only unless asked)."""
    from transformers import CompileConfig

    cc = CompileConfig(fullgraph=fullgraph, dynamic=dynamic, backend=make_offload_backend(**options), mode=None)
    cc._compile_all_devices = True
    return cc

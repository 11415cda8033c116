"""``exe_mode="cuda"``: the offload graph on a CUDA device, installs on a side CUDA stream.

What the mode is (the decisions; docs/cuda.md has the reasons at length):

* **Lowering** = the CPU ``eager`` lowering (AOT functionalisation, our reinplace, the graph run op by op;
  ``lowering/cpu.py``) on CUDA tensors, with the Triton kernels of ``custom_ops/cuda/`` as the CUDA
  implementation of the same ops. The state is per-call graph inputs chosen by the caches
  (``state_from_caches = True``), the in-graph run-time guards stay.
* **Schedule** = the NPU modes' (``lowering/npu.py``, ``lowering/side_stream.py``): each layer's installs (its md=0 install; on the
  group's last layer also the owner's md=1 install) move right after that layer's ``dsa_serve`` and run
  on a side stream: ``scope_enter`` (record a *ready* event on the main stream, the side stream waits on
  it, becomes current), ``record_stream`` of every main-stream intermediate the installs read (the plan's
  install records: the caching allocator must not reuse them early), the installs, ``scope_exit``
  (record *done* on the side stream, the main stream becomes current again). The main stream waits on
  *done* (``stream_join``) before the first later main-stream node that touches what the installs write
  or writes what they read, else before the graph output — the same joins as the CPU/NPU schedule
  (``lowering/side_stream.py join_points``). They are ops of the ``offload_cuda`` namespace with side effects (never
  dead-code eliminated), traced by AOT in program order; on a machine without CUDA they do nothing.
* **Inductor** would reorder the ops across the stream switches (it has no notion of the current stream
  of a custom op), so this mode never hands the graph to Inductor; ``torch.compile(mode="max-autotune" |
  "max-autotune-no-cudagraphs")`` (Inductor's tuning) is refused by name.
* **CUDA graphs**: ``torch.compile(mode="reduce-overhead")`` (what the mode means to a user: the step as
  CUDA-graph replays) or the option ``cuda_graphs=True`` captures the lowered step in one CUDA graph per
  input signature (the lowering's own capture, ``lowering/cuda_graphs.py``; not cudagraph trees, which
  would run Inductor and refuse the host caches): refused at compile time, naming the nodes, when
  :func:`~offload_passes.lowering.cuda_graphs.capture_problems` finds a host synchronisation in the graph.
  A graph without a CUDA tensor has nothing to capture and runs op by op.
* **Host-resident KV**: the full caches may be pinned host tensors (:mod:`offload_passes.cuda`); the
  serve kernel reads their missed rows zero-copy. Nothing here copies them. The model writes its new rows
  into them with the cache-write op (device stores through the pinned address, ``custom_ops/cuda/cache_write.py``);
  ``passes/host_cache_writes.py`` (run in :meth:`CudaLowering.after_rewrite` on every graph) gives host operands
  only to an ATen write into a host graph input, which Dynamo-traced graphs do not contain.
* **Guards**: every ``aten._assert_async.msg`` of the rewrite (a device-side assert on CUDA, fatal to the
  context) becomes ``offload_cuda::guard``: raised at once on the host, a pinned error word on the device,
  raised by the lowered step before its next call (:func:`device_safe_guards`, ``custom_ops/cuda/guard.py``).
"""
from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import fx

from ..custom_ops.cuda._common import raise_device_errors
from ..passes import _fx
from . import LowerContext
from .cpu import CpuLowering
from . import cuda_graphs
from .cuda_graphs import GraphReplay, capture_problems, input_specs
from .side_stream import SideStreamHook
from ..modes import CUDA_EXE_MODES, check_exe_mode
from ..options import OffloadOptions
from ..passes.host_cache_writes import HostCacheWritesReport, host_cache_writes
from ..passes.emit import InstallHook
from ..state import OffloadState

log = logging.getLogger("offload_passes.lowering.cuda")

__all__ = ["CudaLowering", "CudaInstallHook", "CUDA_MODE", "STREAM_NAMESPACE", "STREAM_OPS", "GUARD_OP",
           "StreamRuntime", "RUNTIME", "UNSUPPORTED_COMPILE_MODES", "CAPTURE_COMPILE_MODES", "device_safe_guards",
           "raise_device_errors"]

CUDA_MODE = "cuda"
STREAM_NAMESPACE = "offload_cuda"
#: torch.compile(mode=...) values: each selects Inductor tuning this mode does not use.
UNSUPPORTED_COMPILE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")
#: torch.compile(mode=...) values this mode honours as its own CUDA-graph capture (``cuda_graphs=True``)
CAPTURE_COMPILE_MODES = ("reduce-overhead",)


class StreamRuntime:
    """What the stream ops do at run time: one side stream per device, one ready/done pair per tag.

    On a machine without CUDA (CPU tensors, the tests) every op is a no-op: the schedule is the same
    graph, the order of the ops on one CPU thread is program order.
    """

    def __init__(self) -> None:
        self._side: dict = {}
        self._open: dict = {}  # tag -> (main stream, side stream)
        self._done: dict = {}  # tag -> done event
        self._lock = threading.Lock()
        #: (op, tag) of every call, newest last, bounded (tests and debugging read it)
        self.calls: List[tuple] = []

    @staticmethod
    def enabled() -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def _log(self, op: str, tag: int) -> None:
        self.calls.append((op, tag))
        del self.calls[:-4096]

    def side_stream(self, device: "torch.device") -> "torch.cuda.Stream":
        with self._lock:
            s = self._side.get(device.index)
            if s is None:
                s = self._side[device.index] = torch.cuda.Stream(device=device)
            return s

    def scope_enter(self, tag: int) -> None:
        self._log("scope_enter", tag)
        if not self.enabled():
            return
        main = torch.cuda.current_stream()
        side = self.side_stream(main.device)
        ready = torch.cuda.Event()
        ready.record(main)
        side.wait_event(ready)
        self._open[tag] = (main, side)
        torch.cuda.set_stream(side)

    def record_stream(self, t: torch.Tensor, tag: int) -> None:
        self._log("record_stream", tag)
        if self.enabled() and t.is_cuda and tag in self._open:
            t.record_stream(self._open[tag][1])

    def scope_exit(self, tag: int) -> None:
        self._log("scope_exit", tag)
        if not self.enabled() or tag not in self._open:
            return
        main, side = self._open.pop(tag)
        done = torch.cuda.Event()
        done.record(side)
        self._done[tag] = done
        torch.cuda.set_stream(main)

    def join(self, tag: int) -> None:
        self._log("stream_join", tag)
        if not self.enabled():
            return
        done = self._done.pop(tag, None)
        if done is not None:
            torch.cuda.current_stream().wait_event(done)


RUNTIME = StreamRuntime()

_LIB = torch.library.Library(STREAM_NAMESPACE, "DEF")
_SCHEMAS = {
    "scope_enter": "scope_enter(int tag) -> ()",
    "record_stream": "record_stream(Tensor t, int tag) -> ()",
    "scope_exit": "scope_exit(int tag) -> ()",
    "stream_join": "stream_join(int tag) -> ()",
}
for _name, _schema in _SCHEMAS.items():
    _LIB.define(_schema)
_LIB.impl("scope_enter", lambda tag: RUNTIME.scope_enter(tag), "CompositeExplicitAutograd")
_LIB.impl("record_stream", lambda t, tag: RUNTIME.record_stream(t, tag), "CompositeExplicitAutograd")
_LIB.impl("scope_exit", lambda tag: RUNTIME.scope_exit(tag), "CompositeExplicitAutograd")
_LIB.impl("stream_join", lambda tag: RUNTIME.join(tag), "CompositeExplicitAutograd")


def _guard(ok: torch.Tensor, msg: str) -> None:
    """The rewrite's run-time guard in this mode: on the host ``RuntimeError(msg)`` now (what
    ``aten._assert_async`` does on a CPU tensor); on a CUDA tensor a device flag, raised by the lowered
    step before its next call (``custom_ops/cuda/guard.py``), never a device-side assert."""
    if ok.device.type == "cpu":
        if not bool(ok):
            raise RuntimeError(msg)
        return
    from ..custom_ops.cuda import guard as G

    G.flag(ok, msg)


_LIB.define("guard(Tensor ok, str msg) -> ()")
_LIB.impl("guard", _guard, "CompositeExplicitAutograd")


def _fake_tag(tag: int) -> None:
    return None


def _fake_record(t: torch.Tensor, tag: int) -> None:
    return None


for _name in _SCHEMAS:
    torch.library.register_fake(f"{STREAM_NAMESPACE}::{_name}", _fake_record if _name == "record_stream" else _fake_tag,
                                lib=_LIB)
torch.library.register_fake(f"{STREAM_NAMESPACE}::guard", lambda ok, msg: None, lib=_LIB)

_ops = getattr(torch.ops, STREAM_NAMESPACE)
#: The stream ops, by name. They return nothing and mutate nothing, so they are declared side-effectful
#: (FX / AOT dead-code elimination would drop them otherwise).
STREAM_OPS = {n: getattr(_ops, n).default for n in _SCHEMAS}
for _op in STREAM_OPS.values():
    fx.node.has_side_effect(_op)
#: the guard of this mode (replaces ``aten._assert_async.msg``); side-effectful like the stream ops
GUARD_OP = _ops.guard.default
fx.node.has_side_effect(GUARD_OP)


def device_safe_guards(gm: fx.GraphModule) -> List[str]:
    """Replace every ``aten._assert_async.msg(ok, msg)`` of ``gm`` by ``offload_cuda::guard(ok, msg)`` (same
    place, same arguments); returns the replaced node names."""
    done = []
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten._assert_async.msg:
            with gm.graph.inserting_before(n):
                new = gm.graph.call_function(GUARD_OP, tuple(n.args))
            new.meta.update(n.meta)
            n.replace_all_uses_with(new)
            gm.graph.erase_node(n)
            done.append(n.name)
    if done:
        gm.recompile()
    return done

_TAGS = itertools.count(1)


class CudaInstallHook(SideStreamHook):
    """The rewrite's install hook for ``exe_mode="cuda"`` (see the module doc; the shape is
    ``side_stream.SideStreamHook``): a scope's ready / done are the runtime's events of its tag."""

    def __init__(self, graph_id: str):
        super().__init__()
        self.graph_id = graph_id
        self.tags: dict[int, int] = {}  # layer -> tag

    def tag(self, layer: int) -> int:
        tag = self.tags[layer] = next(_TAGS)
        return tag

    def open(self, graph: fx.Graph, tag: int, reads: List[fx.Node]) -> None:
        graph.call_function(STREAM_OPS["scope_enter"], (tag,))
        for t in reads:  # main-stream allocations the side stream reads (the plan's install records)
            graph.call_function(STREAM_OPS["record_stream"], (t, tag))

    def close(self, graph: fx.Graph, tag: int) -> fx.Node:
        return graph.call_function(STREAM_OPS["scope_exit"], (tag,))

    def join(self, graph: fx.Graph, tag: int) -> None:
        graph.call_function(STREAM_OPS["stream_join"], (tag,))


class CudaLowering:
    """The lowering of ``exe_mode="cuda"`` (same protocol as ``lowering.cpu.CpuLowering``).

    ``side_stream=False`` keeps the installs on the main stream (the CPU schedule on CUDA tensors).
    Refuses the NPU-only settings and Inductor's ``torch.compile(mode=...)`` by name.
    """

    state_from_caches = True

    def __init__(self, mode: str = CUDA_MODE, compiler_config: Any = None, npu_options: Any = None,
                 side_stream: bool = True):
        check_exe_mode(mode, CUDA_EXE_MODES, where=" for the CUDA lowering")
        given = [k for k, v in (("compiler_config", compiler_config), ("npu_options", npu_options))
                 if v not in (None, {})]
        if given:
            raise ValueError(f"{given} only apply to the NPU exe_modes, not {mode!r}")
        self.mode = mode
        self.side_stream = side_stream
        self._eager = CpuLowering("eager")
        #: graph id -> what passes/host_cache_writes.py did to that graph
        self.host_cache_writes: dict[str, HostCacheWritesReport] = {}
        #: graph id -> the guards made device-safe (:func:`device_safe_guards`)
        self.guards: dict[str, List[str]] = {}
        #: graph id -> the lowered step (raises a pending device error before it runs)
        self.steps: dict[str, Callable] = {}
        #: graph id -> what keeps the graph out of a CUDA-graph capture (``cuda_graphs=True`` only)
        self.capture_problems: dict[str, List[str]] = {}
        #: graph id -> the captured step (``cuda_graphs=True``; ``lowering/cuda_graphs.py``)
        self.replays: dict[str, GraphReplay] = {}

    def prepare(self, options: OffloadOptions, graph_id: str, install_hook: Optional[InstallHook]
                ) -> tuple[OffloadOptions, Optional[InstallHook]]:
        if install_hook is not None or not self.side_stream:
            return options, install_hook
        return options, CudaInstallHook(graph_id)

    def after_rewrite(self, gm: fx.GraphModule, state: Optional[OffloadState], report: Any,
                      options: OffloadOptions, install_hook: Optional[InstallHook]) -> None:
        report.side_stream = isinstance(install_hook, CudaInstallHook) and state is not None
        if state is not None and isinstance(install_hook, CudaInstallHook):
            report.joins_before = install_hook.finish(gm.graph)
            gm.recompile()
        # after the joins: it only adds copies of main-stream values right before their host write
        gid = str(getattr(report, "graph_id", len(self.host_cache_writes)))
        self.host_cache_writes[gid] = host_cache_writes(gm)
        self.guards[gid] = device_safe_guards(gm)

    def lower(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: LowerContext) -> Callable:
        mode = ctx.compile_mode
        if mode in UNSUPPORTED_COMPILE_MODES:
            raise RuntimeError(
                f"exe_mode='cuda' does not support torch.compile(mode={mode!r}): the mode runs the offload graph "
                "op by op after AOT (Inductor would reorder the ops across the install side stream, and its "
                "cudagraph trees refuse the host-resident caches); call torch.compile without mode=, or with "
                "mode='reduce-overhead' for the lowering's own CUDA-graph capture (docs/cuda.md)")
        capture = ctx.options.cuda_graphs or mode in CAPTURE_COMPILE_MODES
        factory = cuda_graphs.GRAPH_FACTORY
        if capture and not factory.applies(example_inputs):
            log.info("graph %s: no CUDA tensor among its inputs, nothing to capture: it runs op by op",
                     ctx.graph_id)
            capture = False
        specs = input_specs(gm, example_inputs) if capture else None
        mutated = _fx.mutated_placeholders(gm) if specs is not None else []
        fn = self._eager.lower(gm, example_inputs, ctx)
        gid = str(ctx.graph_id)
        if specs is not None:
            problems = capture_problems(ctx.final_graph if ctx.final_graph is not None else gm.graph)
            self.capture_problems[gid] = problems
            if problems:
                how = "mode='reduce-overhead'" if mode in CAPTURE_COMPILE_MODES else "cuda_graphs=True"
                raise RuntimeError(f"{how}: graph {gid} cannot be captured in one CUDA graph ("
                                   f"{len(problems)} problems): " + "; ".join(problems[:8])
                                   + ("; ..." if len(problems) > 8 else "")
                                   + " (docs/cuda.md, CUDA graphs; or compile without it)")
            replay = GraphReplay(fn, specs, mutated=mutated, graph_factory=factory)
            self.replays[gid] = replay
            self.steps[gid] = replay
            return replay

        def step(*args: Any) -> Any:
            # a guard or kernel that failed on the device in an earlier call raises here, on the host
            raise_device_errors()
            return fn(*args)

        step.__wrapped__ = fn  # type: ignore[attr-defined]
        self.steps[gid] = step
        return step

"""``exe_mode="cuda"``: the CPU ``eager`` lowering (AOT, our reinplace, op by op) on CUDA tensors with the
Triton kernels of ``custom_ops/cuda/``, installs on a side CUDA stream (the NPU schedule,
``lowering/side_stream.py``: ``offload_cuda::scope_enter`` / ``record_stream`` / ``scope_exit`` /
``stream_join``, side-effectful ops that do nothing without CUDA).

Never Inductor (it would reorder ops across the stream switches): ``mode="max-autotune*"`` is refused;
``mode="reduce-overhead"`` or ``cuda_graphs=True`` captures the step in one CUDA graph
(``lowering/cuda_graphs.py``). The guards become ``offload_cuda::guard`` (raised on the host, never a
device-side assert).
"""
from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Callable, List, Sequence

import torch
from torch import fx

from ..custom_ops.cuda._common import raise_device_errors
from ..passes import _fx
from . import LowerContext
from .cpu import CpuLowering
from . import cuda_graphs
from .cuda_graphs import GraphReplay, capture_problems, input_specs
from .side_stream import SideStreamHook, side_stream_joins
from ..modes import CUDA_EXE_MODES, check_exe_mode
from ..passes.host_cache_writes import HostCacheWritesReport, host_cache_writes
from ..passes.manager import CompileContext, Pass, StepPass

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

    def configure(self, ctx: CompileContext) -> None:
        if self.side_stream:
            ctx.install_hook = CudaInstallHook(ctx.graph_id)

    def passes(self, ctx: CompileContext) -> list[Pass]:
        """The side stream's joins; then, on every graph, host operands for writes into host caches (only
        copies of main-stream values right before their write) and the guards made device-safe."""
        return [StepPass("side_stream_joins", side_stream_joins),
                StepPass("host_cache_writes", self._host_cache_writes),
                StepPass("device_safe_guards", self._device_safe_guards)]

    def _host_cache_writes(self, ctx: CompileContext) -> HostCacheWritesReport:
        rep = self.host_cache_writes[ctx.graph_id] = host_cache_writes(ctx.gm)
        return rep

    def _device_safe_guards(self, ctx: CompileContext) -> List[str]:
        done = self.guards[ctx.graph_id] = device_safe_guards(ctx.gm)
        return done

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

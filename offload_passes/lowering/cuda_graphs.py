"""CUDA graphs for the lowered decode step of ``exe_mode="cuda"`` (``mode="reduce-overhead"`` or
``cuda_graphs=True``): the lowering's own capture, since Inductor's cudagraph trees would reorder the ops
across the install side stream and skip the host-resident caches.

* :func:`capture_problems`: the lowered graph checked before any capture (no host read of a device value,
  no device-side assert, no data-dependent shape, host tensors only at :data:`HOST_OPERANDS`, every op of
  ours with a CUDA kernel).
* :class:`GraphReplay`: per input signature, a warm-up call, then one capture, then replays; fixed inputs
  are checked by address before each replay, value checks run on the device (pinned error words).

Why skipping the wrappers' host checks on replay is safe: docs/cuda.md, "Host checks out of replay".
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import fx

from .._compat import HigherOrderOperator
from ..custom_ops.cuda._common import raise_device_errors

log = logging.getLogger("offload_passes.lowering.cuda_graphs")

__all__ = ["capture_problems", "HOST_OPERANDS", "GraphReplay", "TorchCudaGraph", "CaptureRefused",
           "InputSpec", "input_specs", "GRAPH_FACTORY", "MAX_CAPTURES"]

aten = torch.ops.aten

#: Ops that synchronise with the host or assert on the device, with the reason a capture refuses them.
SYNC_OPS = {
    aten._local_scalar_dense.default: "reads a device value on the host (.item())",
    aten.item.default: "reads a device value on the host (.item())",
    aten.equal.default: "reads a device value on the host (aten.equal returns a Python bool)",
    aten.is_nonzero.default: "reads a device value on the host",
    aten._assert_async.default: "device-side assert (fatal to the CUDA context; use offload_cuda::guard)",
    aten._assert_async.msg: "device-side assert (fatal to the CUDA context; use offload_cuda::guard)",
    aten.nonzero.default: "output shape depends on the data (a host synchronisation)",
    aten.masked_select.default: "output shape depends on the data (a host synchronisation)",
    aten.unique_consecutive.default: "output shape depends on the data (a host synchronisation)",
    aten._unique2.default: "output shape depends on the data (a host synchronisation)",
    aten.bincount.default: "output shape depends on the data (a host synchronisation)",
    aten.repeat_interleave.Tensor: "output shape depends on the data (a host synchronisation)",
}


def _host_operands() -> dict:
    ops = {torch.ops.custom.dsa_serve.default: (1, 2), torch.ops.custom.dsa_serve_functional.default: (1, 2),
           # the baseline gather of a paged group with host KV (full_k_rope, full_kv_cache)
           torch.ops.custom.npu_gather_selection_kv_cache.default: (5, 6),
           torch.ops.custom.npu_gather_selection_kv_cache_functional.default: (5, 6)}
    try:
        ops[torch.ops.offload_ref.npu_mla_prolog_cache_write_.default] = (0, 1)
        ops[torch.ops.offload_ref.static_cache_write_.default] = (0, 1)
    except (AttributeError, RuntimeError):  # the reference ops are not loaded (a bare custom_ops import)
        pass
    return ops


#: op -> positions of the arguments its CUDA kernel reads or writes through a pinned host address
#: (``custom_ops/cuda/dsa_serve.py``, ``custom_ops/cuda/npu_gather_selection_kv_cache.py``: the full caches read;
#: ``custom_ops/cuda/cache_write.py``, ``custom_ops/cuda/static_cache_write.py``: the caches written)
HOST_OPERANDS = _host_operands()


def _ops_without_cuda_kernel() -> dict:
    """Our ops (``custom_ops.OP_SPECS``) whose spec names no CUDA kernel (``OpSpec.cuda_kernel`` is None)."""
    from ..custom_ops import OP_SPECS

    out = {}
    for spec in OP_SPECS:
        if spec.cuda_kernel:
            continue
        for name in spec.op_names:
            op = getattr(getattr(torch.ops, spec.namespace), name, None)
            if op is not None:
                out[op.default] = name
    return out


def _devices(v: Any) -> List[torch.device]:
    if isinstance(v, torch.Tensor):
        return [v.device]
    if isinstance(v, (list, tuple)):
        return [d for x in v for d in _devices(x)]
    return []


def _val(n: fx.Node) -> Any:
    """A node's example value: ``val`` after AOT, ``example_value`` in a Dynamo graph."""
    return n.meta.get("val", n.meta.get("example_value"))


def _host_kv_nodes(graph: fx.Graph) -> set:
    """Host tensors allowed in a capture: placeholders (and views of them) whose every non-view use is a
    pinned-address operand of :data:`HOST_OPERANDS`."""
    from ..passes import _fx

    ok: set = set()
    for p in graph.nodes:
        if p.op != "placeholder" or torch.device("cpu") not in _devices(_val(p)):
            continue
        views, todo, good = {p}, [p], True
        while todo and good:
            n = todo.pop()
            for u in n.users:
                if _fx.is_view(u) and u.args and u.args[0] is n:
                    if u not in views:
                        views.add(u)
                        todo.append(u)
                    continue
                pos = HOST_OPERANDS.get(u.target, ())
                if not any(i < len(u.args) and u.args[i] is n for i in pos) or \
                        any(a is n for i, a in enumerate(u.args) if i not in pos):
                    good = False
                    break
        if good:
            ok |= views
    return ok


def capture_problems(gm: "fx.GraphModule | fx.Graph") -> List[str]:
    """What would keep ``gm`` (a lowered graph with ``meta["val"]`` on its nodes) out of one CUDA-graph
    capture: one line per node, ``"<node>: <target>: <reason>"``; empty when it is capturable."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    host_only = _ops_without_cuda_kernel()
    host_kv = _host_kv_nodes(graph)
    # a graph without any CUDA value (the cuda mode on host tensors) has no host/device boundary to check
    on_device = any(d.type == "cuda" for n in graph.nodes for d in _devices(_val(n)))
    out: List[str] = []
    for n in graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module", "placeholder"):
            continue
        if n.op == "call_method":
            if n.target in ("item", "tolist", "cpu", "numpy"):
                out.append(f"{n.name}: .{n.target}(): reads a device value on the host")
            continue
        if n.op == "call_module":
            out.append(f"{n.name}: module {n.target}: not a lowered graph (call_module)")
            continue
        t = n.target
        if t in SYNC_OPS:
            out.append(f"{n.name}: {t}: {SYNC_OPS[t]}")
            continue
        if t in host_only:
            out.append(f"{n.name}: {t}: has no CUDA kernel (its OpSpec.cuda_kernel is None)")
            continue
        if t is aten.index.Tensor and any(isinstance(i, fx.Node) and isinstance(_val(i), torch.Tensor)
                                          and _val(i).dtype == torch.bool for i in (n.args[1] or ())):
            out.append(f"{n.name}: {t}: boolean-mask indexing (output shape depends on the data)")
            continue
        if isinstance(t, HigherOrderOperator):
            out.append(f"{n.name}: {t}: a higher-order op (control flow) is not checked for capture")
            continue
        if n in host_kv or not on_device:
            continue
        if torch.device("cpu") in _devices(_val(n)):
            what = "a host input" if n.op == "placeholder" else "a host tensor"
            out.append(f"{n.name}: {t}: {what} other than a full cache read or written through its pinned "
                       "address (a host copy or a pageable host tensor inside the capture)")
    return out


# ---------------------------------------------------------------------------------------------- replay


class CaptureRefused(RuntimeError):
    """A call :class:`GraphReplay` cannot replay, or a step whose capture failed (the message names the input
    or the operation)."""


@dataclass(frozen=True)
class InputSpec:
    """How one input of the captured step is treated on replay.

    ``kind``: ``"fixed"`` (same allocation every call: parameters, buffers, host caches, offload state),
    ``"copy"`` (copied into a static buffer before each replay: the token ids, positions), ``"value"`` (a
    non-tensor argument: part of the signature a capture is made for)."""

    name: str
    kind: str


class TorchCudaGraph:
    """The capture API :class:`GraphReplay` uses, over ``torch.cuda.CUDAGraph``. Tests replace it
    (:data:`GRAPH_FACTORY`) with a TEST DOUBLE of the same methods (tests/cuda/_capture_double.py)."""

    def __init__(self, pool: Any = None):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    @staticmethod
    def applies(example_inputs: Sequence[Any]) -> bool:
        """Whether a graph with these inputs has anything to capture: a CUDA tensor among them (a graph on
        host tensors runs op by op, as cudagraph trees skip a CPU graph)."""
        return any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)

    def capture(self, fn: Callable[[], Any]) -> Any:
        """Capture ``fn()`` (its launches on the capturing stream and the streams that join it)."""
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


#: What :class:`GraphReplay` captures with when the lowering builds it (a class with ``applies``,
#: ``capture`` and ``replay``); tests/cuda swap in a TEST DOUBLE.
GRAPH_FACTORY: Any = TorchCudaGraph

#: captures kept per lowered graph (one per input signature); calls with further signatures run eagerly
MAX_CAPTURES = 8


def _sig(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


@dataclass
class _Capture:
    """One signature's captured graph: its static inputs (the fixed inputs themselves, static buffers for
    the copied ones) and the captured outputs."""

    graph: Any
    static: List[Any]
    out: Any
    replays: int = 0


class GraphReplay:
    """The lowered step as captured graphs, one per input signature (see the module doc).

    ``fn(*args)``: the lowered step. ``specs``: one :class:`InputSpec` per argument. ``mutated``: inputs the
    step writes in place (a ``"copy"`` one is copied back after each replay). ``graph_factory()``: a
    :class:`TorchCudaGraph` (or a test double). ``warmup``: eager calls of a signature before its capture (at
    least 1). ``max_captures``: signatures captured; others run eagerly. A fixed input at a new address drops
    its capture (that call runs eagerly); a replay's outputs are overwritten by the next one.
    """

    def __init__(self, fn: Callable, specs: Sequence[InputSpec], *, mutated: Sequence[int] = (),
                 graph_factory: Callable[[], Any] = TorchCudaGraph, warmup: int = 1,
                 max_captures: int = MAX_CAPTURES):
        if warmup < 1:
            raise ValueError(f"GraphReplay: warmup must be >= 1 (the first call compiles the Triton kernels and "
                             f"runs the host checks eagerly), got {warmup}")
        self.fn = fn
        self.specs = list(specs)
        self.mutated = tuple(mutated)
        self.graph_factory = graph_factory
        self.warmup = warmup
        self.max_captures = max_captures
        self.calls = 0
        #: replays over every signature (a capture's own first replay not counted)
        self.replays = 0
        #: calls run eagerly: warm-ups, and signatures beyond ``max_captures``
        self.eager_calls = 0
        self.captures: dict = {}
        #: captures dropped because a fixed input moved (a new cache or state at the same shapes)
        self.recaptures = 0
        self._seen: dict = {}  # signature -> eager calls so far

    @property
    def graph(self) -> Any:
        """The graph of the first capture (None before any)."""
        return next(iter(self.captures.values())).graph if self.captures else None

    @property
    def _static(self) -> List[Any]:
        return next(iter(self.captures.values())).static if self.captures else []

    def _signature(self, args: Sequence[Any]) -> tuple:
        if len(args) != len(self.specs):
            raise CaptureRefused(f"captured step: called with {len(args)} inputs, captured with {len(self.specs)}")
        key = []
        for a, spec in zip(args, self.specs):
            if spec.kind == "value":
                key.append(("value", a if isinstance(a, (int, float, bool, str, type(None))) else repr(a)))
            elif not isinstance(a, torch.Tensor):
                raise CaptureRefused(f"captured step: input {spec.name} is a {type(a).__name__}, traced as a tensor")
            else:
                key.append(_sig(a))
        return tuple(key)

    def _moved(self, args: Sequence[Any], cap: _Capture) -> Optional[str]:
        """The first fixed input at another address than at ``cap``'s capture (a new cache, its new state), or
        None."""
        for a, spec, st in zip(args, self.specs, cap.static):
            if spec.kind == "fixed" and a.data_ptr() != st.data_ptr():
                return f"{spec.name} (address {a.data_ptr():#x}, captured {st.data_ptr():#x})"
        return None

    def _capture(self, args: Sequence[Any]) -> _Capture:
        static = []
        for a, spec in zip(args, self.specs):
            if spec.kind == "copy":
                buf = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                buf.copy_(a)
                static.append(buf)
            else:
                static.append(a)
        graph = self.graph_factory()
        try:
            out = graph.capture(lambda: self.fn(*static))
        except CaptureRefused:
            raise
        except RuntimeError as e:
            # a host synchronisation inside the capture (torch: "operation not permitted when stream is
            # capturing"); the eager step ran in the warm-up, so it is the capture that refuses it
            raise CaptureRefused(f"captured step: the capture failed: {e}") from e
        cap = _Capture(graph, static, out)
        log.info("captured the step (%d inputs, %d copied per replay; capture %d of this graph)", len(args),
                 sum(s.kind == "copy" for s in self.specs), len(self.captures) + 1)
        # the capture recorded the launches without running them: run once for this call's results
        graph.replay()
        return cap

    def __call__(self, *args: Any) -> Any:
        # a guard or kernel flagged on the device by the previous call raises here, on the host
        raise_device_errors()
        self.calls += 1
        key = self._signature(args)
        cap = self.captures.get(key)
        if cap is None:
            seen = self._seen.get(key, 0)
            if seen < self.warmup or len(self.captures) >= self.max_captures:
                if seen == self.warmup:  # warmed up, but no capture left: said once per signature
                    log.warning("captured step: %d signatures captured (max_captures); this one runs eagerly",
                                len(self.captures))
                self._seen[key] = seen + 1
                self.eager_calls += 1
                return self.fn(*args)
            cap = self.captures[key] = self._capture(args)
            static = cap.static
        else:
            moved = self._moved(args, cap)
            if moved is not None:
                # a graph replays fixed addresses: the capture of the old allocations is dropped (nothing keeps
                # them alive), this call runs eagerly for the new ones (their first use: the once-per-allocation
                # checks) and the next call with them captures again
                log.info("captured step: fixed input %s moved; capturing again", moved)
                del self.captures[key]
                self._seen[key] = self.warmup  # this eager call is the new allocations' warm-up
                self.recaptures += 1
                self.eager_calls += 1
                return self.fn(*args)
            static = cap.static
            for a, spec, st in zip(args, self.specs, static):
                if spec.kind == "copy" and a.data_ptr() != st.data_ptr():
                    st.copy_(a)
            cap.graph.replay()
            cap.replays += 1
            self.replays += 1
        for i in self.mutated:
            if self.specs[i].kind == "copy" and args[i].data_ptr() != static[i].data_ptr():
                args[i].copy_(static[i])
        return cap.out


def _call_argument(source: Any) -> bool:
    """Whether a Dynamo source names an argument of the call itself (``L['input_ids']``, ``L['kwargs']['x']``,
    ``L['args'][0]``), not a tensor reached through an object (``L['self']._buffers['kv']``,
    ``L['past_key_values'].layers[0].keys``): the caller may pass a new tensor each call."""
    name = getattr(source, "name", source)  # a Dynamo Source's name: a property (a method in older torch)
    return bool(_CALL_ARGUMENT.match(str(name() if callable(name) else name)))


_CALL_ARGUMENT = re.compile(r"^L\['[^']+'\](\[(\d+|'[^']+')\])*$")


def input_specs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> List[InputSpec]:
    """The :class:`InputSpec` of each input of ``gm`` (the graph the lowering receives, the offload state
    appended by the backend as its last inputs, ``passes/state_inputs.py``).

    Copied: a tensor argument of the call itself (the token ids, positions: Dynamo source ``L['name']``).
    Fixed: everything else, checked by address before each replay: a ``torch.nn.Parameter``, an input
    Dynamo marked static (``_dynamo_static_input_type``), a tensor reached through an object (a module's
    parameters and buffers, a cache's tensors), an input with no Dynamo source (the offload state: chosen
    by the caches, allocated once), and, in a graph with CUDA tensors, every host tensor (the full caches:
    :func:`capture_problems` allows no other host input). Non-tensors are values (part of the signature)."""
    nodes = [p for p in gm.graph.nodes if p.op == "placeholder"]
    if len(nodes) != len(example_inputs):
        raise ValueError(f"input_specs: the graph has {len(nodes)} inputs, example_inputs {len(example_inputs)}")
    on_device = any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)
    specs: List[InputSpec] = []
    for node, x in zip(nodes, example_inputs):
        if not isinstance(x, torch.Tensor):
            specs.append(InputSpec(node.name, "value"))
            continue
        ga = node.meta.get("grapharg")
        source = getattr(ga, "source", None) or getattr(node, "_dynamo_source", None)
        example = getattr(ga, "example", None)
        static = (source is None or not _call_argument(source) or (on_device and x.device.type == "cpu")
                  or isinstance(x, torch.nn.Parameter) or isinstance(example, torch.nn.Parameter)
                  or getattr(x, "_dynamo_static_input_type", None) is not None
                  or getattr(example, "_dynamo_static_input_type", None) is not None)
        specs.append(InputSpec(node.name, "fixed" if static else "copy"))
    return specs

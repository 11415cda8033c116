"""TEST DOUBLE of ``torch.cuda.CUDAGraph`` for whole compiled steps (no GPU here): :class:`DispatchCaptureGraph`.

It stands behind ``offload_passes.lowering.cuda_graphs.GRAPH_FACTORY`` (the interface of ``TorchCudaGraph``:
``applies``, ``capture``, ``replay``) and works at the dispatcher, where a CUDA graph works at the driver:

* ``capture(fn)`` runs ``fn`` once under a dispatch mode that records every operation the step dispatches
  (the op, its arguments, its result: the tensors themselves, i.e. fixed addresses), then restores every
  tensor those operations wrote (a capture records launches, it does not execute them);
* ``replay()`` re-runs the recorded operations in order on the same tensors and writes each functional
  result into the tensor recorded as that result (views and in-place results alias what they wrote), so
  the outputs captured are the outputs of every replay, as on a GPU. Python code between the operations
  (the lowered step's own host checks) is not replayed, as on a GPU;
* a host synchronisation on a CUDA tensor inside the capture raises ``RuntimeError`` naming the operation,
  as a capture on a GPU fails (``cudaErrorStreamCaptureUnsupported``): reading a device value on the host
  (``.item()``, ``aten.equal``, ``is_nonzero``), a device-to-host copy, an output whose shape depends on the
  data (``nonzero``, ``masked_select``, ...).

Where the tensors are fake (``_fake_cuda.py``) the recorded ops are the step's structure; where they are CPU
tensors (the cuda mode on a CPU, the Triton kernels' CPU twins) the replays compute real values. What it
cannot show: the driver's own behaviour (events and a side stream inside a real capture, Triton launches
with pinned host pointers, ``torch.topk`` without a synchronisation): a GPU's.
"""
from __future__ import annotations

from typing import Any, Callable, List, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

#: ops that read a device value on the host or size their output by the data
SYNCING = {
    aten._local_scalar_dense.default, aten.item.default, aten.equal.default, aten.is_nonzero.default,
    aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default,
    aten.bincount.default, aten.repeat_interleave.Tensor, aten._assert_async.default, aten._assert_async.msg,
}


def _cuda(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cuda"


def _sync_reason(func: Any, args: Sequence[Any], kwargs: dict, out: Any) -> str | None:
    ins = tree_flatten((args, kwargs))[0]
    if func in SYNCING and any(_cuda(a) for a in ins):
        return "reads a device value on the host or sizes its output by the data"
    if func in (aten._to_copy.default, aten.copy_.default, aten.copy.default):
        src = args[0] if func is aten._to_copy.default else args[1]
        dst = out if func is aten._to_copy.default else args[0]
        if _cuda(src) and isinstance(dst, torch.Tensor) and dst.device.type == "cpu":
            return "copies a device tensor to the host"
    return None


def _written(func: Any, args: Sequence[Any], kwargs: dict) -> List[torch.Tensor]:
    schema = func._schema
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(arg.name)
        out += [t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)]
    return out


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: "DispatchCaptureGraph"):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        g = self.graph
        for t in _written(func, args, kwargs):
            if id(t) not in g.before:
                g.before[id(t)] = (t, t.clone())
        out = func(*args, **kwargs)
        why = _sync_reason(func, args, kwargs, out)
        if why is not None:
            raise RuntimeError(f"TEST DOUBLE capture: {func} {why}: operation not permitted when stream is "
                               "capturing")
        g.records.append((func, args, kwargs, out))
        return out


class DispatchCaptureGraph:
    """TEST DOUBLE of ``torch.cuda.CUDAGraph`` (module doc). ``records``: (op, args, kwargs, result) of the
    capture; ``replays``: replays run (the capture's own first replay included)."""

    def __init__(self) -> None:
        self.records: list = []
        self.replays = 0
        self.before: dict = {}
        self.captured = False

    @staticmethod
    def applies(example_inputs: Sequence[Any]) -> bool:
        return True  # CPU-tensor graphs too: their replays compute the values the tests compare

    @property
    def ops(self) -> List[str]:
        """The captured operations' names, in order (``custom::dsa_serve``, ``aten::mm``, ...)."""
        return [f._schema.name for f, *_ in self.records]

    def capture(self, fn: Callable[[], Any]) -> Any:
        try:
            with _Recorder(self):
                return fn()
        finally:
            for t, value in self.before.values():
                with torch.no_grad():
                    t.copy_(value)
            self.before.clear()
            self.captured = True

    def replay(self) -> None:
        self.replays += 1
        with torch.no_grad():
            for func, args, kwargs, out in self.records:
                new = func(*args, **kwargs)
                if func._schema.returns and all(r.alias_info is None for r in func._schema.returns):
                    for dst, src in zip(tree_flatten(out)[0], tree_flatten(new)[0]):
                        if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
                            dst.copy_(src)


class Graphs:
    """Every :class:`DispatchCaptureGraph` made while installed (``install`` below), in order."""

    def __init__(self) -> None:
        self.made: List[DispatchCaptureGraph] = []

    def __call__(self) -> DispatchCaptureGraph:
        g = DispatchCaptureGraph()
        self.made.append(g)
        return g

    def applies(self, example_inputs: Sequence[Any]) -> bool:
        return DispatchCaptureGraph.applies(example_inputs)


def install(monkeypatch: Any) -> Graphs:
    """Make the lowering capture with the TEST DOUBLE (``cuda_graphs.GRAPH_FACTORY``); returns the registry of
    the graphs it makes."""
    from offload_passes.lowering import cuda_graphs

    reg = Graphs()
    monkeypatch.setattr(cuda_graphs, "GRAPH_FACTORY", reg)
    return reg

"""The state's recording hook: recorders a state calls with what its groups' ``dsa_plan`` calls receive.

A :class:`Recorder` is any callable ``rec(group, topk, lengths)``: ``group`` the index of the state's
group, ``topk [B, raw_seq, K]`` int32 and ``lengths [B]`` the call's inputs (the planner's; views, valid
during the call only: a recorder that keeps them copies them). ``OffloadState.add_recorder`` /
``remove_recorder`` attach one; while a state has recorders, one ``dsa_plan`` observer
(``custom_ops/dsa_plan.py``) hands them the calls whose ``pool_ids`` are one of the state's groups'.

``OffloadState.record_trace()`` / ``trace()`` use the recorder a trace package supplies
(:func:`set_trace_recorder`; ``offload_passes.trace`` does it when imported): the state knows nothing of
the trace format.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Protocol

import torch

from ..custom_ops import dsa_plan


class Recorder(Protocol):
    """What a state's recording hook calls, once per ``dsa_plan`` call of one of its groups."""

    def __call__(self, group: int, topk: torch.Tensor, lengths: torch.Tensor) -> None: ...


class TraceRecorder(Recorder, Protocol):
    """The recorder behind ``OffloadState.record_trace()``: also turns what it recorded into a trace."""

    def trace(self, state: Any, model: str) -> Any: ...


_trace_factory: Optional[Callable[[], TraceRecorder]] = None


def set_trace_recorder(factory: Callable[[], TraceRecorder]) -> None:
    """The factory ``OffloadState.record_trace()`` makes its recorder with (the trace package's)."""
    if not callable(factory):
        raise TypeError(f"set_trace_recorder: factory must be a callable returning a recorder, got "
                        f"{type(factory).__name__}")
    global _trace_factory
    _trace_factory = factory


def new_trace_recorder() -> TraceRecorder:
    """A recorder from the registered factory (RuntimeError when no trace package registered one)."""
    if _trace_factory is None:
        raise RuntimeError("OffloadState.record_trace: no trace recorder is registered: import offload_passes.trace "
                           "(it registers its recorder), or attach your own with OffloadState.add_recorder")
    return _trace_factory()


class Recording:
    """The recorders of one state and the ``dsa_plan`` observer that feeds them (registered while there are
    any). The observer holds the state weakly: a state dropped while recording records nothing more."""

    def __init__(self, state: Any) -> None:
        self._state = weakref.ref(state)
        self.recorders: list[Recorder] = []
        self._observer: Optional[Callable] = None

    def add(self, rec: Recorder, where: str) -> None:
        if not callable(rec):
            raise TypeError(f"{where}: recorder must be a callable rec(group, topk, lengths), got "
                            f"{type(rec).__name__}")
        if any(r is rec for r in self.recorders):
            raise ValueError(f"{where}: this recorder is attached already")
        self.recorders.append(rec)
        if self._observer is None:
            ref = weakref.ref(self)
            self._observer = lambda topk, lengths, pool_ids, raw_seq: _observe(ref, topk, lengths, pool_ids,
                                                                              raw_seq)
            dsa_plan.add_plan_observer(self._observer)

    def remove(self, rec: Recorder, where: str) -> None:
        if all(r is not rec for r in self.recorders):
            raise ValueError(f"{where}: this recorder is not attached")
        self.recorders = [r for r in self.recorders if r is not rec]
        if not self.recorders and self._observer is not None:
            dsa_plan.remove_plan_observer(self._observer)
            self._observer = None

    def has(self, rec: Recorder) -> bool:
        return any(r is rec for r in self.recorders)

    def deliver(self, topk: torch.Tensor, lengths: torch.Tensor, pool_ids: torch.Tensor, raw_seq: int) -> None:
        """One ``dsa_plan`` call: to every recorder when its ``pool_ids`` are one of the state's groups'."""
        state = self._state()
        if state is None:
            return
        ptr = pool_ids.data_ptr()
        for i, g in enumerate(state.groups):
            if g.pool_ids.data_ptr() == ptr:
                B, K = topk.size(0), topk.size(-1)
                for rec in list(self.recorders):
                    rec(i, topk.detach().reshape(B, raw_seq, K), lengths.detach())
                return


def _observe(ref: "weakref.ref[Recording]", topk: torch.Tensor, lengths: torch.Tensor, pool_ids: torch.Tensor,
             raw_seq: int) -> None:
    rec = ref()
    if rec is not None:
        rec.deliver(topk, lengths, pool_ids, raw_seq)

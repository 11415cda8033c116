"""TEST DOUBLE for the CANN-linked module ``torch_npu`` (and ``torch.npu``), for npugraph_ex tests.

npugraph_ex is pure Python but imports ``torch_npu`` in ``AclConcreteGraph``, ``static_kernel`` and
``ops/_tagged_event``, and calls ``torch.npu.*`` stream/event/graph APIs. This stub, modelled on the
``StubNpu`` of TorchAir's own system tests, provides those names so a graph can be compiled with
``force_eager=True`` and then run op by op on CPU. Nothing here captures or replays a graph; streams
and events are inert objects (CPU runs the graph in program order). It records which stream/event
calls were made so tests can inspect them.

Never install this for GE-mode tests: TorchAir then reads NPU options from ``torch_npu.npu``.
"""
from __future__ import annotations

import contextlib
import sys
import types
from typing import Dict, List, Optional

import torch

CALLS: List[str] = []


class Stream(torch.Stream):
    """A CPU ``torch.Stream`` (so ``Tensor.record_stream`` accepts it); ordering is program order."""

    _count = 0

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls, device="cpu")

    def __init__(self, device=None, priority=0, **kwargs) -> None:
        Stream._count += 1
        self.number = Stream._count
        self.requested_priority = priority

    def wait_event(self, event) -> None:
        CALLS.append("Stream.wait_event")

    def wait_stream(self, stream) -> None:
        CALLS.append("Stream.wait_stream")

    def record_event(self, event=None):
        CALLS.append("Stream.record_event")
        return event if event is not None else Event()

    def synchronize(self) -> None:
        CALLS.append("Stream.synchronize")

    def query(self) -> bool:
        return True


class Event:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        CALLS.append("Event.record")

    def wait(self, stream=None) -> None:
        CALLS.append("Event.wait")

    def reset(self, stream=None) -> None:
        CALLS.append("Event.reset")

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class NPUGraph:
    """Graph capture is not possible on CPU: every capture entry point raises."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def capture_begin(self, *args, **kwargs):
        raise RuntimeError("TEST DOUBLE torch_npu: NPU graph capture is unavailable on CPU")

    def capture_end(self):
        raise RuntimeError("TEST DOUBLE torch_npu: NPU graph capture is unavailable on CPU")

    def replay(self):
        raise RuntimeError("TEST DOUBLE torch_npu: NPU graph replay is unavailable on CPU")

    def reset(self) -> None:
        pass

    def pool(self):
        return (0, 1)


_current = Stream()

#: Raised where npugraph_ex would begin ACL graph capture (tests stop a real compile there).
CAPTURE_UNAVAILABLE = "TEST DOUBLE torch_npu: NPU graph capture is unavailable on CPU"


def graph(*args, **kwargs):
    """``torch_npu.npu.graph(g, pool=, stream=)``: the capture context; raises (no capture on CPU)."""
    CALLS.append("graph")
    raise RuntimeError(CAPTURE_UNAVAILABLE)


@contextlib.contextmanager
def stream(s=None):
    CALLS.append("stream")
    yield


def current_stream(device=None) -> Stream:
    return _current


def set_stream(s) -> None:
    CALLS.append("set_stream")


class _Conf:
    allow_hf32 = False


class _Utils:
    @staticmethod
    def _is_gte_cann_version(version, module="CANN") -> bool:
        return True

    @staticmethod
    def get_cann_version() -> str:
        return "0"


def _noop(*args, **kwargs):
    return None


def make_npu_module() -> types.ModuleType:
    """The ``torch_npu.npu`` / ``torch.npu`` double."""
    npu = types.ModuleType("torch_npu.npu", "TEST DOUBLE for torch_npu.npu")
    npu.TEST_DOUBLE = True
    npu.Stream = Stream
    npu.Event = Event
    npu.ExternalEvent = Event
    npu.NPUGraph = NPUGraph
    npu.graph = graph
    npu.stream = stream
    npu.current_stream = current_stream
    npu.default_stream = current_stream
    npu.set_stream = set_stream
    npu.current_device = lambda: 0
    npu.device_count = lambda: 1
    npu.is_available = lambda: False
    npu.synchronize = _noop
    npu.empty_cache = _noop
    npu.graph_pool_handle = lambda: (0, 1)
    npu.memory_snapshot = lambda: []
    npu.get_stream_limit = lambda s: {"cube_core_num": 24, "vector_core_num": 48}
    npu.get_device_limit = lambda d: {"cube_core_num": 24, "vector_core_num": 48}
    npu.set_stream_limit = _noop
    npu.matmul = _Conf()
    npu.conv = _Conf()
    npu.utils = _Utils
    npu._get_deterministic_level = lambda: 0
    npu.is_initialized = lambda: True
    npu.streams = types.SimpleNamespace(Stream=Stream, Event=Event, ExternalStream=Stream)
    return npu


def make_module() -> types.ModuleType:
    mod = types.ModuleType("torch_npu", __doc__)
    mod.__file__ = __file__
    mod.TEST_DOUBLE = True
    mod.npu = make_npu_module()
    mod._C = types.SimpleNamespace(_aclop_start_dump=_noop, _aclop_stop_dump=_noop)
    mod.get_npu_format = lambda t: 2
    mod.distributed = types.SimpleNamespace()
    mod.__version__ = "0.0.0+testdouble"
    return mod


@contextlib.contextmanager
def installed():
    """Install the double as ``torch_npu`` / ``torch.npu`` for the duration of the block."""
    saved_mod: Dict[str, Optional[types.ModuleType]] = {
        k: sys.modules.get(k) for k in ("torch_npu", "torch_npu.npu")
    }
    had_npu = hasattr(torch, "npu")
    saved_npu = getattr(torch, "npu", None)
    mod = make_module()
    # CPU has no streams: Tensor.record_stream (used by npugraph_ex's record_tagged_stream) is a no-op
    rs_lib = torch.library.Library("aten", "IMPL")
    rs_lib.impl("record_stream", lambda self, stream: None, "CPU")
    sys.modules["torch_npu"] = mod
    sys.modules["torch_npu.npu"] = mod.npu
    torch.npu = mod.npu
    CALLS.clear()
    try:
        yield mod
    finally:
        rs_lib._destroy()
        for k, v in saved_mod.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        if had_npu:
            torch.npu = saved_npu
        else:
            delattr(torch, "npu")

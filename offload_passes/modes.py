"""The exe_modes: the one list (options, the backend, the NPU modes and the model config read it).

Each mode names its lowering (the only part of the backend that differs per mode), whether the state is
passed per call as graph inputs chosen by the caches (``shared_state``) or kept as graph buffers, and
whether the rewrite emits the in-graph run-time guards (``aten._assert_async``; GE has no converter for
it). Lowerings are imported lazily: the NPU ones need TorchAir / npugraph_ex only when used.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Mode", "MODES", "EXE_MODES", "CPU_EXE_MODES", "NPU_EXE_MODES", "CUDA_EXE_MODES", "lowering_for"]


@dataclass(frozen=True)
class Mode:
    name: str
    platform: str  # "cpu" | "npu" | "cuda"
    lowering: str  # "module:Class", called as Class(mode, **lowering_kw)
    guards: bool  # in-graph run-time guards
    replacement_policies: tuple[str, ...]  # install kernels this platform has


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("eager", "cpu", "offload_passes.lowering_cpu:CpuLowering", True, ("fifo", "second_chance")),
    Mode("inductor", "cpu", "offload_passes.lowering_cpu:CpuLowering", True, ("fifo", "second_chance")),
    # CANN's NPU kernels implement FIFO only
    Mode("ge_graph", "npu", "offload_passes.npu_modes:NpuLowering", False, ("fifo",)),
    Mode("npugraph_ex", "npu", "offload_passes.npu_modes:NpuLowering", False, ("fifo",)),
    # CUDA tensors: the eager lowering with installs on a side stream; Triton kernels (docs/cuda.md)
    Mode("cuda", "cuda", "offload_passes.lowering_cuda:CudaLowering", True, ("fifo", "second_chance")),
)}

EXE_MODES: tuple[str, ...] = tuple(MODES)
CPU_EXE_MODES: tuple[str, ...] = tuple(n for n, m in MODES.items() if m.platform == "cpu")
NPU_EXE_MODES: tuple[str, ...] = tuple(n for n, m in MODES.items() if m.platform == "npu")
CUDA_EXE_MODES: tuple[str, ...] = tuple(n for n, m in MODES.items() if m.platform == "cuda")


def lowering_for(mode: str, **kw: Any) -> Any:
    """The lowering of ``mode``; ``kw`` are the NPU-only settings (``compiler_config``, ``npu_options``,
    ``side_stream``), refused by name for a mode whose lowering takes none."""
    if mode not in MODES:
        raise ValueError(f"exe_mode must be one of {EXE_MODES}, got {mode!r}")
    module, cls = MODES[mode].lowering.split(":")
    factory: Callable[..., Any] = getattr(importlib.import_module(module), cls)
    return factory(mode, **kw)

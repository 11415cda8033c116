"""The exe_modes: the one list (options, the backend, the NPU modes and the model config read it).

Each mode names its lowering (the only part of the backend that differs per mode), whether the state is
passed per call as graph inputs chosen by the caches (``state_from_caches``) or kept as graph buffers, and
whether the rewrite emits the in-graph run-time guards (``aten._assert_async``; GE has no converter for
it). Lowerings are imported lazily: the NPU ones need TorchAir / npugraph_ex only when used.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Mode", "MODES", "EXE_MODES", "CPU_EXE_MODES", "NPU_EXE_MODES", "CUDA_EXE_MODES", "REPLACEMENT_POLICIES",
           "check_exe_mode", "check_replacement_policy", "lowering_for"]

#: The pool replacement policies: ``fifo`` (CANN's ``custom::dsa_install``) and ``second_chance``
#: (``offload_ref::dsa_install_sc``, CPU / CUDA only). Each mode lists the ones its platform has, and its
#: default: FIFO where CANN's op runs and on the CPU (the reference's behaviour); on CUDA, where the project
#: owns the kernels, the policy with the best hit rate the trace study measures within the op's per-set
#: state word (``lru_counter``): second chance, 89.65 % against FIFO's 84.68 % at 8K (docs/cuda.md, "Which
#: replacement policy").
REPLACEMENT_POLICIES: tuple[str, ...] = ("fifo", "second_chance")


@dataclass(frozen=True)
class Mode:
    name: str
    platform: str  # "cpu" | "npu" | "cuda"
    lowering: str  # "module:Class", called as Class(mode, **lowering_kw)
    guards: bool  # in-graph run-time guards
    replacement_policies: tuple[str, ...]  # install kernels this platform has
    default_policy: str = "fifo"  # option replacement_policy=None


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("eager", "cpu", "offload_passes.lowering.cpu:CpuLowering", True, ("fifo", "second_chance")),
    Mode("inductor", "cpu", "offload_passes.lowering.cpu:CpuLowering", True, ("fifo", "second_chance")),
    # CANN's NPU kernels implement FIFO only
    Mode("ge_graph", "npu", "offload_passes.lowering.npu:NpuLowering", False, ("fifo",)),
    Mode("npugraph_ex", "npu", "offload_passes.lowering.npu:NpuLowering", False, ("fifo",)),
    # CUDA tensors: the eager lowering with installs on a side stream; Triton kernels
    Mode("cuda", "cuda", "offload_passes.lowering.cuda:CudaLowering", True, ("fifo", "second_chance"),
         "second_chance"),
)}

EXE_MODES: tuple[str, ...] = tuple(MODES)
CPU_EXE_MODES: tuple[str, ...] = tuple(n for n, m in MODES.items() if m.platform == "cpu")
NPU_EXE_MODES: tuple[str, ...] = tuple(n for n, m in MODES.items() if m.platform == "npu")
CUDA_EXE_MODES: tuple[str, ...] = tuple(n for n, m in MODES.items() if m.platform == "cuda")


def check_exe_mode(mode: Any, allowed: tuple[str, ...] = EXE_MODES, *, name: str = "exe_mode", where: str = "") -> str:
    """``mode`` if it is one of ``allowed``, else ``ValueError("<name> must be one of <allowed><where>, got ...")``.

    The one exe_mode check: options, the backend classes, the lowerings and the model config call it with
    their own ``allowed`` subset (``CPU_EXE_MODES`` ...) and wording (``name``, ``where``).
    """
    if mode not in allowed:
        want = f"be {allowed[0]!r}" if len(allowed) == 1 else f"be one of {allowed}"
        raise ValueError(f"{name} must {want}{where}, got {mode!r}")
    return mode


def check_replacement_policy(policy: Any, mode: str | None = None, *, name: str = "replacement_policy") -> str:
    """``policy`` if it is a known replacement policy (and, with ``mode``, one that mode's platform has)."""
    if policy not in REPLACEMENT_POLICIES:
        raise ValueError(f"{name} must be one of {REPLACEMENT_POLICIES}, got {policy!r}")
    if mode is not None and policy not in MODES[mode].replacement_policies:
        ok = tuple(n for n, m in MODES.items() if policy in m.replacement_policies)
        raise ValueError(f"{name}={policy!r} needs exe_mode in {ok}: CANN's NPU kernels implement only 'fifo'")
    return policy


def lowering_for(mode: str, **kw: Any) -> Any:
    """The lowering of ``mode``; ``kw`` are the NPU-only settings (``compiler_config``, ``npu_options``,
    ``side_stream``), refused by name for a mode whose lowering takes none."""
    check_exe_mode(mode)
    module, cls = MODES[mode].lowering.split(":")
    factory: Callable[..., Any] = getattr(importlib.import_module(module), cls)
    return factory(mode, **kw)

"""What the device tests share (tests marked ``device``, fixture ``dev`` of ``conftest.py``): where they run, bit
equality, host twins of device data, pinned host copies, and the benchmarks' modules (``benchmarks/`` on
``sys.path``: the tests check the models and plans the GPU benchmark times).

``OFFLOAD_PASSES_GPU=1``: the device tests run on the CUDA device with the compiled kernels (``scripts/lent_gpu.sh``);
otherwise on CPU tensors under Triton's interpreter.
"""
from __future__ import annotations

import os
import sys

import torch

ON_GPU = os.environ.get("OFFLOAD_PASSES_GPU") == "1"
BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)


def on_gpu(dev: torch.device) -> bool:
    return dev.type == "cuda"


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits (floating point as integers: NaN payloads and -0.0 compare exactly)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()]) if t.is_floating_point() else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and equal bits (wherever each lives)."""
    return a.shape == b.shape and torch.equal(bits(a.cpu()), bits(b.cpu()))


def twin(t: torch.Tensor) -> torch.Tensor:
    """A separate host copy of ``t`` for the CPU twin (``Tensor.cpu`` returns ``t`` itself on the CPU)."""
    return t.clone() if t.device.type == "cpu" else t.cpu()


def on(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A separate copy of host tensor ``t`` on ``dev``."""
    return t.to(dev) if dev.type != "cpu" else t.clone()


def pinned_like(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host copy of ``t``: pinned when ``dev`` is a CUDA device (the production case: a pinned cache)."""
    out = twin(t)
    if dev.type == "cuda":
        from offload_passes.cuda import host_pinned

        out = host_pinned(out)
    return out


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def assert_pinned_write_equals_cpu(run, op, cache: list, idx: torch.Tensor, new: list, dev: torch.device) -> None:
    """A write kernel ``run`` of device rows ``new`` at positions ``idx`` into pinned copies of ``cache`` equals
    the CPU kernel ``op`` on host copies of the same data, and the rows landed (the cache changed)."""
    ref = [twin(t) for t in cache]
    op(*ref, twin(idx), *[twin(t) for t in new])
    dst = [pinned_like(t, dev) for t in cache]
    run(*dst, idx, *new)
    sync()
    assert all(same(a, b) for a, b in zip(ref, dst))
    assert not same(ref[0], cache[0])

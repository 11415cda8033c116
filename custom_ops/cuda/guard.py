"""Triton kernel of the ``cuda`` mode's in-graph guards (``offload_cuda::guard``, ``lowering/cuda.py``).

``aten._assert_async`` on a CUDA tensor is a device-side assert: the CUDA context is lost and the process
with it. The ``cuda`` lowering replaces each guard by ``offload_cuda::guard(ok, msg)``: on the device this
kernel writes the guard's code into a pinned host error word when ``ok`` is false (no synchronisation, one
tiny launch, capturable), and the lowered step raises ``RuntimeError(msg)`` on the host before its next
call (``_common.raise_device_errors``; ``offload_passes.cuda.raise_device_errors`` after the last step).
"""
from __future__ import annotations

import torch

from ._common import ERR_GUARD, error_flags, guard_code, require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402


@triton.jit
def _guard_kernel(ok_ptr, flag_ptr, code):
    ok = tl.load(ok_ptr)
    tl.atomic_max(flag_ptr, code, mask=ok == 0)


def flag(ok: torch.Tensor, msg: str) -> None:
    """Set the guard word to ``msg``'s code where the one-element ``ok`` is false (on ``ok``'s device)."""
    f = error_flags(ok.device)
    _guard_kernel[(1,)](ok.reshape(1).to(torch.int32), f[ERR_GUARD:], guard_code(msg))

"""CUDA *correctness fallback* for the decode-path reference ops (``offload_ref::`` indexer, sparse flash
attention, cache writes): copy the arguments to the host, run the op's CPU kernel, copy the mutated
arguments and the outputs back.

Why: those ops are pure-torch CPU references (they build index tensors on the default device), and the
unmodified recipe model calls them, so without this a CUDA run of the recipe-form model could not even
produce the reference logits. Both sides of a comparison (unmodified and offload) go through the same
fallback, so the correctness check stays exact. It synchronises and moves data every call: **not a
performance path**; :data:`CALLS` counts its calls so that ``benchmarks/gpu_check.py`` flags timings that
include it. The offload ops themselves (plan / serve / install / gather) have real Triton kernels.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any, List

import torch

log = logging.getLogger("offload_passes.custom_ops.cuda.fallback")

#: op name -> calls through the fallback in this process
CALLS: Counter = Counter()


def _move(x: Any, dev: Any) -> Any:
    """Tensors (also inside lists / tuples) to ``dev``; everything else unchanged."""
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    if isinstance(x, (list, tuple)):
        return type(x)(_move(v, dev) for v in x)
    return x


def _kernel(op: Any, name: str):
    writes = [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]

    def kernel(*args: Any, **kwargs: Any) -> Any:
        CALLS[name] += 1
        dev = next(t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.is_cuda)
        host_args = [_move(a, "cpu") for a in args]
        out = op(*host_args, **{k: _move(v, "cpu") for k, v in kwargs.items()})
        for i in writes:  # mutated arguments: back into the caller's device tensors
            if i < len(args) and isinstance(args[i], torch.Tensor):
                args[i].copy_(host_args[i])
        return _move(out, dev)

    return kernel


def register(specs) -> List[str]:
    """CUDA fallback kernels of the ``offload_ref`` ops with role ``decode`` / ``cache_write`` and no
    Triton kernel (skipped where a CUDA kernel exists already)."""
    from .._attention_common import REF_NAMESPACE, ref_impl

    done = []
    for spec in specs:
        if spec.namespace != REF_NAMESPACE or spec.role not in ("decode", "cache_write") or spec.cuda_kernel:
            continue
        for name in spec.op_names:
            op = getattr(getattr(torch.ops, REF_NAMESPACE), name).default
            if ref_impl(name, "CUDA", _kernel(op, name)):
                done.append(name)
    return done

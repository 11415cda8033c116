"""Triton (CUDA) kernels of the offload ops: the CUDA implementation of the *same* schemas.

One module per op, named by the op's ``OpSpec.cuda_kernel`` (``dsa_plan``, ``dsa_serve``, ``dsa_install``,
``npu_gather_selection_kv_cache``, ``dsa_install_sc``, ``cache_write``: the host-KV write of
``offload_ref::npu_mla_prolog_cache_write_``; the recipe model's decode ops ``npu_lightning_indexer``,
``npu_quant_lightning_indexer``, ``npu_sparse_flash_attention``, and ``scatter_nd_update``: its indexer-cache
write ``offload_ref::npu_scatter_nd_update_``); ``guard.py`` is the kernel of the ``cuda`` mode's guards.
Each op module builds one ``_common.CudaOp`` from the op's ``OpSpec``: ``run(...)`` / ``run_functional(...)``
take the arguments as the schema does (``custom_ops/_library.py`` ``bind``), validate with the op's own
``validate_<op>`` once per signature, then launch; ``register()`` adds them as the CUDA kernels. The tests
call ``run`` on CPU tensors under ``TRITON_INTERPRET=1``.

Registration: ``import offload_passes`` calls :func:`autoregister`, which registers the CUDA kernels only
when torch sees a CUDA device *and* ``triton`` is installed (the ``[cuda]`` extra); on a CPU-only machine
triton is never imported. :func:`register_all` (``force=True``) registers them anyway (tests).
The C++ CPU kernels and the ``offload_ref::`` references stay the twins; nothing here changes CPU dispatch.
Every op the recipe model calls on its decode step has a kernel here, so no op of a compiled step runs on
the host (tests/cuda/test_decode_ops_on_device.py).
"""
from __future__ import annotations

import importlib
import logging
from typing import Iterable, List

import torch

from ._common import triton_available

log = logging.getLogger("offload_passes.custom_ops.cuda")

_registered: List[str] = []


def kernel_module(spec) -> "object":
    """The ``custom_ops.cuda`` module of an op (from ``spec.cuda_kernel``); KeyError if it has none."""
    if spec.cuda_kernel is None:
        raise KeyError(f"op {spec.qualname} has no CUDA kernel (OpSpec.cuda_kernel is None)")
    return importlib.import_module(f"{__name__}.{spec.cuda_kernel}")


def register_all(specs: Iterable | None = None, force: bool = False) -> List[str]:
    """Register the CUDA kernel of every spec naming one; returns the op names registered now.

    Without ``force`` nothing happens unless a CUDA device is visible and triton imports.
    """
    if not triton_available():
        if force:
            raise RuntimeError("offload_passes CUDA kernels need the `triton` package: pip install 'offload_passes[cuda]'")
        return []
    if not force and not torch.cuda.is_available():
        return []
    if specs is None:
        from .. import OP_SPECS as specs  # noqa: N811
    specs = list(specs)
    done: List[str] = []
    for spec in specs:
        if spec.cuda_kernel is not None:
            done += kernel_module(spec).register()
    _registered.extend(done)
    if done:
        log.info("registered Triton CUDA kernels: %s", ", ".join(done))
    return done


def autoregister(specs: Iterable) -> List[str]:
    """Import-time hook: CUDA kernels where a CUDA device and triton are present, else nothing."""
    try:
        if not torch.cuda.is_available() or not triton_available():
            return []
    except Exception:  # a broken CUDA driver must not break `import offload_passes`
        log.debug("CUDA availability check failed; Triton kernels not registered", exc_info=True)
        return []
    return register_all(specs)


def registered() -> List[str]:
    """Ops whose CUDA kernel this process registered."""
    return list(_registered)

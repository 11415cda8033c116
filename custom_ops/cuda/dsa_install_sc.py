"""Triton kernel of ``offload_ref::dsa_install_sc`` (twin of ``csrc/dsa_install_sc.cpp``).

The install kernels of ``cuda/dsa_install.py`` with the second-chance victim choice: each ``(b, set)``
program first ORs the reference bits of its set's POOL_HIT plan rows into its private counter, then
probes from the pointer, clearing and skipping referenced ways (at most 16, so one vector step).
"""
from __future__ import annotations


from .. import dsa_install_sc as M
from . import dsa_install as I
from ._common import CudaOp

OP = M.OP


def _validate(a: tuple, op: str) -> I.Launch:
    """``validate_dsa_install_sc`` and the launch constants of the signature."""
    M.validate_dsa_install_sc(*a)
    return I.prepare(a[5], a[6], a[8], a[10], a[11], a[12], second_chance=True)


def _launch_bound(a: tuple, cfg: I.Launch) -> None:
    """The install kernels on the op's bound arguments (schema order: ``plan`` first, the table unread)."""
    I.launch(*a[1:4], *a[5:10], a[13], cfg, plan=a[0])


#: ``offload_ref::dsa_install_sc`` on CUDA (``_common.CudaOp``: bound once, validated once per signature)
KERNELS = CudaOp(M.SPEC, _validate, _launch_bound)
run, register = KERNELS.run, KERNELS.register

"""Replay a trace through the real CPU kernels (``custom::dsa_plan`` + ``custom::dsa_install``).

One group, one layer, minimal payload (the payload does not influence the plan): per step, plan the
group's top-k against the pool metadata, count the plan kinds, install the misses with
``metadata_update=1``. This is the ground truth ``offload-sim``'s ``sa_fifo`` must reproduce step by step.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch

from ..custom_ops.plan_kind import NUM_PLAN_KINDS
from .format import Trace

log = logging.getLogger("offload_passes.trace.kernel_replay")


@torch.no_grad()
def replay_kernels(trace: Trace, pool_size: int, group: int = 0, id_range: Optional[int] = None,
                   install_op: Optional[str] = None) -> np.ndarray:
    """Plan-kind counts ``int64 [steps, 6]`` (``custom_ops/plan_kind.py``: column k counts ``PlanKind(k)``) of
    ``group`` under the kernels.

    ``install_op`` selects the install kernel: ``None`` = ``custom::dsa_install`` (FIFO), or the
    qualified name of an opt-in policy kernel whose schema is dsa_install's with the plan as an extra
    first input (``offload_ref::dsa_install_sc``).
    """
    from .. import custom_ops  # noqa: F401  (registers the ops)

    K, S, B = trace.K, trace.S, trace.B
    if K % 64:
        raise ValueError(f"replay_kernels: dsa_plan needs K % 64 == 0, got K={K}")
    IR = trace.id_range if id_range is None else id_range
    topk_all = torch.from_numpy(np.ascontiguousarray(trace.topk[:, group, :, :, :K]))
    lengths = torch.from_numpy(trace.lengths)
    sbs = 16
    nb = B * S * K // sbs
    D, Dr, dt = 1, 1, torch.float16
    sel_kv = torch.zeros(nb, sbs, D, dtype=dt)
    sel_rope = torch.zeros(nb, sbs, Dr, dtype=dt)
    sel_table = torch.arange(nb, dtype=torch.int32).view(B * S, K // sbs)
    pool_kv = torch.zeros(B, pool_size, D, dtype=dt)
    pool_rope = torch.zeros(B, pool_size, Dr, dtype=dt)
    pool_ids = torch.full((B, pool_size), -1, dtype=torch.int32)
    id_to_slot = torch.full((B, IR), -1, dtype=torch.int32)
    lru = torch.zeros(B, pool_size // 16, dtype=torch.int32)
    ops = torch.ops.custom
    install = ops.dsa_install if install_op is None else _resolve(install_op)
    out = np.zeros((trace.steps, NUM_PLAN_KINDS), dtype=np.int64)
    for t in range(trace.steps):
        tk = topk_all[t].reshape(B, S, 1, K).contiguous()
        plan, rec, _ = ops.dsa_plan(tk, lengths[t].contiguous(), pool_ids, id_to_slot, lru, raw_seq=S)
        out[t] = torch.bincount(plan[:, 0].long(), minlength=NUM_PLAN_KINDS)[:NUM_PLAN_KINDS].numpy()
        lead = () if install_op is None else (plan,)  # opt-in policies also read the plan (their hits)
        install(*lead, rec, sel_kv, sel_rope, sel_table, pool_kv, pool_rope, pool_ids, id_to_slot, lru,
                raw_seq=S, topk=K, selection_block_size=sbs, metadata_update=1)
    return out


def _resolve(qualname: str):
    ns, name = qualname.split("::", 1)
    return getattr(getattr(torch.ops, ns), name)

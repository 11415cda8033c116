"""MoE expert-parallel dispatch / combine with MC2's semantics, as traceable functional collectives.

MC2 (torch_npu ``npu_moe_distribute_dispatch_v2`` / ``npu_moe_distribute_combine_v2``) sends every
(token, k) pair of ``expert_ids [T, K]`` to the rank owning expert ``expert_ids[t, k]`` (experts
``[r*L, (r+1)*L)`` on rank r, ``L = E / W``), the experts run there, and combine returns each token
``sum_k expert_scales[t, k] * expert_out(t, k)`` in the dtype of the expert outputs.

The CPU form here keeps every shape static (what graph mode needs, as MC2's worst-case ``A`` rows do):
each rank sends every one of its ``C = T*K`` pairs to every rank, zeroed (and expert id -1) where that
rank does not own the expert, through one ``all_to_all_single`` of equal splits for the rows and one
for the local expert ids; combine sends the ``W*C`` result rows back the same way and picks, for each
pair, the row its owner returned. The compacted MC2 layout (``expand_x`` grouped by local expert,
``ep_recv_counts``, ``assist_info_for_combine``) is the ``offload_ref`` reference op
(``custom_ops/moe_distribute.py``); both give the same combined output.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import torch

from .parallel import ParallelLayout, all_to_all_rows

log = logging.getLogger("offload_passes.models.moe_comm")


@dataclass
class DispatchContext:
    """What combine needs from dispatch (all local to this rank)."""

    dest: torch.Tensor      # [T*K] int64: rank owning each pair's expert
    scales: torch.Tensor    # [T, K] fp32 routing weights (MC2's expert_scales)
    tokens: int
    k: int


def dispatch(x: torch.Tensor, expert_ids: torch.Tensor, scales: torch.Tensor, num_experts: int,
             layout: ParallelLayout) -> tuple[torch.Tensor, torch.Tensor, DispatchContext]:
    """``x [T, H]``, ``expert_ids [T, K]`` (global ids), ``scales [T, K]`` -> rows this rank's experts
    receive ``[W*C, H]`` (chunk j from rank j), their local expert ids ``[W*C]`` (-1: padding), context."""
    W = layout.world_size
    L = num_experts // W
    T, K = expert_ids.shape
    C = T * K
    ids = expert_ids.reshape(C).to(torch.int64)
    dest = torch.div(ids, L, rounding_mode="floor")
    local = ids - dest * L
    to = dest.unsqueeze(0) == torch.arange(W, device=x.device).unsqueeze(1)        # [W, C]
    pair_x = x.unsqueeze(1).expand(T, K, x.size(-1)).reshape(C, x.size(-1))
    send_x = torch.where(to.unsqueeze(-1), pair_x.unsqueeze(0), torch.zeros_like(pair_x).unsqueeze(0))
    send_e = torch.where(to, local.unsqueeze(0), torch.full_like(local, -1).unsqueeze(0))
    recv_x = all_to_all_rows(send_x.reshape(W * C, x.size(-1)), layout)
    recv_e = all_to_all_rows(send_e.reshape(W * C), layout)
    return recv_x, recv_e, DispatchContext(dest=dest, scales=scales, tokens=T, k=K)


def run_local_experts(experts: Iterable[torch.nn.Module], recv_x: torch.Tensor, recv_e: torch.Tensor) -> torch.Tensor:
    """Each local expert on every received row, kept where the row is its own (static shapes); rows
    of no expert (padding) stay zero. Returns the rows in ``recv_x``'s dtype (MC2's expand_x)."""
    acc = torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device)
    for j, expert in enumerate(experts):
        mine = (recv_e == j).unsqueeze(-1)
        acc = acc + torch.where(mine, expert(recv_x).float(), torch.zeros_like(acc))
    return acc.to(recv_x.dtype)


def combine(expert_out: torch.Tensor, ctx: DispatchContext, layout: ParallelLayout) -> torch.Tensor:
    """Rows ``[W*C, H]`` from the local experts -> this rank's tokens ``[T, H]`` (expert_out's dtype):
    ``sum_k scales[t, k] * row(t, k)`` accumulated in fp32, k in order."""
    W, T, K = layout.world_size, ctx.tokens, ctx.k
    C = T * K
    H = expert_out.size(-1)
    back = all_to_all_rows(expert_out, layout).view(W, C, H)                         # chunk d: from rank d
    pick = back.gather(0, ctx.dest.view(1, C, 1).expand(1, C, H)).squeeze(0)         # [C, H]
    out = (pick.view(T, K, H).float() * ctx.scales.unsqueeze(-1).float()).sum(1)
    return out.to(expert_out.dtype)

"""MC2 MoE dispatch / combine references — ``offload_ref::npu_moe_distribute_dispatch_v2`` / ``combine_v2``.

torch_npu's schemas (torch_npu 2.13.0, ``npu_native_functions_by_codegen.yaml``) in the ``offload_ref``
namespace, with a CPU kernel over ``torch.distributed`` (gloo) for the expert-parallel layout the
recipe deploys (``models/glm/parallel.py``). Supported: ``expert_shard_type=0`` and no shared-expert
ranks (``shared_expert_rank_num=0``), no TP domain (``tp_world_size`` 0 or 1), ``quant_mode=0``,
``global_bs=0``, no active mask / elastic / performance info, no zero / copy / const experts. Anything
else raises a ``RuntimeError`` naming the argument.

Semantics (W = ``ep_world_size`` ranks, L = ``moe_expert_num / W`` local experts, this rank r,
``x [BS, H]``, ``expert_ids [BS, K]``; every rank calls with the same BS, K, H):

* dispatch sends every pair (t, k) to the rank owning expert ``expert_ids[t, k]``. ``expand_x [A, H]``
  (``A = BS * W * min(L, K)``, MC2's static worst case) holds the received rows grouped by local
  expert, then source rank, then (t, k); rows past the received count are zero.
  ``expert_token_nums [L]`` int64: rows per local expert (``expert_token_nums_type=1``; ``0``: their
  cumulative sum). ``ep_recv_counts [W*L]`` int32: cumulative row counts over (local expert, source
  rank) in that order (the last entry is the number of valid rows). ``expand_scales [A]`` fp32: the
  ``expert_scales`` of each received row (zeros without ``expert_scales``). ``dynamic_scales [A]``
  fp32 zeros (no quantisation). ``tp_recv_counts [1]`` int32 = the valid row count.
  ``assist_info_for_combine [A*128]`` int32: opaque to the caller; here entry i < A is the position of
  ``expand_x`` row i in the exchange (-1: padding).
* combine takes the expert outputs in ``expand_x``'s row order and returns ``[BS, H]`` (their dtype):
  ``sum_k expert_scales[t, k] * out(t, k)`` accumulated in fp32, k in order, plus ``shared_expert_x``.

``group_ep`` is a process group's ``group_name``; the default group and groups passed to
:func:`register_group` are known.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ._attention_common import REF_NAMESPACE, ref_check, ref_define, ref_impl, ref_register_fake
from .opspec import OpSpec

log = logging.getLogger("offload_passes.custom_ops.moe_distribute")

DISPATCH_SPEC = OpSpec(
    namespace=REF_NAMESPACE,
    name="npu_moe_distribute_dispatch_v2",
    schema=(
        "npu_moe_distribute_dispatch_v2(Tensor x, Tensor expert_ids, str group_ep, int ep_world_size, "
        "int ep_rank_id, int moe_expert_num, *, Tensor? scales=None, Tensor? x_active_mask=None, "
        "Tensor? expert_scales=None, Tensor? elastic_info=None, Tensor? performance_info=None, "
        "str group_tp=\"\", int tp_world_size=0, int tp_rank_id=0, int expert_shard_type=0, "
        "int shared_expert_num=1, int shared_expert_rank_num=0, int quant_mode=0, int global_bs=0, "
        "int expert_token_nums_type=1, str comm_alg=\"\", int zero_expert_num=0, int copy_expert_num=0, "
        "int const_expert_num=0, int? y_dtype=None, int? x_dtype=None, int? scales_dtype=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    role="comm",
    summary="CPU reference of MC2's MoE dispatch (expert parallel all-to-all, rows grouped by local expert)",
)
COMBINE_SPEC = OpSpec(
    namespace=REF_NAMESPACE,
    name="npu_moe_distribute_combine_v2",
    schema=(
        "npu_moe_distribute_combine_v2(Tensor expand_x, Tensor expert_ids, Tensor assist_info_for_combine, "
        "Tensor ep_send_counts, Tensor expert_scales, str group_ep, int ep_world_size, int ep_rank_id, "
        "int moe_expert_num, *, Tensor? tp_send_counts=None, Tensor? x_active_mask=None, "
        "Tensor? expand_scales=None, Tensor? shared_expert_x=None, Tensor? elastic_info=None, "
        "Tensor? ori_x=None, Tensor? const_expert_alpha_1=None, Tensor? const_expert_alpha_2=None, "
        "Tensor? const_expert_v=None, Tensor? performance_info=None, str group_tp=\"\", int tp_world_size=0, "
        "int tp_rank_id=0, int expert_shard_type=0, int shared_expert_num=1, int shared_expert_rank_num=0, "
        "int global_bs=0, int comm_quant_mode=0, str comm_alg=\"\", int zero_expert_num=0, "
        "int copy_expert_num=0, int const_expert_num=0) -> Tensor"
    ),
    role="comm",
    summary="CPU reference of MC2's MoE combine (rows back to their tokens, weighted by expert_scales)",
)
SPECS = (DISPATCH_SPEC, COMBINE_SPEC)
DISPATCH, COMBINE = DISPATCH_SPEC.name, COMBINE_SPEC.name
#: MC2's assist_info_for_combine holds 128 int32 per expand_x row.
ASSIST_PER_ROW = 128

_GROUPS: dict[str, Any] = {}


def register_group(group: Any) -> str:
    """Make ``group`` resolvable by its ``group_name`` (what ``group_ep`` carries); returns the name."""
    _GROUPS[group.group_name] = group
    return group.group_name


def _resolve(op: str, name: str) -> Any:
    import torch.distributed as dist

    ref_check(dist.is_available() and dist.is_initialized(), op, "torch.distributed is not initialised")
    if name in _GROUPS:
        return _GROUPS[name]
    world = dist.group.WORLD
    ref_check(name == world.group_name, op, f"group_ep {name!r} is neither the default group "
              f"({world.group_name!r}) nor registered (moe_distribute.register_group)")
    return world


def _check_common(op: str, ep_world_size: int, ep_rank_id: int, moe_expert_num: int, tp_world_size: int,
                  expert_shard_type: int, shared_expert_rank_num: int, global_bs: int, comm_alg: str,
                  extra_experts: tuple[int, int, int]) -> int:
    ref_check(ep_world_size >= 1, op, f"ep_world_size must be >= 1, got {ep_world_size}")
    ref_check(0 <= ep_rank_id < ep_world_size, op, f"ep_rank_id must be in [0, ep_world_size={ep_world_size}), "
              f"got {ep_rank_id}")
    ref_check(moe_expert_num > 0 and moe_expert_num % ep_world_size == 0, op,
              f"moe_expert_num must be a positive multiple of ep_world_size={ep_world_size}, got {moe_expert_num}")
    ref_check(tp_world_size in (0, 1), op, f"tp_world_size must be 0 or 1 (no TP domain), got {tp_world_size}")
    ref_check(expert_shard_type == 0, op, f"expert_shard_type must be 0, got {expert_shard_type}")
    ref_check(shared_expert_rank_num == 0, op, f"shared_expert_rank_num must be 0 (no shared-expert ranks), "
              f"got {shared_expert_rank_num}")
    ref_check(global_bs == 0, op, f"global_bs must be 0 (every rank sends the same BS), got {global_bs}")
    ref_check(comm_alg == "", op, f"comm_alg must be '' (the default algorithm), got {comm_alg!r}")
    ref_check(extra_experts == (0, 0, 0), op, "zero_expert_num, copy_expert_num and const_expert_num must be 0, "
              f"got {extra_experts}")
    return moe_expert_num // ep_world_size


def _check_ids(op: str, x: torch.Tensor, expert_ids: torch.Tensor, moe_expert_num: int) -> tuple[int, int]:
    ref_check(x.dim() == 2, op, f"x must be 2-D [BS, H], got {tuple(x.shape)}")
    ref_check(expert_ids.dim() == 2 and expert_ids.size(0) == x.size(0), op,
              f"expert_ids must be [BS={x.size(0)}, K], got {tuple(expert_ids.shape)}")
    ref_check(expert_ids.dtype in (torch.int32, torch.int64), op, f"expert_ids must be int32/int64, got {expert_ids.dtype}")
    return expert_ids.shape


def rows_capacity(bs: int, k: int, world: int, local_experts: int) -> int:
    """MC2's ``A``: rows of ``expand_x`` on a rank of routed experts (static worst case)."""
    return bs * world * min(local_experts, k)


def _exchange(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Equal-split all-to-all (chunk j to / from rank j), eager c10d."""
    import torch.distributed as dist

    out = torch.empty_like(t)
    dist.all_to_all_single(out, t.contiguous(), group=group)
    return out


# ------------------------------------------------------------------------------------------ dispatch


def _dispatch_fake(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, **kw):
    L = _check_common(DISPATCH, ep_world_size, ep_rank_id, moe_expert_num, kw.get("tp_world_size", 0),
                      kw.get("expert_shard_type", 0), kw.get("shared_expert_rank_num", 0), kw.get("global_bs", 0),
                      kw.get("comm_alg", ""), (kw.get("zero_expert_num", 0), kw.get("copy_expert_num", 0),
                                               kw.get("const_expert_num", 0)))
    BS, K = _check_ids(DISPATCH, x, expert_ids, moe_expert_num)
    for name in ("scales", "x_active_mask", "elastic_info", "performance_info", "y_dtype", "x_dtype", "scales_dtype"):
        ref_check(kw.get(name) is None, DISPATCH, f"{name} is not supported by the CPU reference (must be None)")
    ref_check(kw.get("quant_mode", 0) == 0, DISPATCH, f"quant_mode must be 0, got {kw.get('quant_mode')}")
    es = kw.get("expert_scales")
    if es is not None:
        ref_check(tuple(es.shape) == (BS, K), DISPATCH, f"expert_scales must be [BS={BS}, K={K}], got {tuple(es.shape)}")
    A = rows_capacity(BS, K, ep_world_size, L)
    f32 = dict(dtype=torch.float32, device=x.device)
    return (x.new_empty((A, x.size(1))), torch.empty((A,), **f32),
            torch.empty((A * ASSIST_PER_ROW,), dtype=torch.int32, device=x.device),
            torch.empty((L,), dtype=torch.int64, device=x.device),
            torch.empty((ep_world_size * L,), dtype=torch.int32, device=x.device),
            torch.empty((1,), dtype=torch.int32, device=x.device), torch.empty((A,), **f32))


def reference_npu_moe_distribute_dispatch_v2(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
                                             **kw):
    """Eager CPU kernel: one equal-split exchange of the (t, k) pairs, then MC2's compacted layout."""
    expand_x, dyn, assist, tok_nums, recv_counts, tp_counts, expand_scales = _dispatch_fake(
        x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, **kw)
    group = _resolve(DISPATCH, group_ep)
    W, L = ep_world_size, moe_expert_num // ep_world_size
    BS, K = expert_ids.shape
    C = BS * K
    ids = expert_ids.reshape(C).to(torch.int64)
    ref_check(bool(((ids >= 0) & (ids < moe_expert_num)).all()), DISPATCH,
              f"expert_ids must be in [0, moe_expert_num={moe_expert_num})")
    dest, local = ids // L, ids % L
    to = dest.unsqueeze(0) == torch.arange(W).unsqueeze(1)                             # [W, C]
    pair_x = x.unsqueeze(1).expand(BS, K, x.size(1)).reshape(C, x.size(1))
    es = kw.get("expert_scales")
    pair_s = (es.reshape(C).float() if es is not None else torch.zeros(C))
    recv_x = _exchange(torch.where(to.unsqueeze(-1), pair_x, torch.zeros_like(pair_x)).reshape(W * C, -1), group)
    recv_e = _exchange(torch.where(to, local, -1).reshape(W * C), group)
    recv_s = _exchange(torch.where(to, pair_s, 0.0).reshape(W * C), group)
    valid = recv_e >= 0
    pos = torch.arange(W * C)
    order = torch.argsort(torch.where(valid, recv_e * (W * C) + pos, L * W * C + pos))  # local expert, rank, (t,k)
    n = int(valid.sum())
    keep = order[:n]
    expand_x.zero_()
    expand_x[:n] = recv_x[keep]
    expand_scales.zero_()
    expand_scales[:n] = recv_s[keep]
    dyn.zero_()
    assist.fill_(-1)
    assist[:n] = keep.to(torch.int32)
    src = pos // C
    counts = torch.zeros(L, W, dtype=torch.int64)
    counts.index_put_((recv_e[valid], src[valid]), torch.ones(n, dtype=torch.int64), accumulate=True)
    recv_counts.copy_(counts.reshape(-1).cumsum(0).to(torch.int32))
    per_expert = counts.sum(1)
    tok_nums.copy_(per_expert if kw.get("expert_token_nums_type", 1) == 1 else per_expert.cumsum(0))
    tp_counts.fill_(n)
    return expand_x, dyn, assist, tok_nums, recv_counts, tp_counts, expand_scales


# ------------------------------------------------------------------------------------------ combine


def _combine_check(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, group_ep,
                   ep_world_size, ep_rank_id, moe_expert_num, kw) -> tuple[int, int, int]:
    L = _check_common(COMBINE, ep_world_size, ep_rank_id, moe_expert_num, kw.get("tp_world_size", 0),
                      kw.get("expert_shard_type", 0), kw.get("shared_expert_rank_num", 0), kw.get("global_bs", 0),
                      kw.get("comm_alg", ""), (kw.get("zero_expert_num", 0), kw.get("copy_expert_num", 0),
                                               kw.get("const_expert_num", 0)))
    ref_check(expert_ids.dim() == 2, COMBINE, f"expert_ids must be 2-D [BS, K], got {tuple(expert_ids.shape)}")
    BS, K = expert_ids.shape
    A = rows_capacity(BS, K, ep_world_size, L)
    ref_check(expand_x.dim() == 2 and expand_x.size(0) == A, COMBINE,
              f"expand_x must be [A={A}, H] (BS*ep_world_size*min(local experts, K)), got {tuple(expand_x.shape)}")
    ref_check(tuple(assist_info_for_combine.shape) == (A * ASSIST_PER_ROW,), COMBINE,
              f"assist_info_for_combine must be [{A * ASSIST_PER_ROW}], got {tuple(assist_info_for_combine.shape)}")
    ref_check(tuple(ep_send_counts.shape) == (ep_world_size * L,), COMBINE,
              f"ep_send_counts must be [{ep_world_size * L}], got {tuple(ep_send_counts.shape)}")
    ref_check(tuple(expert_scales.shape) == (BS, K), COMBINE,
              f"expert_scales must be [BS={BS}, K={K}], got {tuple(expert_scales.shape)}")
    for name in ("tp_send_counts", "x_active_mask", "elastic_info", "ori_x", "const_expert_alpha_1",
                 "const_expert_alpha_2", "const_expert_v", "performance_info"):
        ref_check(kw.get(name) is None, COMBINE, f"{name} is not supported by the CPU reference (must be None)")
    ref_check(kw.get("comm_quant_mode", 0) == 0, COMBINE, f"comm_quant_mode must be 0, got {kw.get('comm_quant_mode')}")
    sh = kw.get("shared_expert_x")
    if sh is not None:
        ref_check(tuple(sh.shape) == (BS, expand_x.size(1)), COMBINE,
                  f"shared_expert_x must be [BS={BS}, H={expand_x.size(1)}], got {tuple(sh.shape)}")
    return BS, K, L


def _combine_fake(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, group_ep,
                  ep_world_size, ep_rank_id, moe_expert_num, **kw):
    BS, _, _ = _combine_check(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales,
                              group_ep, ep_world_size, ep_rank_id, moe_expert_num, kw)
    return expand_x.new_empty((BS, expand_x.size(1)))


def reference_npu_moe_distribute_combine_v2(expand_x, expert_ids, assist_info_for_combine, ep_send_counts,
                                            expert_scales, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
                                            **kw):
    """Eager CPU kernel: rows back to their exchange positions, one equal-split exchange, weighted sum."""
    BS, K, L = _combine_check(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales,
                              group_ep, ep_world_size, ep_rank_id, moe_expert_num, kw)
    group = _resolve(COMBINE, group_ep)
    W, C, H = ep_world_size, BS * K, expand_x.size(1)
    n = int(ep_send_counts[-1])
    padded = expand_x.new_zeros((W * C, H))
    padded[assist_info_for_combine[:n].to(torch.int64)] = expand_x[:n]
    back = _exchange(padded, group).view(W, C, H)
    dest = expert_ids.reshape(C).to(torch.int64) // L
    pick = back[dest, torch.arange(C)]                                                # [C, H]
    out = (pick.view(BS, K, H).float() * expert_scales.float().unsqueeze(-1)).sum(1).to(expand_x.dtype)
    sh = kw.get("shared_expert_x")
    return out if sh is None else out + sh


ref_define(DISPATCH_SPEC.schema)
ref_register_fake(DISPATCH, _dispatch_fake)
ref_impl(DISPATCH, "CPU", reference_npu_moe_distribute_dispatch_v2)
ref_define(COMBINE_SPEC.schema)
ref_register_fake(COMBINE, _combine_fake)
ref_impl(COMBINE, "CPU", reference_npu_moe_distribute_combine_v2)

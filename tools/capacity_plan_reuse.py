"""``offload-capacity``'s store section: a token's KV bytes by cache, and per tier the prefix length from which
reloading a stored prefix beats recomputing it (``offload_passes.store.rule.ReuseRule.break_even``).

Bytes: ``offload_passes.store.sizes.glm_cache_layout`` of the config as a models/glm config (the bytes the
store keeps per token), split into latent, rope, indexer keys and W8A8 indexer scales.

Prefill cost of ``n`` tokens on one rank of the device (a roofline, deliberately simple)::

    prefill(n) = (2 * P * n + A(n)) / FLOPS
    A(n)       = 2 * layers * heads * (qk_nope + qk_rope + v) * sum_{i<=n} min(i, K)
                 + 2 * full_layers * index_heads * index_head_dim * n * (n + 1) / 2

``P`` is the parameters one token passes through (attention, indexer of full layers, dense MLP or shared +
``num_experts_per_tok`` routed experts, lm_head). Assumptions: all of the prefix is computed on one rank at
the device's peak dense 16-bit rate (no utilisation loss); reading the weights is shared with the rest of a
serving batch, so it is not charged (charged alone, a one-token prefill of GLM-5.2 costs its ~40 GB of W8A8
weights over the die's 1.6 TB/s HBM, ~25 ms, and reloading would win from the first token); sparse attention
reads at most ``K`` keys per query, the lightning indexer scores every earlier key. Peak rates make
recomputing look cheap, so the break-even is an upper bound: reloading wins at least from there on.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable

try:  # package import (console script) or flat import (python tools/capacity_plan.py)
    from .capacity_plan_budget import Limit
    from .capacity_plan_model import ModelShape
except ImportError:  # pragma: no cover - only when run as a loose script
    from capacity_plan_budget import Limit  # type: ignore
    from capacity_plan_model import ModelShape  # type: ignore

__all__ = ["DEVICES", "TIERS", "TIER_LIMITS", "tier_arg", "kv_by_cache", "prefill_cost", "reuse_section"]


@dataclass(frozen=True)
class Device:
    flops: float     # dense 16-bit FLOP/s of one rank
    source: str


#: One rank of each device. Ascend 910C (Atlas A3) is two dies, each a rank (world_size = 2 * chip_num).
DEVICES: dict[str, Device] = {
    "a3": Device(376e12, "Ascend 910C die: half of the chip's ~752 TFLOPS dense BF16 (Huawei CloudMatrix384 "
                         "paper, 2025)"),
}

#: Nominal reload costs per tier (fixed seconds per reload, bytes/s); measure real ones with
#: ``offload_passes.store.rule.measure_tier`` and pass them with ``--tier``.
TIERS: dict[str, tuple[float, float, str]] = {
    "ram": (50e-6, 50e9, "host RAM over PCIe 5.0 x16 / HCCS (64 GB/s ceiling)"),
    "disk": (200e-6, 6e9, "local NVMe, PCIe 4.0 x4 sequential read"),
    "shared": (1e-3, 12.5e9, "shared store over a 100 Gb/s network"),
}

#: The range of each ``--tier NAME=FIXED_S:GBPS`` number (capacity_plan_budget.LIMITS' style).
TIER_LIMITS = (
    Limit("FIXED_S", "--tier", float, 0, 10, "seconds per reload"),
    Limit("GBPS", "--tier", float, 0, 10000, "GB/s", lo_open=True),
)


def tier_arg(text: str) -> tuple[str, float, float]:
    """Parse ``NAME=FIXED_S:GBPS``; ``argparse.ArgumentTypeError`` (one line, exit 2) naming the flag and range."""
    name, eq, rest = text.partition("=")
    fixed, colon, gbps = rest.partition(":")
    if name not in TIERS or not eq or not colon:
        raise argparse.ArgumentTypeError(
            f"--tier must be NAME=FIXED_S:GBPS with NAME one of {', '.join(TIERS)}, got {text!r}")
    vals = []
    for lim, s in zip(TIER_LIMITS, (fixed, gbps)):
        try:
            v = float(s)
        except ValueError:
            v = None
        if v is None or not lim.holds(v):
            raise argparse.ArgumentTypeError(f"--tier {name}: {lim.field} must be {lim.text()}, "
                                             f"got {s!r}")
        vals.append(v)
    return name, vals[0], vals[1]


def kv_by_cache(glm_cfg: Any) -> dict[str, int]:
    """Bytes per token by kind of cache (``glm_cache_layout``), with the total and the indexer keys' share."""
    from offload_passes.store.sizes import glm_cache_layout

    out = {"latent": 0, "rope": 0, "indexer_keys": 0, "indexer_scales": 0}
    ends = (("key_scale_cache", "indexer_scales"), ("indexer.key_cache", "indexer_keys"),
            ("k_rope_cache", "rope"), ("kv_cache", "latent"))
    for name, (shape, dt) in glm_cache_layout(glm_cfg).items():
        out[next(k for e, k in ends if name.endswith(e))] += math.prod(shape) * dt.itemsize
    out["total"] = sum(out.values())
    return out


def active_params(shape: ModelShape) -> int:
    """Parameters one token passes through (the ``P`` of the module docstring)."""
    d, L, H = shape.dims, shape.num_hidden_layers, shape.dims["hidden_size"]
    nh, ql, rope = d["num_attention_heads"], d["q_lora_rank"], shape.qk_rope_head_dim
    q = H * ql + ql * nh * (d["qk_nope_head_dim"] + rope) if ql > 0 else H * nh * (d["qk_nope_head_dim"] + rope)
    attn = q + H * (shape.kv_lora_rank + rope) + shape.kv_lora_rank * nh * (d["qk_nope_head_dim"] + d["v_head_dim"]) \
        + nh * d["v_head_dim"] * H
    idx = (ql if ql > 0 else H) * d["index_n_heads"] * shape.index_head_dim + H * shape.index_head_dim \
        + H * d["index_n_heads"]
    freq = d.get("moe_layer_freq", 1)
    moe = sum(1 for i in range(L) if i >= d["first_k_dense_replace"] and i % freq == 0)
    expert = 3 * H * d["moe_intermediate_size"]
    mlp = (L - moe) * 3 * H * d["intermediate_size"] \
        + moe * (d.get("n_shared_experts", 1) + d.get("num_experts_per_tok", 8)) * expert
    return L * attn + shape.n_full * idx + mlp + H * d["vocab_size"]


def prefill_cost(shape: ModelShape, device: Device) -> Callable[[int], float]:
    """Seconds to prefill ``n`` tokens on one rank (module docstring's formula)."""
    d, P, K = shape.dims, active_params(shape), shape.index_topk
    attn_pair = 2 * shape.num_hidden_layers * d["num_attention_heads"] * (
        d["qk_nope_head_dim"] + shape.qk_rope_head_dim + d["v_head_dim"])
    idx_pair = 2 * shape.n_full * d["index_n_heads"] * shape.index_head_dim

    def cost(n: int) -> float:
        keys = n * (n + 1) // 2 if n <= K else K * (K + 1) // 2 + (n - K) * K  # sum_{i<=n} min(i, K)
        flops = 2 * P * n + attn_pair * keys + idx_pair * n * (n + 1) // 2
        return flops / device.flops
    return cost


def reuse_section(shape: ModelShape, glm_cfg: Any, device: str,
                  tiers: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """The ``store`` part of the plan: bytes by cache, prefill model, and per tier its cost and break-even
    (``None`` where reloading never wins up to ReuseRule's search limit)."""
    from offload_passes.store.rule import ReuseRule, TierCost

    kv = kv_by_cache(glm_cfg)
    out: dict[str, Any] = {"bytes_per_token": kv,
                           "indexer_share": (kv["indexer_keys"] + kv["indexer_scales"]) / kv["total"]}
    if not shape.has_weight_dims():
        out["break_even"] = None
        out["note"] = "no break-even: the config lacks the dims the prefill FLOPs need"
        return out
    dev = DEVICES[device]
    costs = {n: TierCost(f, g * 1e9) for n, (f, g) in tiers.items()}
    rule = ReuseRule(prefill_cost(shape, dev), costs)
    out["prefill"] = {"device": device, "flops_per_s": dev.flops, "active_params": active_params(shape),
                      "from": shape.name}
    out["tiers"] = {n: {"fixed_s": f, "gb_per_s": g} for n, (f, g) in tiers.items()}
    be = {n: rule.break_even(n, kv["total"]) for n in tiers}
    out["break_even"] = {n: (None if v == sys.maxsize else v) for n, v in be.items()}
    return out


def render_reuse(s: dict[str, Any]) -> list[str]:
    kv = s["bytes_per_token"]
    lines = ["", "[store: bytes per token, reload vs recompute]"]
    lines += [f"  {k.replace('_', ' '):<34} = {v:,} B" for k, v in kv.items()]
    lines.append(f"  {'indexer keys share':<34} = {100 * s['indexer_share']:.1f} %")
    if s["break_even"] is None:
        lines.append(f"  {s['note']}")
        return lines
    p = s["prefill"]
    lines.append(f"  prefill(n) on {p['device']} = (2 * {p['active_params']:,} params ({p['from']}) * n + attention(n))"
                 f" / {p['flops_per_s']:.3g} FLOP/s")
    for n, t in s["tiers"].items():
        be = s["break_even"][n]
        lines.append(f"  break-even {n:<23} = {'never' if be is None else f'{be:,} tokens'}"
                     f"  ({t['fixed_s']:g} s + n*{kv['total']:,} B / {t['gb_per_s']:g} GB/s)")
    return lines

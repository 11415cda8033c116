"""``offload-capacity``: KV capacity planner for GLM-5.2-style DSA models with and without KV offload.

Given a model config (a preset under ``models/configs/`` or a yaml with HF ``glm_moe_dsa`` keys) and a
hardware budget, it computes, showing every step:

* per-request KV bytes, the MLA form of the usual ``2 * layers * kv_heads * head_dim * bytes`` per
  token: one latent row ``kv_lora_rank + qk_rope_head_dim`` per token per attention layer (no K/V
  split, one head), plus the lightning-indexer key cache ``index_head_dim`` per token per *full*
  layer (shared IndexShare layers hold no indexer cache), plus the MTP layers when ``next_n > 0``;
* the largest batch per rank and in total for three modes: no offload (everything in HBM), basic
  offload (full KV in host memory, per-layer selection buffers in HBM: the recipe's gather path), and
  shared-indexer offload (selection buffers + the per-layer pool + per-group pool metadata);
* the HBM the pool needs and the host memory the offloaded KV needs at those batches.

Sources (read with the search tools; numbers restated, nothing copied):

* hicann/cann-recipes-infer ``docs/models/glm_5_2/glm_5_2_offload_guide.md``: 2 x Atlas A3 (16 cards),
  GLM-5.2-W8A8, 64K input, MTP3; global batch 64 without offload -> 128 with offload, pools 8K/16K.
* same repo, ``models/glm_5_2/config/glm_5_2_rank_32_32ep_w8a8_offload_mtp.yaml``: ``world_size: 32``
  ("world_size = 2 * chip_num in A3"), ``next_n: 3``, ``pa_block_size: 128``, ``attn_tp_size: 1``,
  ``dense_tp_size: 1``, ``moe_tp_size: 1`` (attention data-parallel, experts over all 32 ranks),
  ``embed_tp_size``/``lmhead_tp_size: 32``, ``prefill_mini_batch_size: 1``.
* same repo, ``models/glm_5_2/models/configuration_glm.py`` (HF ``GlmMoeDsaConfig`` defaults = GLM-5 /
  GLM-5.2 sizes: 78 layers, hidden 6144, 64 heads, q_lora 2048, kv_lora 512, rope 64, nope 192, v 256,
  256 experts x 2048, dense 12288 for the first 3 layers, vocab 154880, indexer 32 x 128, top-k 2048,
  index_topk_freq 4 / offset 3, 1 MTP layer) and ``modeling_glm.py`` (indexer cache: one
  ``[blocks, BS, 1, index_head_dim]`` cache per *full* layer, bf16 when unquantised; MoE gate fp32).
* same repo, ``models/glm_5_2/models/offload_cache.py`` and ``docs/ops.md`` §7: selection
  buffers ``ceil(K/BS)*B*(1+next_n)`` blocks of ``BS`` rows per layer plus a ``[B,1+next_n,1,K+1]``
  int32 ledger and a block table; pools ``[B, PS, 512+64]`` per layer; per group ``pool_ids [B,PS]``,
  ``id_to_slot [B, max(131072, pa_max_length)]``, ``lru_counter [B, PS/16]`` int32; the prefill
  staging cache ``[mini_batch * pa_max_length/BS, BS, D]`` on the device; MTP layers use the gather
  path, never the pool.

Assumptions (all are :class:`Budget` fields / CLI flags):

* device = one Atlas A3 card (Ascend 910C) with 128 GiB HBM as 2 ranks (dies) of 64 GiB; attention is
  data-parallel, so a request lives on exactly one rank and batches are whole numbers per rank;
* KV latent and indexer keys are 2 bytes (bf16, the W8A8C16 deployment: 16-bit KV cache);
* weights: W8A8 = 1 byte per linear weight, fp32 MoE gate, bf16 embedding and lm_head split over all
  ranks, quant scales and norms ignored (< 1 %); routed experts split over all ranks (EP = world
  size), attention / indexer / dense / shared expert / MTP layer replicated on every rank;
* a fixed per-rank reserve for everything that is neither weights nor KV (activations of a 64K
  prefill, MoE dispatch buffers, HCCL buffers, workspace, runtime): 10 GiB by default. This is the one
  number the sources do not give; the report prints the reserve window in which each result holds.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from offload_passes._cli import ArgumentParser, int_arg, run_cli
from offload_passes.custom_ops._pool import WAYS, id_range_for

try:  # package import (console script) or flat import (python tools/capacity_plan.py)
    from .capacity_plan_budget import LIMITS, MAX_BATCH, Budget
    from .capacity_plan_model import BUILTIN, WEIGHT_KEYS, ModelShape, list_presets, load_model_shape
    from .capacity_plan_reuse import DEVICES, TIERS, render_reuse, reuse_section, tier_arg
except ImportError:  # pragma: no cover - only when run as a loose script
    from capacity_plan_budget import LIMITS, MAX_BATCH, Budget  # type: ignore
    from capacity_plan_model import BUILTIN, WEIGHT_KEYS, ModelShape, list_presets, load_model_shape  # type: ignore
    from capacity_plan_reuse import DEVICES, TIERS, render_reuse, reuse_section, tier_arg  # type: ignore

log = logging.getLogger("offload_passes.tools.capacity_plan")

#: The command's name, and its deprecated alias (a second console script, for one more release).
PROG = "offload-capacity"
ALIAS = "offload-plan"

GiB = 1 << 30
INT32 = 4


@dataclass
class Step:
    """One line of shown arithmetic: ``name = formula = value``."""

    name: str
    formula: str
    value: float
    unit: str = "B"            # "B" bytes, "" plain number, "req" requests

    def render(self) -> str:
        if self.unit == "B":
            v = f"{int(self.value):,} B" + (f" ({self.value / GiB:.3f} GiB)" if self.value >= GiB / 1024 else "")
        elif self.unit == "req":
            v = f"{int(self.value)}"
        else:
            v = f"{self.value:,.0f}" if float(self.value).is_integer() else f"{self.value:,.4f}"
        return f"  {self.name:<34} = {self.formula}  = {v}"


@dataclass
class ModeResult:
    mode: str
    device_per_request: int
    device_fixed: int
    host_per_request: int
    max_per_rank: int
    bound_by: str
    max_global: int
    reserve_window_gib: tuple[float, float] | None   # reserve range (lo, hi] (lo 0: [0, hi]) in which max_per_rank
    # holds; None when host memory bounds the batch or no request fits
    pool_per_request: int = 0
    pool_bytes_per_rank: int = 0
    host_bytes_per_device: int = 0
    applicable: bool = True
    note: str = ""


@dataclass
class Plan:
    model: dict[str, Any]
    budget: dict[str, Any]
    sections: dict[str, list[Step]] = field(default_factory=dict)
    modes: list[ModeResult] = field(default_factory=list)
    per_token: dict[str, int] = field(default_factory=dict)
    per_request: dict[str, int] = field(default_factory=dict)
    per_rank: dict[str, float] = field(default_factory=dict)
    batch_check: list[dict[str, Any]] = field(default_factory=list)
    store: dict[str, Any] = field(default_factory=dict)   # capacity_plan_reuse.reuse_section

    def mode(self, name: str) -> ModeResult:
        for m in self.modes:
            if m.mode == name:
                return m
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "budget": self.budget,
            "per_token": self.per_token, "per_request": self.per_request, "per_rank": self.per_rank,
            "modes": [asdict(m) for m in self.modes],
            "batch_check": self.batch_check, "store": self.store,
            "steps": {k: [asdict(s) for s in v] for k, v in self.sections.items()},
        }


def _align(v: int, a: int) -> int:
    return -(-v // a) * a


def estimate_weights(shape: ModelShape, b: Budget, mtp_layers: int) -> tuple[int, list[Step]]:
    """Per-rank weight bytes for the recipe's layout (attention DP, experts EP over all ranks)."""
    d = shape.dims
    H, nh = d["hidden_size"], d["num_attention_heads"]
    ql, kvl, rope = d["q_lora_rank"], shape.kv_lora_rank, shape.qk_rope_head_dim
    nope, v = d["qk_nope_head_dim"], d["v_head_dim"]
    if ql > 0:
        q = H * ql + ql * nh * (nope + rope)
        q_src = "H*q_lora + q_lora*heads*(nope+rope)"
    else:
        q = H * nh * (nope + rope)
        q_src = "H*heads*(nope+rope)"
    attn = q + H * (kvl + rope) + kvl * nh * (nope + v) + nh * v * H
    idx = (ql if ql > 0 else H) * d["index_n_heads"] * shape.index_head_dim + H * shape.index_head_dim \
        + H * d["index_n_heads"]
    expert = 3 * H * d["moe_intermediate_size"]
    dense_mlp = 3 * H * d["intermediate_size"]
    L = shape.num_hidden_layers
    freq = d.get("moe_layer_freq", 1)
    moe_layers = sum(1 for i in range(L) if i >= d["first_k_dense_replace"] and i % freq == 0)
    dense_layers = L - moe_layers
    n_routed, n_shared = d["n_routed_experts"], d.get("n_shared_experts", 1)
    vocab = d["vocab_size"]
    ranks = b.ranks
    wb, gb, eb = b.weight_bytes, b.gate_bytes, b.embed_bytes
    moe_total = moe_layers + mtp_layers            # the MTP layer is a MoE decoder layer
    routed = moe_total * n_routed * expert * wb / ranks
    replicated_lin = ((L + mtp_layers) * attn + (shape.n_full + mtp_layers) * idx
                      + moe_total * n_shared * expert + dense_layers * dense_mlp
                      + mtp_layers * 2 * H * H) * wb
    gates = moe_total * H * n_routed * gb
    embed = 2 * vocab * H * eb / ranks
    total = int(routed + replicated_lin + gates + embed)
    steps = [
        Step("attention params / layer", f"{q_src} + H*(kv_lora+rope) + kv_lora*heads*(nope+v) + heads*v*H", attn, ""),
        Step("indexer params / full layer", "q_lora*idx_heads*idx_dim + H*idx_dim + H*idx_heads", idx, ""),
        Step("expert params", "3*H*moe_intermediate", expert, ""),
        Step("routed experts / rank", f"({moe_layers} MoE + {mtp_layers} MTP) layers * {n_routed} * expert * {wb:g} B / {ranks} ranks", routed),
        Step("replicated linear / rank", f"({L}+{mtp_layers}) attn + ({shape.n_full}+{mtp_layers}) indexer + {moe_total}*{n_shared} shared + {dense_layers} dense MLP + MTP eh_proj, * {wb:g} B", replicated_lin),
        Step("MoE gates / rank", f"{moe_total} * H * {n_routed} * {gb:g} B", gates),
        Step("embedding + lm_head / rank", f"2 * vocab {vocab} * H * {eb:g} B / {ranks} ranks", embed),
        Step("weights / rank", "sum of the above", total),
    ]
    return total, steps


def plan(shape: ModelShape, budget: Budget, batch: int | None = None,
         weights_like: ModelShape | None = None) -> Plan:
    """The whole computation.

    ``batch`` (global) adds a fits / does-not-fit check for that batch. ``weights_like`` takes the
    weight estimate from another config (e.g. the full-size ``glm-5.2`` for the CPU-sized preset).
    """
    b = budget
    b.validate()
    K, BS = shape.index_topk, b.pa_block_size
    if K % BS:
        raise ValueError(f"index_topk {K} must be divisible by pa_block_size {BS} (compact selection layout)")
    S = 1 + b.next_n
    mtp = shape.num_nextn_predict_layers if b.next_n > 0 else 0
    n_attn = shape.num_hidden_layers + mtp
    n_idx = shape.n_full + mtp
    groups = shape.groups
    D = shape.kv_lora_rank + shape.qk_rope_head_dim
    ctx = _align(b.context_len, BS)
    IR = id_range_for(ctx)

    out = Plan(model={
        "name": shape.name, "source": shape.source, "num_hidden_layers": shape.num_hidden_layers,
        "full_layers": shape.n_full, "shared_layers": shape.num_hidden_layers - shape.n_full,
        "groups": len(groups), "group_sizes": [len(g) for g in groups], "mtp_layers": mtp,
        "indexer_types_source": shape.indexer_types_source, "kv_lora_rank": shape.kv_lora_rank,
        "qk_rope_head_dim": shape.qk_rope_head_dim, "index_head_dim": shape.index_head_dim, "index_topk": K,
        "weights_from": (weights_like or shape).name,
    }, budget={**asdict(b), "ranks": b.ranks})

    # -- per token / per request ------------------------------------------------------------------
    latent_tok = D * b.kv_dtype_bytes
    idx_tok = shape.index_head_dim * b.indexer_dtype_bytes + b.indexer_scale_bytes
    kv_tok = n_attn * latent_tok
    ix_tok = n_idx * idx_tok
    full_kv = ctx * kv_tok
    idx_cache = ctx * ix_tok
    out.per_token = {"latent_per_layer": latent_tok, "indexer_per_full_layer": idx_tok,
                     "latent_all_layers": kv_tok, "indexer_all_layers": ix_tok, "total": kv_tok + ix_tok}
    sel_layer = S * _align(K, BS) * D * b.kv_dtype_bytes + S * (K + 1) * INT32 + S * (K // BS) * INT32
    rec_bytes = _align(S * 8 * 4096, 4096) + _align(S * 8 * 32, 4096)
    plan_scratch = S * K * 2 * INT32 + S * INT32 + rec_bytes
    out.per_request = {
        "context_tokens": ctx, "full_kv": full_kv, "indexer_cache": idx_cache,
        "selection_per_layer": sel_layer, "selection_all_layers": sel_layer * n_attn, "plan_scratch": plan_scratch,
    }
    out.sections["per token (the MLA KV formula)"] = [
        Step("latent row / token / layer", f"(kv_lora_rank {shape.kv_lora_rank} + qk_rope_head_dim {shape.qk_rope_head_dim}) * {b.kv_dtype_bytes} B", latent_tok),
        Step("indexer key / token / full layer", f"index_head_dim {shape.index_head_dim} * {b.indexer_dtype_bytes} B + {b.indexer_scale_bytes} B scale", idx_tok),
        Step("attention layers with KV", f"{shape.num_hidden_layers} layers + {mtp} MTP (next_n={b.next_n})", n_attn, ""),
        Step("layers with an indexer cache", f"{shape.n_full} full + {mtp} MTP ({len(groups)} IndexShare groups)", n_idx, ""),
        Step("KV / token", f"{n_attn} * {latent_tok} + {n_idx} * {idx_tok}", kv_tok + ix_tok),
    ]
    req = [
        Step("cached tokens (pa_max_length)", f"align(context {b.context_len}, block {BS})", ctx, ""),
        Step("latent KV (host when offloaded)", f"{ctx} * {n_attn} * {latent_tok} B", full_kv),
        Step("indexer cache (always HBM)", f"{ctx} * {n_idx} * {idx_tok} B", idx_cache),
        Step("KV total (no offload, all HBM)", "latent KV + indexer cache", full_kv + idx_cache),
        Step("selection buffers / layer", f"S {S} * {_align(K, BS)} rows * {D} * {b.kv_dtype_bytes} B + ledger S*(K+1)*4 + table S*K/BS*4", sel_layer),
        Step("selection buffers, all layers", f"{n_attn} * {sel_layer}", sel_layer * n_attn),
        Step("plan + install records (1 group)", f"S*K*2*4 + S*4 + records {rec_bytes}", plan_scratch),
    ]
    pools = {}
    for PS in b.pool_sizes:
        pool_layer = PS * D * b.kv_dtype_bytes
        meta_group = (PS + IR + PS // WAYS) * INT32
        pools[PS] = (pool_layer, meta_group)
        out.per_request[f"pool_{PS}_per_layer"] = pool_layer
        out.per_request[f"pool_{PS}_all_layers"] = pool_layer * shape.num_hidden_layers
        out.per_request[f"pool_{PS}_metadata_per_group"] = meta_group
        out.per_request[f"pool_{PS}_metadata_all_groups"] = meta_group * len(groups)
        req += [
            Step(f"pool {PS} / layer", f"pool_size {PS} * {D} * {b.kv_dtype_bytes} B", pool_layer),
            Step(f"pool {PS}, all layers (MTP: gather)", f"{shape.num_hidden_layers} * {pool_layer}", pool_layer * shape.num_hidden_layers),
            Step(f"pool {PS} metadata / group", f"(pool_ids {PS} + id_to_slot {IR} + lru {PS // WAYS}) * 4 B", meta_group),
            Step(f"pool {PS} metadata, all groups", f"{len(groups)} * {meta_group}", meta_group * len(groups)),
        ]
    out.sections["per request"] = req

    # -- per rank ---------------------------------------------------------------------------------
    hbm_rank = b.hbm_per_device_gib * GiB / b.ranks_per_device
    wshape = weights_like or shape
    if b.weights_gib_per_rank is not None:
        weights = int(b.weights_gib_per_rank * GiB)
        wsteps = [Step("weights / rank", "given (--weights-gib)", weights)]
    elif wshape.has_weight_dims():
        weights, wsteps = estimate_weights(wshape, b, wshape.num_nextn_predict_layers if b.next_n > 0 else 0)
    else:
        missing = [k for k in WEIGHT_KEYS if k not in wshape.dims]
        raise ValueError(f"weights_gib_per_rank: config {wshape.source} lacks {missing} for the weight "
                         "estimate; pass --weights-gib or --weights-like")
    reserve = b.reserve_gib_per_rank * GiB
    free = hbm_rank - weights - reserve
    out.sections[f"weights per rank (dims of {wshape.name})"] = wsteps
    out.sections["HBM per rank"] = [
        Step("HBM / rank", f"{b.hbm_per_device_gib:g} GiB / {b.ranks_per_device} ranks per device", hbm_rank),
        Step("weights / rank", "above", weights),
        Step("reserve / rank", f"{b.reserve_gib_per_rank:g} GiB (activations, comm buffers, workspace)", reserve),
        Step("free for KV / rank", "HBM - weights - reserve", free),
    ]
    out.per_rank = {"hbm": hbm_rank, "weights": weights, "reserve": reserve, "free": free}
    if free <= 0:
        raise ValueError(f"hbm_per_device_gib: {b.hbm_per_device_gib:g} GiB per device leaves no room for KV "
                         f"(weights {weights / GiB:.2f} GiB + reserve {reserve / GiB:.2f} GiB per rank exceed "
                         f"{hbm_rank / GiB:.2f} GiB)")

    staging = b.prefill_mini_batch * ctx * D * b.kv_dtype_bytes
    host_rank = None if b.host_mem_per_device_gib is None else b.host_mem_per_device_gib * GiB / b.ranks_per_device
    pool_ok = b.kv_dtype_bytes == 2
    modes = [
        ("no offload", full_kv + idx_cache, 0, 0, 0, True, "all KV in HBM"),
        ("basic offload", idx_cache + sel_layer * n_attn, staging, full_kv, 0, True,
         "indexer cache + selection buffers (latent KV in host memory)"),
    ]
    for PS, (pool_layer, meta_group) in pools.items():
        pool_req = pool_layer * shape.num_hidden_layers + meta_group * len(groups)
        modes.append((f"shared-indexer offload, pool {PS}", idx_cache + sel_layer * n_attn + pool_req + plan_scratch,
                      staging, full_kv, pool_req, pool_ok,
                      "basic + pools + pool metadata + plan scratch" if pool_ok else
                      "refused by the pass: dsa_serve / dsa_install take f16/bf16 KV only"))
    steps = out.sections.setdefault("largest batch", [])
    for name, dev, fixed, host, pool_req, applicable, note in modes:
        m = _largest_batch(name, dev, fixed, host, free, hbm_rank - weights, host_rank, b.ranks_per_device)
        m.max_global, m.pool_per_request, m.applicable, m.note = m.max_per_rank * b.ranks, pool_req, applicable, note
        m.pool_bytes_per_rank = m.max_per_rank * pool_req
        out.modes.append(m)
        per_rank = m.max_per_rank
        steps.append(Step(f"{name}: HBM / request", note, dev))
        if fixed:
            steps.append(Step(f"{name}: HBM fixed / rank", f"prefill staging {b.prefill_mini_batch} * {ctx} * {D} * {b.kv_dtype_bytes} B", fixed))
        steps.append(Step(f"{name}: batch / rank",
                          "floor((free - fixed) / per request)" + (" (host-bound)" if m.bound_by != "HBM" else ""),
                          per_rank, "req"))
        steps.append(Step(f"{name}: global batch", f"{per_rank} * {b.ranks} ranks", per_rank * b.ranks, "req"))
    if batch is not None:
        out.batch_check = _batch_check(out.modes, batch, b, free, host_rank)
    log.debug("%s %s: %s", PROG, shape.name, {m.mode: m.max_global for m in out.modes})
    return out


def _largest_batch(name: str, dev: int, fixed: int, host: int, free: float, room: float,
                   host_rank: float | None, ranks_per_device: int) -> ModeResult:
    """The largest batch per rank of one mode: ``dev`` HBM and ``host`` host bytes per request, ``fixed``
    HBM per rank; ``room`` = HBM - weights per rank (the reserve comes out of it)."""
    per_rank = math.floor((free - fixed) / dev) if free > fixed else 0
    bound = "HBM"
    if host and host_rank is not None:
        by_host = math.floor(host_rank / host)
        if by_host < per_rank:
            per_rank, bound = by_host, "host memory"
    window = None
    if bound == "HBM" and per_rank > 0:
        # reserve r keeps per_rank iff per_rank*dev <= room - r - fixed < (per_rank+1)*dev; r >= 0. No window
        # when nothing fits: every larger reserve gives 0 too
        base = room - fixed
        window = (max((base - (per_rank + 1) * dev) / GiB, 0.0), (base - per_rank * dev) / GiB)
    return ModeResult(mode=name, device_per_request=dev, device_fixed=fixed, host_per_request=host,
                      max_per_rank=per_rank, bound_by=bound, max_global=0, reserve_window_gib=window,
                      host_bytes_per_device=per_rank * ranks_per_device * host)


def _batch_check(modes: list[ModeResult], batch: int, b: Budget, free: float,
                 host_rank: float | None) -> list[dict[str, Any]]:
    """Whether the global ``batch`` fits in each mode."""
    if batch <= 0 or batch % b.ranks:
        raise ValueError(f"batch must be a positive multiple of the {b.ranks} ranks "
                         f"(attention is data-parallel), got {batch}")
    per = batch // b.ranks
    out = []
    for m in modes:
        need = m.device_fixed + per * m.device_per_request
        host_need = per * m.host_per_request
        fits_host = host_rank is None or host_need <= host_rank
        out.append({
            "mode": m.mode, "batch": batch, "per_rank": per, "hbm_needed_per_rank": need,
            "hbm_free_per_rank": free, "host_needed_per_device": host_need * b.ranks_per_device,
            "pool_hbm_per_rank": per * m.pool_per_request,
            "fits": bool(need <= free and fits_host and m.applicable),
        })
    return out


# -- CLI -------------------------------------------------------------------------------------------

def render(p: Plan) -> str:
    m = p.model
    bd = p.budget
    lines = [
        f"{PROG}: {m['name']} ({m['source']})",
        f"  {m['num_hidden_layers']} layers: {m['full_layers']} full + {m['shared_layers']} shared indexer layers, "
        f"{m['groups']} IndexShare groups ({m['indexer_types_source']}), {m['mtp_layers']} MTP layer(s), K={m['index_topk']}",
        f"  budget: {bd['devices']} devices x {bd['ranks_per_device']} ranks = {bd['ranks']} ranks, "
        f"{bd['hbm_per_device_gib']:g} GiB HBM / device, context {bd['context_len']}, next_n {bd['next_n']}, "
        f"pools {'/'.join(map(str, bd['pool_sizes']))}, host "
        + ("unbounded" if bd["host_mem_per_device_gib"] is None else f"{bd['host_mem_per_device_gib']:g} GiB / device"),
    ]
    for title, steps in p.sections.items():
        lines.append("")
        lines.append(f"[{title}]")
        lines.extend(s.render() for s in steps)
    lines.append("")
    lines.append("[summary]")
    hdr = f"  {'mode':<36} {'HBM/request':>14} {'batch/rank':>10} {'global':>7}  {'bound':<11} {'pool HBM/rank':>14} {'host/device':>13}  reserve window"
    lines.append(hdr)
    for r in p.modes:
        win = "-" if r.reserve_window_gib is None else \
            f"{'[' if r.reserve_window_gib[0] == 0 else '('}{r.reserve_window_gib[0]:.2f}, {r.reserve_window_gib[1]:.2f}] GiB"
        glob = str(r.max_global) if r.applicable else "refused"
        lines.append(f"  {r.mode:<36} {r.device_per_request / GiB:>10.3f} GiB {r.max_per_rank:>10} {glob:>7}  "
                     f"{r.bound_by:<11} {r.pool_bytes_per_rank / GiB:>10.3f} GiB {r.host_bytes_per_device / GiB:>9.1f} GiB  {win}")
    base = p.modes[0]
    for r in p.modes[1:]:
        if r.applicable and base.max_global:
            lines.append(f"  {r.mode}: {r.max_global / base.max_global:.2f}x the no-offload batch")
    for c in p.batch_check:
        lines.append(f"  batch {c['batch']} ({c['per_rank']}/rank) with {c['mode']}: needs "
                     f"{c['hbm_needed_per_rank'] / GiB:.3f} GiB of {c['hbm_free_per_rank'] / GiB:.3f} GiB free per rank"
                     + (f" (pool {c['pool_hbm_per_rank'] / GiB:.3f} GiB)" if c['pool_hbm_per_rank'] else "") + ", "
                     + f"host {c['host_needed_per_device'] / GiB:.1f} GiB / device -> {'fits' if c['fits'] else 'does NOT fit'}")
    if p.store:
        lines += render_reuse(p.store)
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    d = Budget()
    ap = ArgumentParser(  # one-line errors, exit 2 (offload_passes/_cli.py)
        prog=PROG,
        description="KV capacity planner: per-request KV bytes and the largest batch with and without KV offload.")
    ap.add_argument("--config", default="glm-5.2",
                    help="built-in glm-5.2 (full size), a preset (models/configs/<name>.yaml) or a yaml path "
                         "with HF glm_moe_dsa keys")
    ap.add_argument("--devices", type=int_arg("--devices", 1), default=d.devices)
    ap.add_argument("--ranks-per-device", type=int_arg("--ranks-per-device", 1), default=d.ranks_per_device)
    ap.add_argument("--hbm-gib", type=float, default=d.hbm_per_device_gib, help="HBM per device (GiB)")
    ap.add_argument("--host-gib", type=float, default=d.host_mem_per_device_gib,
                    help="host memory for offloaded KV per device (GiB); default unbounded")
    ap.add_argument("--context", type=int_arg("--context", 1), default=d.context_len,
                    help="tokens cached per request")
    ap.add_argument("--next-n", type=int_arg("--next-n", 0), default=None,
                    help="MTP draft tokens (default: config next_n, else 3)")
    ap.add_argument("--pool-size", type=int_arg("--pool-size"), action="append", default=None,
                    help="pool entries per layer; repeat for several (default: 8192 and 16384, the recipe's two); "
                         "a multiple of 16 and of --block-size in (0, 16384] with a power-of-two number of "
                         "16-way sets (custom_ops/_pool.py)")
    ap.add_argument("--block-size", type=int_arg("--block-size", 1), default=None,
                    help="pa_block_size (default: config, else 128)")
    ap.add_argument("--kv-bytes", type=int_arg("--kv-bytes", 1), default=d.kv_dtype_bytes)
    ap.add_argument("--indexer-bytes", type=int_arg("--indexer-bytes", 1), default=d.indexer_dtype_bytes)
    ap.add_argument("--indexer-scale-bytes", type=int_arg("--indexer-scale-bytes", 0),
                    default=d.indexer_scale_bytes)
    ap.add_argument("--weight-bytes", type=float, default=d.weight_bytes)
    ap.add_argument("--weights-gib", type=float, default=None, help="weights per rank (GiB), replaces the estimate")
    ap.add_argument("--weights-like", default=None,
                    help="estimate weights from this config's dims instead (e.g. glm-5.2 for the CPU-sized glm-5.2-78l)")
    ap.add_argument("--reserve-gib", type=float, default=d.reserve_gib_per_rank,
                    help="per-rank HBM for activations / comm buffers / workspace (GiB)")
    ap.add_argument("--prefill-mini-batch", type=int_arg("--prefill-mini-batch", 1), default=d.prefill_mini_batch)
    ap.add_argument("--batch", type=int_arg("--batch", 1, MAX_BATCH), default=None,
                    help=f"also check whether this global batch fits (a multiple of the ranks, at most {MAX_BATCH})")
    ap.add_argument("--device", choices=sorted(DEVICES), default="a3",
                    help="device whose peak FLOP/s and HBM bandwidth price a prefill (capacity_plan_reuse.DEVICES)")
    ap.add_argument("--tier", type=tier_arg, action="append", default=[], metavar="NAME=FIXED_S:GBPS",
                    help="a store tier's reload cost, overriding its default; NAME one of "
                         + ", ".join(f"{n} ({f:g} s, {b / 1e9:g} GB/s: {why})" for n, (f, b, why) in TIERS.items())
                         + "; FIXED_S in [0, 10] s, GBPS in (0, 10000]")
    ap.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    ap.add_argument("--list-presets", action="store_true")
    ap.add_argument("--what-if", action="store_true",
                    help="A3 per-step latency what-if model instead (flags: offload-capacity --what-if --help)")
    ranges = {lim.flag: lim.text() for lim in LIMITS if lim.flag}
    for action in ap._actions:  # each number's range, from the one table the check reads
        flag = next((o for o in action.option_strings if o in ranges), None)
        if flag:
            action.help = f"{action.help + '; ' if action.help else ''}{ranges[flag]}"
    return ap


def budget_from_args(args: argparse.Namespace, shape: ModelShape) -> Budget:
    r = shape.runner
    pools = tuple(args.pool_size) if args.pool_size else Budget().pool_sizes
    return Budget(
        devices=args.devices, ranks_per_device=args.ranks_per_device, hbm_per_device_gib=args.hbm_gib,
        host_mem_per_device_gib=args.host_gib, context_len=args.context,
        next_n=args.next_n if args.next_n is not None else int(r.get("next_n", 3)),
        pool_sizes=pools, pa_block_size=args.block_size if args.block_size is not None else int(r.get("pa_block_size", 128)),
        kv_dtype_bytes=args.kv_bytes, indexer_dtype_bytes=args.indexer_bytes,
        indexer_scale_bytes=args.indexer_scale_bytes, weight_bytes=args.weight_bytes,
        weights_gib_per_rank=args.weights_gib, reserve_gib_per_rank=args.reserve_gib,
        prefill_mini_batch=args.prefill_mini_batch)


def main_alias(argv: Sequence[str] | None = None) -> int:
    """``offload-plan``: ``offload-capacity`` under its deprecated name, installed for one more release
    (docs/glossary.md, "Renamed"). Same flags, output and exit codes; one note on stderr names the command."""
    print(f"{ALIAS}: note: this command is {PROG}; the name {ALIAS} is deprecated and will be removed in the "
          "next release", file=sys.stderr)
    return main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--what-if" in argv:  # latency what-if model (capacity_plan_whatif.py), its own flags
        try:
            from . import capacity_plan_whatif as whatif
        except ImportError:  # flat import (python tools/capacity_plan.py)
            import capacity_plan_whatif as whatif
        return whatif.main(argv)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, or a one-line parse error (exit 2) from _cli.ArgumentParser
        return int(e.code or 0)
    if args.list_presets:
        print("\n".join(list_presets()) or "(no presets installed)")
        return 0
    return run_cli(PROG, lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    shape = load_model_shape(args.config)
    like = load_model_shape(args.weights_like) if args.weights_like else None
    budget = budget_from_args(args, shape)
    # every number in range (capacity_plan_budget.LIMITS: nan, inf, negatives, beyond a kernel), named by its flag
    budget.validate(flags=True)
    result = plan(shape, budget, batch=args.batch, weights_like=like)
    glm_cfg = _glm_config(args.config)
    if glm_cfg is not None:
        tiers = {n: (f, b / 1e9) for n, (f, b, _) in TIERS.items()} | {n: (f, g) for n, f, g in args.tier}
        result.store = reuse_section(like or shape, glm_cfg, args.device, tiers)
    try:
        print(json.dumps(result.to_json(), indent=2) if args.json else render(result))
    except BrokenPipeError:  # `offload-capacity | head`: the reader left, not an error
        sys.stderr = open(os.devnull, "w")
    return 0


def _glm_config(config: str) -> Any:
    """``config`` as a models/glm config (the store's cache layout), or None for a yaml that is not one."""
    from offload_passes import models

    try:
        if config in BUILTIN:
            return models.load_config({"model_config": dict(BUILTIN[config]["model_config"])})
        return models.load_config(config)
    except ValueError as e:
        log.info("%s: no store section for %s: %s", PROG, config, e)
        return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

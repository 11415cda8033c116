"""GLM-5.2 (HF ``glm_moe_dsa``) written the way the NPU recipe writes its decode step.

Module / parameter names follow HF's checkpoint layout (``model.layers.{i}.self_attn.q_a_proj.weight``,
``...self_attn.indexer.wq_b.weight``, ``...mlp.experts.{e}.gate_proj.weight``, ``lm_head.weight``), so
``state_dict()`` keys are the safetensors names.

Decode step (``GlmMoeDsaForCausalLM.forward(input_ids [B,S], positions [B,S])``), per layer, is the
contract of docs/ARCHITECTURE.md §3:

* MLA in absorbed form: ``q_nope`` is multiplied into the latent space (``kv_b_proj``'s K half), the
  attention runs on the latent cache (``kv_lora_rank``) + the rope cache (``qk_rope_head_dim``), the
  latent output is mapped back with ``kv_b_proj``'s V half, then ``o_proj``.
* This step's latent/rope KV and indexer key are written into the full paged caches first (PA_BSND,
  ``[cache_len*B, BS, 1, D]``, identity block table), so the decode-window ids are readable.
* "full" layers run the lightning indexer (``[T,1,K]`` int32, viewed ``[B,S,1,K]``); "shared" layers
  reuse that very tensor.
* non-offload: SFA on the paged full cache with the indexer's ids.
  offload (``enable_offload``): ``custom.npu_gather_selection_kv_cache`` into per-layer selection
  buffers (ledger in ``sel_status``), then SFA on the selection with
  ``where(arange(K) < act[:, None], arange(K), -1)``.

Every cache is a registered (non-persistent) module buffer, so Dynamo lifts it as a graph input.
Prefill (``prefill``) uses a dense causal path (SDPA) and only fills the caches.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from . import moe_comm, npu_ops
from .config import ModelConfig, RunnerConfig
from .parallel import ParallelLayout, embed_tp, lm_head_tp

log = logging.getLogger("offload_passes.models.modeling")


# ------------------------------------------------------------------------------------------ basics


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _linear(i: int, o: int, dtype: torch.dtype, device=None) -> nn.Linear:
    # No default (kaiming) init: the model initialises every weight once, seeded (weights.init_weights)
    # or from a checkpoint; skipping the default halves the build time of the 78-layer preset.
    return torch.nn.utils.skip_init(nn.Linear, i, o, bias=False, dtype=dtype, device=device or "cpu")


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[..., rope_dim]`` (fp32, half-duplicated as HF's ``rotate_half`` convention)."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate ``x [..., tokens, heads, d]`` with ``cos/sin [..., tokens, d]``.

    ``interleave`` = HF ``apply_rotary_pos_emb_interleave``: pairs ``(x0,x1),(x2,x3)...`` are first
    de-interleaved to ``[x0,x2,...,x1,x3,...]`` and the result stays in that order (as in HF, the
    cache then holds the de-interleaved layout; dot products are unchanged).
    """
    dtype = x.dtype
    h = x.float()
    d = h.size(-1)
    if interleave:
        h = h.unflatten(-1, (d // 2, 2)).transpose(-1, -2).reshape(h.shape)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rot = torch.cat((-h[..., d // 2:], h[..., : d // 2]), dim=-1)
    return (h * c + rot * s).to(dtype)


# ------------------------------------------------------------------------------------------ MLP / MoE


class GlmMoeDsaMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, inter, dtype, device)
        self.up_proj = _linear(hidden, inter, dtype, device)
        self.down_proj = _linear(inter, hidden, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GlmMoeDsaTopkRouter(nn.Module):
    """Sigmoid router with the ``noaux_tc`` correction bias and group-limited selection (DeepSeek-V3)."""

    def __init__(self, cfg: ModelConfig, device=None) -> None:
        super().__init__()
        self.cfg = cfg
        # fp32 router weight as in the checkpoints' ``moe_router_dtype``; filled by init / load.
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32,
                                               device=device))
        # Persistent: checkpoints carry ``mlp.gate.e_score_correction_bias``.
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(cfg.n_routed_experts, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the dense routing matrix ``[T, E]`` (fp32; zero for unselected experts)."""
        scores, idx, w = self.select(x)
        return torch.zeros_like(scores).scatter(1, idx, w)

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scores [T, E], expert ids [T, k], weights [T, k])`` (fp32 scores and weights)."""
        cfg = self.cfg
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        choice = scores + self.e_score_correction_bias
        E, G = cfg.n_routed_experts, cfg.n_group
        if G > 1:
            group_scores = choice.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)
            group_idx = group_scores.topk(cfg.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1.0)
            expert_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
            choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        # The router's torch.topk: not a DSA top-k producer (it never reaches a gather / SFA).
        idx = torch.topk(choice, k=cfg.num_experts_per_tok, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * cfg.routed_scaling_factor
        return scores, idx, w


class GlmMoeDsaMoE(nn.Module):
    """Routed experts + shared expert. Every expert runs densely on all tokens and is weighted by the
    routing matrix: no data-dependent shapes, so the decode step traces without graph breaks.

    With a :class:`~.parallel.ParallelLayout` (expert parallel) this rank holds only its experts (named by
    their global index, ``experts.{e}``) and tokens reach them through ``moe_comm`` dispatch / combine."""

    def __init__(self, cfg: ModelConfig, device=None, parallel: Optional[ParallelLayout] = None) -> None:
        super().__init__()
        dt = cfg.dtype
        self.parallel = parallel
        self.num_experts = cfg.n_routed_experts
        self.gate = GlmMoeDsaTopkRouter(cfg, device)
        if parallel is None:
            self.experts = nn.ModuleList(
                GlmMoeDsaMLP(cfg.hidden_size, cfg.moe_intermediate_size, dt, device)
                for _ in range(cfg.n_routed_experts)
            )
        else:
            lo, hi = parallel.shard(cfg.n_routed_experts, "n_routed_experts")
            self.experts = nn.ModuleDict({
                str(e): GlmMoeDsaMLP(cfg.hidden_size, cfg.moe_intermediate_size, dt, device) for e in range(lo, hi)
            })
        self.shared_experts = (
            GlmMoeDsaMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dt, device)
            if cfg.n_shared_experts > 0 else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel is not None:
            return self.forward_ep(x)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        route = self.gate(x)  # [T, E]
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):
            acc = acc + route[:, e : e + 1] * expert(x).float()
        out = acc.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)

    def forward_sparse(self, x: torch.Tensor) -> torch.Tensor:
        """Same result, each expert only on its routed tokens (data-dependent shapes: prefill only)."""
        if self.parallel is not None:  # every rank must take part in every exchange: static shapes
            return self.forward_ep(x)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        route = self.gate(x)
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):
            tok = route[:, e].nonzero().squeeze(1)
            if tok.numel():
                acc.index_add_(0, tok, route[tok, e : e + 1] * expert(x[tok]).float())
        out = acc.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)

    def forward_ep(self, x: torch.Tensor) -> torch.Tensor:
        """Expert parallel: route, dispatch to the owning ranks, local experts, combine (MC2 semantics)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        _, idx, w = self.gate.select(x)
        recv_x, recv_e, ctx = moe_comm.dispatch(x, idx, w, self.num_experts, self.parallel)
        out = moe_comm.combine(moe_comm.run_local_experts(self.experts.values(), recv_x, recv_e), ctx, self.parallel)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)


# ------------------------------------------------------------------------------------------ indexer


def hadamard_matrix(n: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix ``[n, n]`` (``n`` a power of two): ``H @ H.T = I``."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.size(0) < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / n ** 0.5).to(dtype=dtype, device=device)


class GlmMoeDsaIndexer(nn.Module):
    """Lightning indexer of a "full" layer (HF names ``wq_b``, ``wk``, ``k_norm``, ``weights_proj``) and
    its own paged key cache ``key_cache [cache_len*B, BS, 1, index_head_dim]``.

    ``li_cache_quant_mode: int8`` (W8A8C16, as the NPU recipe writes it): q and k are rotated by a
    Hadamard matrix (fp16 result), quantised per token (and head) to int8 with dynamic scales; the key
    cache is int8 with a float16 dequant-scale cache ``key_scale_cache [cache_len*B, BS, 1]``; the head
    weights are float16; the top-k comes from ``npu_quant_lightning_indexer`` (one output).
    """

    def __init__(self, cfg: ModelConfig, runner: RunnerConfig, device=None) -> None:
        super().__init__()
        dt = cfg.dtype
        self.cfg = cfg
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.int8 = cfg.li_cache_int8
        self.inplace_writes = runner.cache_write == "inplace"
        self.wq_b = _linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dt, device)
        self.wk = _linear(cfg.hidden_size, self.head_dim, dt, device)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=dt, device=device)
        self.weights_proj = _linear(cfg.hidden_size, self.n_heads, dt, device)
        # HF scales the head weights by n_heads^-0.5 and the scores by head_dim^-0.5; ReLU is
        # positively homogeneous, so folding both into the weights keeps the top-k identical.
        self.weight_scale = (self.n_heads ** -0.5) * (self.head_dim ** -0.5)
        blocks = runner.cache_len * runner.batch_size
        cache_dt = torch.int8 if self.int8 else dt
        self.register_buffer(
            "key_cache", torch.zeros(blocks, runner.pa_block_size, 1, self.head_dim, dtype=cache_dt, device=device),
            persistent=False,
        )
        if self.int8:
            if npu_ops.quant_lightning_indexer is None:
                raise RuntimeError(f"li_cache_quant_mode 'int8' needs torch.ops.{npu_ops.OPS_NAMESPACE}."
                                   "npu_quant_lightning_indexer, which is not available")
            # One fp16 dequant scale per cached key token (the recipe's past_key_scales_indexer).
            self.register_buffer(
                "key_scale_cache", torch.zeros(blocks, runner.pa_block_size, 1, dtype=torch.float16, device=device),
                persistent=False,
            )
            # Not a checkpoint tensor: a fixed rotation, rebuilt here (the recipe builds it at init too).
            self.register_buffer("hadamard", hadamard_matrix(self.head_dim, dt, device), persistent=False)

    def _qk(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q ``[..., Hi, Di]``, k ``[..., Di]`` with RoPE on the first ``rope_dim`` dims (HF order)."""
        q = self.wq_b(q_resid).unflatten(-1, (self.n_heads, self.head_dim))
        q_pe, q_nope = q.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        q = torch.cat((apply_rope(q_pe, cos, sin, self.cfg.indexer_rope_interleave), q_nope), dim=-1)
        k = self.k_norm(self.wk(x))
        k_pe, k_nope = k.unsqueeze(-2).split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k = torch.cat((apply_rope(k_pe, cos, sin, self.cfg.indexer_rope_interleave), k_nope), dim=-1).squeeze(-2)
        return q, k

    def _rotate_quant(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hadamard rotation (float16 result, as the recipe), then per-token dynamic int8: ``(int8 x,
        float16 dequant scale of shape x.shape[:-1])``."""
        h = x.reshape(-1, self.head_dim).to(self.hadamard.dtype).matmul(self.hadamard).to(torch.float16)
        q, scale = npu_ops.dynamic_quant(h.view(x.shape))
        return q, scale.to(torch.float16)

    # One method per cache write, so the write can be routed through an in-place (scatter) op.
    def write_key_cache(self, slots: torch.Tensor, k: torch.Tensor) -> None:
        """Rows ``slots`` (flat cache rows) of the indexer key cache := ``k [n, head_dim]``."""
        if self.inplace_writes:  # the reference: npu_scatter_nd_update_ on the paged cache
            bs = self.key_cache.size(1)
            nd = torch.stack((slots // bs, slots % bs), dim=-1)
            npu_ops.scatter_nd_update_(self.key_cache, nd, k.to(self.key_cache.dtype).unsqueeze(1))
            return
        self.key_cache.view(-1, self.head_dim).index_put_((slots,), k.to(self.key_cache.dtype))

    def write_key_scale_cache(self, slots: torch.Tensor, scale: torch.Tensor) -> None:
        """Rows ``slots`` of the int8 cache's dequant-scale cache := ``scale [n]`` (float16)."""
        if self.inplace_writes:
            bs = self.key_scale_cache.size(1)
            nd = torch.stack((slots // bs, slots % bs), dim=-1)
            npu_ops.scatter_nd_update_(self.key_scale_cache, nd,
                                       scale.reshape(-1, 1).to(self.key_scale_cache.dtype))
            return
        self.key_scale_cache.view(-1).index_put_((slots,), scale.reshape(-1).to(self.key_scale_cache.dtype))

    def _store_keys(self, slots: torch.Tensor, k: torch.Tensor) -> None:
        if self.int8:
            kq, ks = self._rotate_quant(k)
            self.write_key_cache(slots, kq)
            self.write_key_scale_cache(slots, ks)
        else:
            self.write_key_cache(slots, k)

    def decode(self, x, q_resid, cos, sin, slots, block_table, kv_len, cu_q) -> torch.Tensor:
        """Write this step's keys, then score the whole history: top-k ``[T, 1, K]`` int32, -1 padded."""
        q, k = self._qk(x, q_resid, cos, sin)
        self._store_keys(slots, k)
        weights = self.weights_proj(x) * self.weight_scale
        kw = dict(actual_seq_lengths_query=cu_q, actual_seq_lengths_key=kv_len, block_table=block_table,
                  layout_query="TND", layout_key="PA_BSND", sparse_count=self.topk, sparse_mode=3)
        if self.int8:
            qq, qs = self._rotate_quant(q)  # [T, Hi, Di] int8, [T, Hi] fp16
            return npu_ops.quant_lightning_indexer(
                qq, self.key_cache, weights.to(torch.float16), qs, self.key_scale_cache, 0, 0, **kw
            )
        topk, _ = npu_ops.lightning_indexer(q, self.key_cache, weights, **kw)
        return topk

    def prefill(self, x, q_resid, cos, sin, slots, valid) -> None:
        _, k = self._qk(x, q_resid, cos, sin)
        self._store_keys(slots, k[valid])


# ------------------------------------------------------------------------------------------ attention


class GlmMoeDsaAttention(nn.Module):
    """MLA with DSA. Buffers (all ``persistent=False``):

    * ``kv_cache [cache_len*B, BS, 1, kv_lora_rank]``, ``k_rope_cache [cache_len*B, BS, 1, rope]``: the full
      paged cache (host-side in the offload recipe; pinned when CUDA is present);
    * offload only: ``sel_kv [B*S*K/BS, BS, kv_lora_rank]``, ``sel_rope [.., BS, rope]`` (selection
      buffers), ``sel_block_table [B*S, K/BS]`` (identity), ``sel_status [B, S, 1, K+1]`` (ledger, -1).
    """

    def __init__(self, cfg: ModelConfig, runner: RunnerConfig, layer_idx: int, device=None) -> None:
        super().__init__()
        dt = cfg.dtype
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.kv_lora_rank = cfg.kv_lora_rank
        self.rope_dim = cfg.qk_rope_head_dim
        self.nope_dim = cfg.qk_nope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.scale = cfg.softmax_scale
        self.topk = cfg.index_topk
        self.enable_offload = runner.enable_offload
        self.block_size = runner.pa_block_size
        self.inplace_writes = runner.cache_write == "inplace"
        self._batch = runner.batch_size

        self.q_a_proj = _linear(cfg.hidden_size, cfg.q_lora_rank, dt, device)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dt, device)
        self.q_b_proj = _linear(cfg.q_lora_rank, self.num_heads * cfg.qk_head_dim, dt, device)
        self.kv_a_proj_with_mqa = _linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dt, device)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dt, device)
        self.kv_b_proj = _linear(cfg.kv_lora_rank, self.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), dt,
                                 device)
        self.o_proj = _linear(self.num_heads * cfg.v_head_dim, cfg.hidden_size, dt, device)
        self.indexer = (
            GlmMoeDsaIndexer(cfg, runner, device) if cfg.indexer_types[layer_idx] == "full" else None
        )

        B, S, BS, K = runner.batch_size, runner.seq_per_step, runner.pa_block_size, cfg.index_topk
        full_blocks = runner.cache_len * B
        pin = runner.enable_offload and torch.cuda.is_available() and (device is None or str(device) == "cpu")
        kv = torch.zeros(full_blocks, BS, 1, self.kv_lora_rank, dtype=dt, device=device)
        rope = torch.zeros(full_blocks, BS, 1, self.rope_dim, dtype=dt, device=device)
        if pin:  # host-side full cache (the recipe's swapped host memory): pinned in place, exact size
            from offload_passes.cuda import host_pinned  # cudaHostRegister, no pinned-allocator rounding

            kv, rope = host_pinned(kv), host_pinned(rope)
        self.register_buffer("kv_cache", kv, persistent=False)
        self.register_buffer("k_rope_cache", rope, persistent=False)
        if self.enable_offload:
            sel_blocks_per_row = K // BS
            sel_blocks = B * S * sel_blocks_per_row
            self.register_buffer(
                "sel_kv", torch.zeros(sel_blocks, BS, self.kv_lora_rank, dtype=dt, device=device), persistent=False
            )
            self.register_buffer(
                "sel_rope", torch.zeros(sel_blocks, BS, self.rope_dim, dtype=dt, device=device), persistent=False
            )
            self.register_buffer(
                "sel_block_table",
                torch.arange(sel_blocks, dtype=torch.int32, device=device).view(B * S, sel_blocks_per_row),
                persistent=False,
            )
            self.register_buffer(
                "sel_status", torch.full((B, S, 1, K + 1), -1, dtype=torch.int32, device=device), persistent=False
            )

    # -------------------------------------------------------------- helpers
    def _absorb_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj`` split per head: W_UK ``[H, nope, C]`` and W_UV ``[H, V, C]``."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _q_and_latent(self, x, cos, sin):
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).unflatten(-1, (self.num_heads, self.nope_dim + self.rope_dim))
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin, self.cfg.rope_interleave)
        ckv = self.kv_a_proj_with_mqa(x)
        c, k_pe = ckv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        k_pe = apply_rope(k_pe.unsqueeze(-2), cos, sin, self.cfg.rope_interleave).squeeze(-2)
        return q_resid, q_nope, q_pe, c, k_pe

    def write_kv_cache(self, slots: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Rows ``slots`` (flat cache rows) of the latent / rope caches := ``c [n, kv_lora_rank]``,
        ``k_pe [n, rope]``."""
        # Host-resident caches (pinned, the rows on the device; offload_passes/cuda.py place_full_caches):
        # torch's index_put_ refuses the mix of devices (so does Dynamo, tracing it), so the rows go through
        # the cache-write op, whose CUDA kernel stores through the pinned cache's address (docs/cuda.md).
        # The branch is static under tracing: graphs whose devices agree keep their index_put_.
        if self.inplace_writes or self.kv_cache.device != c.device:
            npu_ops.mla_prolog_cache_write_(self.kv_cache, self.k_rope_cache, slots, c, k_pe)
            return
        # index_put_: the scatter form Inductor's re-inplacing pass maps back onto the input buffer.
        self.kv_cache.view(-1, self.kv_lora_rank).index_put_((slots,), c)
        self.k_rope_cache.view(-1, self.rope_dim).index_put_((slots,), k_pe)

    # -------------------------------------------------------------- decode (the graph the pass sees)
    def decode(
        self,
        x: torch.Tensor,            # [T, hidden]
        cos: torch.Tensor,          # [T, rope]
        sin: torch.Tensor,
        slots: torch.Tensor,        # [T] int64 flat cache rows of this step's tokens
        block_table: torch.Tensor,  # [B, cache_len] int32
        kv_len: torch.Tensor,       # [B] int32, including this step's S tokens
        cu_q: torch.Tensor,         # [B] int32 cumulative query lengths (S, 2S, ...)
        prev_topk: Optional[tuple],  # (topk [T,1,K], topk4 [B,S,1,K]) of the group owner (shared layers)
        batch: int,
        seq: int,
    ):
        T = x.size(0)
        K = self.topk
        q_resid, q_nope, q_pe, c, k_pe = self._q_and_latent(x, cos, sin)
        # This step's KV goes into the full cache before any read (decode-window ids must be readable).
        self.write_kv_cache(slots, c, k_pe)

        if self.indexer is not None:
            topk = self.indexer.decode(x, q_resid, cos, sin, slots, block_table, kv_len, cu_q)
            # Viewed once by the owner: every shared layer of the group reuses this very tensor.
            topk4 = topk.view(batch, seq, 1, K)
            pair = (topk, topk4)
        else:
            pair = prev_topk
            topk, topk4 = pair
        w_uk, w_uv = self._absorb_weights()
        q_abs = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, C]

        act = None
        if self.enable_offload:
            full_blocks = self.kv_cache.size(0)
            act = npu_ops.gather_selection_kv_cache(
                self.sel_rope, self.sel_kv, self.sel_block_table, self.sel_status, topk4,
                self.k_rope_cache.view(full_blocks, self.block_size, self.rope_dim),
                self.kv_cache.view(full_blocks, self.block_size, self.kv_lora_rank),
                block_table, kv_len, cu_q, selection_topk_block_size=1,
            )
            ar = torch.arange(K, dtype=torch.int32, device=x.device)
            sparse_indices = torch.where(ar < act[:, None], ar, -1).view(T, 1, K)
            sel_kv4 = self.sel_kv.unsqueeze(2)
            out, _, _ = npu_ops.sparse_flash_attention(
                q_abs, sel_kv4, sel_kv4, sparse_indices, self.scale,
                block_table=self.sel_block_table,
                actual_seq_lengths_query=torch.arange(1, T + 1, dtype=torch.int32, device=x.device),
                actual_seq_lengths_kv=act, query_rope=q_pe, key_rope=self.sel_rope.unsqueeze(2),
                sparse_block_size=1, layout_query="TND", layout_kv="PA_BSND", sparse_mode=3, attention_mode=2,
            )
        else:
            out, _, _ = npu_ops.sparse_flash_attention(
                q_abs, self.kv_cache, self.kv_cache, topk, self.scale,
                block_table=block_table, actual_seq_lengths_query=cu_q, actual_seq_lengths_kv=kv_len,
                query_rope=q_pe, key_rope=self.k_rope_cache,
                sparse_block_size=1, layout_query="TND", layout_kv="PA_BSND", sparse_mode=3, attention_mode=2,
            )
        o = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, V]
        return self.o_proj(o.reshape(T, self.num_heads * self.v_head_dim)), pair, out, act

    # -------------------------------------------------------------- prefill (dense causal, eager only)
    def prefill(self, x, cos, sin, slots, valid) -> torch.Tensor:
        """``x [R, P, hidden]``; writes caches for ``valid`` tokens (flat rows ``slots``)."""
        R, P, _ = x.shape
        q_resid, q_nope, q_pe, c, k_pe = self._q_and_latent(x, cos, sin)
        # Stored in the cache dtype (prefill may compute in fp32, see GlmMoeDsaForCausalLM.prefill).
        self.write_kv_cache(slots, c[valid].to(self.kv_cache.dtype), k_pe[valid].to(self.k_rope_cache.dtype))
        if self.indexer is not None:
            self.indexer.prefill(x, q_resid, cos, sin, slots, valid)
        kv = self.kv_b_proj(c).unflatten(-1, (self.num_heads, self.nope_dim + self.v_head_dim))
        k_nope, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(1, 2)  # [R, H, P, qk]
        k = torch.cat((k_nope, k_pe.unsqueeze(2).expand(R, P, self.num_heads, self.rope_dim)), dim=-1).transpose(1, 2)
        # Right padding: causality alone keeps every valid query away from padded keys.
        o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, scale=self.scale)
        return self.o_proj(o.transpose(1, 2).reshape(R, P, self.num_heads * self.v_head_dim))

    @torch.no_grad()
    def reset_rows(self, rows: Sequence[int]) -> None:
        """Forget batch rows: zero their full/indexer caches and selection rows, ledger back to -1."""
        for b in rows:
            blocks_per_row = self.kv_cache.size(0) // self._batch
            self.kv_cache[b * blocks_per_row : (b + 1) * blocks_per_row].zero_()
            self.k_rope_cache[b * blocks_per_row : (b + 1) * blocks_per_row].zero_()
            if self.indexer is not None:
                self.indexer.key_cache[b * blocks_per_row : (b + 1) * blocks_per_row].zero_()
                if self.indexer.int8:
                    self.indexer.key_scale_cache[b * blocks_per_row : (b + 1) * blocks_per_row].zero_()
            if self.enable_offload:
                per_row = self.sel_kv.size(0) // self._batch
                self.sel_kv[b * per_row : (b + 1) * per_row].zero_()
                self.sel_rope[b * per_row : (b + 1) * per_row].zero_()
                self.sel_status[b].fill_(-1)


# ------------------------------------------------------------------------------------------ layers / model


@contextlib.contextmanager
def _params_as(modules: Sequence[nn.Module], dtype: Optional[torch.dtype]) -> Iterator[None]:
    """Temporarily run ``modules`` with floating parameters cast to ``dtype`` (None: unchanged)."""
    saved = []
    if dtype is not None:
        for m in modules:
            for p in m.parameters():
                if p.is_floating_point() and p.dtype != dtype:
                    saved.append((p, p.data))
                    p.data = p.data.to(dtype)
    try:
        yield
    finally:
        for p, d in saved:
            p.data = d


class GlmMoeDsaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, runner: RunnerConfig, layer_idx: int, device=None,
                 parallel: Optional[ParallelLayout] = None) -> None:
        super().__init__()
        dt = cfg.dtype
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, device)
        self.self_attn = GlmMoeDsaAttention(cfg, runner, layer_idx, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, device)
        self.mlp = (
            GlmMoeDsaMoE(cfg, device, parallel) if cfg.is_moe_layer(layer_idx)
            else GlmMoeDsaMLP(cfg.hidden_size, cfg.intermediate_size, dt, device)
        )

    def decode(self, x, cos, sin, slots, block_table, kv_len, cu_q, prev_topk, batch, seq):
        h, topk, attn, act = self.self_attn.decode(
            self.input_layernorm(x), cos, sin, slots, block_table, kv_len, cu_q, prev_topk, batch, seq
        )
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, topk, attn, act

    def prefill(self, x, cos, sin, slots, valid):
        x = x + self.self_attn.prefill(self.input_layernorm(x), cos, sin, slots, valid)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp.forward_sparse(h) if isinstance(self.mlp, GlmMoeDsaMoE) else self.mlp(h))


class GlmMoeDsaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, runner: RunnerConfig, device=None,
                 parallel: Optional[ParallelLayout] = None) -> None:
        super().__init__()
        vocab = cfg.vocab_size // (parallel.world_size if parallel is not None else 1)  # vocab-parallel rows
        self.embed_tokens = torch.nn.utils.skip_init(
            nn.Embedding, vocab, cfg.hidden_size, dtype=cfg.dtype, device=device or "cpu"
        )
        self.layers = nn.ModuleList(
            GlmMoeDsaDecoderLayer(cfg, runner, i, device, parallel) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)


class GlmMoeDsaForCausalLM(nn.Module):
    """GLM-5.2 decode model. ``forward(input_ids [B,S] int64, positions [B,S] int64)`` is one decode step.

    ``positions[b, s]`` is the absolute position of token s of row b; this step's kv length is
    ``positions[:, -1] + 1``. Returns logits ``[B, S, vocab]``; with ``return_internals = True`` returns
    ``(logits, attn, topk, act)``: per-layer SFA outputs ``[T, H, kv_lora_rank]``, the indexer top-k
    ``[T, 1, K]`` of each full layer (in layer order), and per-layer gather lengths ``[T]`` (offload
    only, else empty).
    """

    def __init__(
        self, cfg: ModelConfig, runner: RunnerConfig, device=None, seed: Optional[int] = 0,
        parallel: Optional[ParallelLayout] = None,
    ) -> None:
        """``seed``: seeded random weights (``weights.init_weights``); ``None`` leaves the parameters
        uninitialised for a checkpoint load (``weights.load_safetensors``).

        ``parallel`` (world size > 1, see ``parallel.py``): ``runner.batch_size`` is then this rank's rows
        (``models.build`` splits the global batch), the embedding / lm_head hold this rank's vocab rows,
        the MoE layers its experts; the seeded weights are the single-process model's, sliced."""
        super().__init__()
        if parallel is not None and parallel.world_size == 1:
            parallel = None
        if parallel is not None:
            parallel.shard(cfg.vocab_size, "vocab_size")
            parallel.shard(cfg.n_routed_experts, "n_routed_experts")
        self.parallel = parallel
        self.config = cfg
        self.runner = runner
        self.model = GlmMoeDsaModel(cfg, runner, device, parallel)
        vocab = cfg.vocab_size // (parallel.world_size if parallel is not None else 1)
        self.lm_head = _linear(cfg.hidden_size, vocab, cfg.dtype, device)
        self.return_internals = False
        B = runner.batch_size
        self.batch_size = B
        self.seq_per_step = runner.seq_per_step
        self.block_size = runner.pa_block_size
        self.register_buffer(
            "block_table",
            torch.arange(B * runner.cache_len, dtype=torch.int32, device=device).view(B, runner.cache_len),
            persistent=False,
        )
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.qk_rope_head_dim, 2, dtype=torch.float32,
                                                      device=device) / cfg.qk_rope_head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        if seed is not None and str(device) != "meta":
            if parallel is not None:
                from .parallel import init_sharded_weights

                init_sharded_weights(self, GlmMoeDsaForCausalLM(cfg, runner, device="meta", seed=None), seed, parallel)
            else:
                from .weights import init_weights

                init_weights(self, seed=seed)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[n]`` -> ``[n, hidden]`` (vocab-parallel with a layout)."""
        if self.parallel is None:
            return self.model.embed_tokens(ids)
        return embed_tp(self.model.embed_tokens, ids, self.parallel, self.config.vocab_size)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[n, hidden]`` -> logits ``[n, vocab]`` (vocab-parallel with a layout)."""
        if self.parallel is None:
            return self.lm_head(h)
        return lm_head_tp(self.lm_head, h, self.parallel)

    # -------------------------------------------------------------- decode step
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor):
        B, S = self.batch_size, self.seq_per_step
        if tuple(input_ids.shape) != (B, S) or tuple(positions.shape) != (B, S):
            raise RuntimeError(
                f"decode step: input_ids and positions must be [batch_size={B}, 1+next_n={S}], got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        T = B * S
        BS = self.block_size
        pos = positions.reshape(T).to(torch.int64)
        kv_len = (positions[:, -1] + 1).to(torch.int32)
        cu_q = torch.arange(1, B + 1, dtype=torch.int32, device=input_ids.device) * S
        rows = torch.arange(B, device=input_ids.device).repeat_interleave(S)
        slots = self.block_table[rows, torch.div(pos, BS, rounding_mode="floor")].to(torch.int64) * BS + pos % BS
        cos, sin = rope_cos_sin(pos, self.inv_freq)

        x = self._embed(input_ids.reshape(T))
        topk = None
        attn_outs, topks, acts = [], [], []
        for layer in self.model.layers:
            x, new_topk, attn, act = layer.decode(x, cos, sin, slots, self.block_table, kv_len, cu_q, topk, B, S)
            if layer.self_attn.indexer is not None:  # a full layer: new top-k (static, no tensor test)
                topks.append(new_topk[0])
            topk = new_topk
            attn_outs.append(attn)
            if act is not None:
                acts.append(act)
        logits = self._logits(self.model.norm(x)).view(B, S, -1)
        if self.return_internals:
            return logits, tuple(attn_outs), tuple(topks), tuple(acts)
        return logits

    # -------------------------------------------------------------- prefill
    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,
        lengths: torch.Tensor,
        rows: Optional[Sequence[int]] = None,
        compute_dtype: Union[str, torch.dtype, None] = "auto",
    ) -> torch.Tensor:
        """Dense causal prefill of ``input_ids [R, P]`` (right padded to P; row r has ``lengths[r]`` tokens)
        into batch rows ``rows`` (default ``0..B-1``). Fills every cache (stored in the model dtype);
        returns last-token logits ``[R, V]``.

        ``compute_dtype="auto"``: fp32 on the CPU for a bf16/fp16 model (x86 CPUs without bf16 units run
        bf16 GEMMs several times slower; the 78-layer prefill would take minutes more), else the model
        dtype. The decode step always computes in the model dtype.
        """
        if compute_dtype == "auto":
            cpu = self.lm_head.weight.device.type == "cpu"
            compute_dtype = torch.float32 if cpu and self.config.dtype != torch.float32 else None
        rows = list(range(self.batch_size)) if rows is None else list(rows)
        R, P = input_ids.shape
        lengths = torch.as_tensor(lengths, dtype=torch.int64)
        if len(rows) != R or lengths.shape != (R,):
            raise RuntimeError(f"prefill: rows ({len(rows)}) and lengths {tuple(lengths.shape)} must match "
                               f"input_ids rows R={R}")
        if any(not 0 <= r < self.batch_size for r in rows):
            raise RuntimeError(f"prefill: rows must be in [0, batch_size={self.batch_size}), got {rows}")
        cap = self.block_table.size(1) * self.block_size
        lens = lengths.tolist()  # the checks read host values (no device round trip)
        if min(lens) < 1 or max(lens) > P or max(lens) > cap:
            raise RuntimeError(f"prefill: lengths must be in [1, min(P={P}, pa_max_length={cap})], got {lens}")
        self.reset_rows(rows)
        # every index tensor on the model's device (the prompt and lengths may come from the host)
        dev = self.block_table.device
        input_ids, lengths = input_ids.to(dev), lengths.to(dev)
        pos = torch.arange(P, dtype=torch.int64, device=dev).expand(R, P)
        # the valid tokens as (row, position) index tensors built from the host lengths: indexing with them
        # equals a boolean mask (row-major order) without a data-dependent nonzero on the device
        valid = (torch.cat([torch.full((n,), i, dtype=torch.int64, device=dev) for i, n in enumerate(lens)]),
                 torch.cat([torch.arange(n, dtype=torch.int64, device=dev) for n in lens]))
        row_ids = torch.tensor(rows, dtype=torch.int64, device=dev)[valid[0]]
        BS = self.block_size
        slots = self.block_table[row_ids, valid[1] // BS].to(torch.int64) * BS + valid[1] % BS
        cos, sin = rope_cos_sin(pos, self.inv_freq)
        x = self._embed(input_ids.reshape(-1)).view(R, P, -1)
        if compute_dtype is not None:
            x = x.to(compute_dtype)
        for layer in self.model.layers:
            with _params_as([layer], compute_dtype):
                x = layer.prefill(x, cos, sin, slots, valid)
        last = x[torch.arange(R, device=dev), lengths - 1]
        with _params_as([self.model.norm, self.lm_head], compute_dtype):
            return self._logits(self.model.norm(last)).to(self.config.dtype)

    # -------------------------------------------------------------- state
    @torch.no_grad()
    def reset_rows(self, rows: Sequence[int]) -> None:
        """A batch row starts a new request: clear its caches and its gather ledger."""
        dev = self.block_table.device
        if self.model.layers and self.model.layers[0].self_attn.kv_cache.device != dev:
            # Host-resident full caches (pinned, offload_passes/cuda.py): kernels launched earlier on the model's
            # device may still read these rows (dsa_serve's misses) or write them (the cache-write kernel); the
            # host's own writes below wait for them (the device caches' zero_ are stream ops already).
            from offload_passes.cuda import before_host_write

            before_host_write(dev)
        for layer in self.model.layers:
            layer.self_attn.reset_rows(rows)

    def reset_caches(self) -> None:
        self.reset_rows(range(self.batch_size))

    def groups(self) -> list[list[int]]:
        """IndexShare groups of the model's layers (``ModelConfig.groups``)."""
        return self.config.groups()

    #: Deprecated name of ``groups`` (removed in the next release; docs/glossary.md, "Renamed").
    index_groups = groups

    def cache_buffers(self) -> dict[str, torch.Tensor]:
        """All cache / ledger / table buffers by qualified name."""
        return {n: b for n, b in self.named_buffers()
                if n not in ("inv_freq",) and "e_score" not in n and not n.endswith("hadamard")}

    def memory_footprint(self) -> dict[str, int]:
        """Bytes: parameters, full caches, indexer caches, selection buffers + ledgers, tables."""
        out = {"parameters": 0, "full_kv_cache": 0, "indexer_key_cache": 0, "selection": 0, "tables": 0}
        for p in self.parameters():
            out["parameters"] += p.numel() * p.element_size()
        for n, b in self.named_buffers():
            nb = b.numel() * b.element_size()
            if n.endswith(("kv_cache", "k_rope_cache")) and "indexer" not in n:
                out["full_kv_cache"] += nb
            elif n.endswith(("key_cache", "key_scale_cache")):  # int8 indexer: + its dequant scales
                out["indexer_key_cache"] += nb
            elif n.endswith(("sel_kv", "sel_rope", "sel_status")):
                out["selection"] += nb
            elif n.endswith(("block_table", "sel_block_table")):
                out["tables"] += nb
            else:
                out["parameters"] += nb
        out["total"] = sum(out.values())
        return out

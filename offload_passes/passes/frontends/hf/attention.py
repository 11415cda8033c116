"""The Hugging Face form's sparse attention: the op the rewrite puts where the dense attention was.

Traced into the graph by AOT and run directly in eager; the semantics (the dense masking kept at the K
selected positions) are in the package doc, ``frontends/hf/__init__.py``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["hf_sparse_attention", "hf_sparse_attention_rows"]


# -- the sparse attention (traced into the graph by AOT / run directly in eager) ----------------------
def _attend(query: torch.Tensor, rows: torch.Tensor, rope_rows: torch.Tensor, weight: torch.Tensor,
            idx: torch.Tensor, base_mask: Optional[torch.Tensor], T: int, scaling: float, nope: int, vdim: int,
            kind: str, fill: float, sinks: Optional[torch.Tensor] = None,
            softmax_dtype: Optional[torch.dtype] = torch.float32, dedup: bool = False) -> torch.Tensor:
    B, H, S, D = query.shape
    K = idx.shape[-1]
    R = rope_rows.shape[-1]
    idx = idx.long()
    valid = (idx >= 0) & (idx < T)
    safe = idx.clamp(0, T - 1)
    if dedup:  # a position the ids name twice is one key of the dense mask: keep its first column only
        order, perm = torch.sort(torch.where(valid, safe, -1), dim=-1, stable=True)
        again = torch.cat([torch.zeros_like(order[..., :1], dtype=torch.bool), order[..., 1:] == order[..., :-1]], -1)
        valid = valid & ~torch.zeros_like(again).scatter(-1, perm, again)
    if base_mask is not None:  # the model's mask at the selected ids
        msel = torch.gather(base_mask.expand(B, 1, S, T)[:, 0], 2, safe)
    elif kind == "sdpa":  # the selection is the whole mask (the indexer already applied causality / padding)
        msel = torch.ones_like(safe, dtype=torch.bool)
    else:
        msel = torch.zeros_like(safe, dtype=query.dtype)
    kv = F.linear(rows, weight).view(B, S, K, H, nope + vdim)
    k_nope, v = kv.split([nope, vdim], dim=-1)
    # one copy (the concatenated key, as the model builds it); heads-first are views, not copies
    k = torch.cat([k_nope, rope_rows.view(B, S, K, 1, R).expand(B, S, K, H, R)], dim=-1)
    k = k.view(B * S, K, H, D).transpose(1, 2)
    v = v.reshape(B * S, K, H, vdim).transpose(1, 2)
    q = query.transpose(1, 2).reshape(B * S, H, 1, D)
    if kind == "sdpa":
        allowed = (msel & valid).view(B * S, 1, 1, K)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=0.0, scale=scaling)
    else:
        add = torch.where(valid, msel, torch.full_like(msel, fill)).view(B * S, 1, 1, K)
        w = torch.matmul(q, k.transpose(2, 3)) * scaling + add
        if sinks is None:
            w = F.softmax(w, dim=-1, dtype=softmax_dtype).to(query.dtype)
        else:  # one sink logit per head joins the normalisation, then its column is dropped (as the model does)
            w = torch.cat([w, sinks.reshape(1, H, 1, 1).expand(B * S, H, 1, 1).to(w.dtype)], dim=-1)
            w = w - w.max(dim=-1, keepdim=True).values
            w = F.softmax(w, dim=-1, dtype=softmax_dtype)[..., :-1].to(query.dtype)
        out = torch.matmul(w, v)
    return out.view(B, S, H, vdim).transpose(1, 2)


def hf_sparse_attention(query: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, weight: torch.Tensor,
                        topk: torch.Tensor, base_mask: Optional[torch.Tensor], scaling: float, nope: int, vdim: int,
                        kind: str, fill: float, sinks: Optional[torch.Tensor] = None,
                        softmax_dtype: Optional[torch.dtype] = torch.float32, dedup: bool = False) -> torch.Tensor:
    """Attention of ``query [B,H,S,n+r]`` over the ``topk [B,S,K]`` rows of the latent / rope caches
    ``[B,1,T,C]`` / ``[B,1,T,r]``, expanded through ``weight`` (kv_b_proj); returns ``[B,H,S,v]``."""
    B, _, T, C = latent.shape
    S, K = topk.shape[1], topk.shape[2]
    # the gather runs where the cache lives (host KV: offload_passes/hf_cache.py), the K rows then move
    safe = topk.long().clamp(0, T - 1).reshape(B, S * K).to(latent.device)
    bidx = torch.arange(B, device=latent.device).view(B, 1)
    rows = latent[:, 0][bidx, safe].view(B, S, K, C).to(query.device)  # row gather (indexing: ~8x torch.gather here)
    rrows = rope[:, 0][bidx, safe].view(B, S, K, rope.shape[-1]).to(query.device)
    return _attend(query, rows, rrows, weight, topk, base_mask, T, scaling, nope, vdim, kind, fill, sinks,
                   softmax_dtype, dedup)


def hf_sparse_attention_rows(query: torch.Tensor, sel_kv: torch.Tensor, sel_rope: torch.Tensor,
                             weight: torch.Tensor, topk: torch.Tensor, base_mask: Optional[torch.Tensor], T: int,
                             scaling: float, nope: int, vdim: int, kind: str, fill: float,
                             sinks: Optional[torch.Tensor] = None,
                             softmax_dtype: Optional[torch.dtype] = torch.float32, dedup: bool = False) -> torch.Tensor:
    """As :func:`hf_sparse_attention`, reading the rows ``dsa_serve`` placed in the selection buffers
    (top-k column k of query row r at flat row ``r*K + k``)."""
    B, S, K = topk.shape
    rows = sel_kv.reshape(B, S, K, sel_kv.shape[-1])
    rrows = sel_rope.reshape(B, S, K, sel_rope.shape[-1])
    return _attend(query, rows, rrows, weight, topk, base_mask, T, scaling, nope, vdim, kind, fill, sinks,
                   softmax_dtype, dedup)

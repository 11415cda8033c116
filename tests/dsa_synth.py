"""A small synthetic DSA decode model that writes attention exactly as docs/ARCHITECTURE.md §3.

Used by the backend tests to control every knob the real model fixes by config: the IndexShare
pattern (``"FSSS"``, ``"FFSFSSSSF"`` ...), S (1..4), KV dtype (int8 for refusals), K. Layers are plain
python loops over buffers; the model never knows about the passes. A MoE-like router calls
``torch.topk`` (a top-k producer that is not the indexer).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

import offload_passes  # noqa: F401  (registers ops)

ref = torch.ops.offload_ref
custom = torch.ops.custom


@dataclass
class SynthConfig:
    pattern: str = "FSSS"
    B: int = 2
    S: int = 1
    K: int = 64
    BS: int = 16
    maxblk: int = 40  # F = 640 tokens per batch row
    Dkv: int = 32
    Dr: int = 16
    H: int = 2
    Hi: int = 2
    Di: int = 16
    hidden: int = 32
    dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype | None = None  # None: same as dtype; torch.int8 for the quantised refusal
    identity_table: bool = True
    router: bool = True
    graph_break_after: int = -1  # >= 0: a Dynamo graph break after that layer (layers over two graphs)
    # variants that make a site unfit for the rewrite (each must be refused with its reason)
    topk_source: str = "indexer"  # "torch_topk": the gather's ids come from torch.topk, not an indexer
    sfa_indices_from_gather: bool = True  # False: sparse_indices ignore the gather's actual_seq
    sel_extra_blocks: int = 0  # selection buffers larger than B*S*K rows
    sel_views: bool = False  # selection buffers are slices of larger buffers (not graph inputs themselves)
    shared_own_lengths: bool = False  # shared layers pass their own copy of the lengths to the gather
    gather_block_size: int = 1  # selection_topk_block_size of the gather
    rope: bool = True  # False: no rope caches (the gather's no-rope mode, 1-D empty rope tensors)
    # variants our validating fake kernels reject at trace time, but CANN's Meta kernels (shapes only) let
    # through on an NPU: the preconditions are the only check before the rewrite replaces the gather
    topk_view: str = "BS1K"  # "B1SK": the ids reach the gather as [B, 1, S, K]
    full_dtype: torch.dtype | None = None  # full caches of another dtype than the selection buffers
    lengths_dtype: torch.dtype = torch.int32  # dtype of the cache lengths L
    table_dtype: torch.dtype = torch.int32  # dtype of the full block table
    # True: KV writes as the GLM model does them, ``cache.view(-1, ...).index_put_((slot,), rows)`` (one flat
    # index, what the ge_graph cache-write pass lowers); False: ``index_put_((block, offset), rows)``
    flat_cache_writes: bool = False


def _write(cache: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, rows: torch.Tensor, c: SynthConfig) -> None:
    """This step's rows into a paged cache ``[blocks, BS, ...]`` (see ``SynthConfig.flat_cache_writes``)."""
    if c.flat_cache_writes:
        cache.view(-1, *cache.shape[2:]).index_put_((blk * c.BS + off,), rows)
    else:
        cache.index_put_((blk, off), rows)


class SynthDSA(nn.Module):
    def __init__(self, cfg: SynthConfig, seed: int = 0):
        super().__init__()
        self.cfg = c = cfg
        g = torch.Generator().manual_seed(seed)
        n = len(c.pattern)
        T = c.B * c.S
        kvd = c.kv_dtype or c.dtype
        fkd = c.full_dtype or kvd
        blocks = c.B * c.maxblk

        def w(*shape):
            return nn.Parameter(torch.randn(*shape, generator=g) / shape[0] ** 0.5, requires_grad=False)

        self.Wq = nn.ParameterList([w(c.hidden, c.H * c.Dkv) for _ in range(n)])
        self.Wqr = nn.ParameterList([w(c.hidden, c.H * c.Dr) for _ in range(n)])
        self.Wkv = nn.ParameterList([w(c.hidden, c.Dkv) for _ in range(n)])
        self.Wkr = nn.ParameterList([w(c.hidden, c.Dr) for _ in range(n)])
        self.Wo = nn.ParameterList([w(c.H * c.Dkv, c.hidden) for _ in range(n)])
        self.Wqi = nn.ParameterList([w(c.hidden, c.Hi * c.Di) for _ in range(n)])
        self.Wki = nn.ParameterList([w(c.hidden, c.Di) for _ in range(n)])
        self.Ww = nn.ParameterList([w(c.hidden, c.Hi) for _ in range(n)])
        self.Wr = w(c.hidden, 8)
        if c.identity_table:
            bt = torch.arange(blocks, dtype=torch.int32).view(c.B, c.maxblk)
        else:  # a permuted (non-identity) paged layout
            bt = torch.randperm(blocks, generator=g).to(torch.int32).view(c.B, c.maxblk)
        self.register_buffer("block_table", bt.to(c.table_dtype))
        smax = c.K * c.gather_block_size // c.BS
        for l in range(n):
            self.register_buffer(f"full_kv_{l}", torch.zeros(blocks, c.BS, c.Dkv, dtype=fkd))
            self.register_buffer(f"full_rope_{l}", torch.zeros(blocks, c.BS, c.Dr, dtype=fkd) if c.rope
                                 else torch.zeros(0, dtype=fkd))
            nsel = T * smax + c.sel_extra_blocks + (1 if c.sel_views else 0)
            self.register_buffer(f"sel_kv_{l}", torch.zeros(nsel, c.BS, c.Dkv, dtype=kvd))
            self.register_buffer(f"sel_rope_{l}", torch.zeros(nsel, c.BS, c.Dr, dtype=kvd) if c.rope
                                 else torch.zeros(0, dtype=kvd))
            self.register_buffer(f"sel_table_{l}", torch.arange(T * smax, dtype=torch.int32).view(T, smax))
            self.register_buffer(f"sel_status_{l}", torch.full((c.B, c.S, 1, c.K + 1), -1, dtype=torch.int32))
            if c.pattern[l] == "F":
                self.register_buffer(f"kidx_{l}", torch.zeros(blocks, c.BS, 1, c.Di))

    # -- eager helpers (not compiled) -------------------------------------------------------
    @torch.no_grad()
    def prefill(self, lengths: list[int], seed: int = 1, rows: list[int] | None = None) -> None:
        """Fill the caches of ``rows`` (default all) with random tokens ``[0, lengths[b])``; reset ledgers."""
        c = self.cfg
        g = torch.Generator().manual_seed(seed)
        rows = list(range(c.B)) if rows is None else rows
        for l in range(len(c.pattern)):
            for name, d in ((f"full_kv_{l}", c.Dkv), (f"full_rope_{l}", c.Dr))[:2 if c.rope else 1]:
                buf = getattr(self, name)
                for b in rows:
                    for p in range(lengths[b]):
                        blk = int(self.block_table[b, p // c.BS])
                        if buf.dtype == torch.int8:
                            buf[blk, p % c.BS] = torch.randint(-100, 100, (d,), generator=g, dtype=torch.int8)
                        else:
                            buf[blk, p % c.BS] = torch.randn(d, generator=g).to(buf.dtype)
            if c.pattern[l] == "F":
                buf = getattr(self, f"kidx_{l}")
                for b in rows:
                    for p in range(lengths[b]):
                        buf[int(self.block_table[b, p // c.BS]), p % c.BS, 0] = torch.randn(c.Di, generator=g)
            st = getattr(self, f"sel_status_{l}")
            st[rows] = -1

    def inputs(self, lengths: torch.Tensor, step: int, seed: int = 7):
        """Decode-step inputs: hidden states [T, hidden], L [B] int32 (incl. this step's S tokens), cu_q."""
        c = self.cfg
        g = torch.Generator().manual_seed(seed * 100003 + step)
        h = torch.randn(c.B * c.S, c.hidden, generator=g)
        cu = torch.arange(1, c.B + 1, dtype=torch.int32) * c.S
        return h, lengths.to(c.lengths_dtype), cu

    # -- the decode step (what Dynamo captures) -------------------------------------------
    def forward(self, h: torch.Tensor, L: torch.Tensor, cu_q: torch.Tensor):
        c = self.cfg
        B, S, K, T = c.B, c.S, c.K, c.B * c.S
        pos = (L.view(B, 1) - S + torch.arange(S).view(1, S)).long()  # [B, S]
        blk = self.block_table.long().gather(1, pos // c.BS).view(-1)
        off = (pos % c.BS).view(-1)
        topk4 = None
        outs = []
        n = len(c.pattern)
        gb = c.graph_break_after
        if 0 <= gb < n - 1:
            h, topk4 = self._layers(0, gb + 1, h, L, cu_q, blk, off, topk4, outs)
            torch._dynamo.graph_break()  # outside any loop (Dynamo gives up on breaks inside loops)
            h, topk4 = self._layers(gb + 1, n, h, L, cu_q, blk, off, topk4, outs)
        else:
            h, topk4 = self._layers(0, n, h, L, cu_q, blk, off, topk4, outs)
        return h, torch.stack([o.float() for o in outs])

    def _layers(self, lo: int, hi: int, h, L, cu_q, blk, off, topk4, outs):
        """Layers ``lo .. hi-1`` of the decode step (appends their attention outputs to ``outs``)."""
        c = self.cfg
        B, S, K, T = c.B, c.S, c.K, c.B * c.S
        for l in range(lo, hi):
            kind = c.pattern[l]
            full_kv = getattr(self, f"full_kv_{l}")
            full_rope = getattr(self, f"full_rope_{l}")
            sel_kv = getattr(self, f"sel_kv_{l}")
            sel_rope = getattr(self, f"sel_rope_{l}")
            if c.sel_views:
                sel_kv, sel_rope = sel_kv[1:], sel_rope[1:]
            sel_table = getattr(self, f"sel_table_{l}")
            status = getattr(self, f"sel_status_{l}")
            if full_kv.dtype != torch.int8:
                _write(full_kv, blk, off, (h @ self.Wkv[l]).to(full_kv.dtype), c)
                if c.rope:
                    _write(full_rope, blk, off, (h @ self.Wkr[l]).to(full_rope.dtype), c)
            if kind == "F":
                kidx = getattr(self, f"kidx_{l}")
                _write(kidx, blk, off, (h @ self.Wki[l]).view(T, 1, c.Di), c)
                q_idx = (h @ self.Wqi[l]).view(T, c.Hi, c.Di)
                wts = h @ self.Ww[l]
                topk, _ = ref.npu_lightning_indexer(
                    q_idx, kidx, wts, actual_seq_lengths_query=cu_q, actual_seq_lengths_key=L,
                    block_table=self.block_table, layout_query="TND", layout_key="PA_BSND",
                    sparse_count=K, sparse_mode=3)
                topk4 = topk.view(B, S, 1, K) if c.topk_view == "BS1K" else topk.view(B, 1, S, K)
                if c.topk_source == "torch_topk":  # the same ids, but from a plain torch.topk
                    pos_ok = torch.arange(c.maxblk * c.BS).view(1, -1) < L.repeat_interleave(S).view(-1, 1)
                    score = torch.where(pos_ok, (h[:, :1] * torch.arange(c.maxblk * c.BS)).sin().abs(), -1.0)
                    topk4 = torch.topk(score, K, dim=-1).indices.to(torch.int32).view(B, S, 1, K)
            Ll = L + 0 if (c.shared_own_lengths and kind == "S") else L
            act = custom.npu_gather_selection_kv_cache(
                sel_rope, sel_kv, sel_table, status, topk4, full_rope, full_kv, self.block_table, Ll, cu_q,
                selection_topk_block_size=c.gather_block_size)
            ar = torch.arange(K, dtype=torch.int32)
            if c.sfa_indices_from_gather:
                idx = torch.where(ar.view(1, K) < act.view(-1, 1), ar.view(1, K), -1).view(T, 1, K)
            else:
                idx = ar.view(1, 1, K).expand(T, 1, K)
            q = (h @ self.Wq[l]).view(T, c.H, c.Dkv).to(c.dtype)
            if sel_kv.dtype == torch.int8:  # an int8 cache is dequantised (scale 1) for attention
                sel_kv, sel_rope = sel_kv.to(c.dtype), sel_rope.to(c.dtype)
            rope_kw = dict(query_rope=(h @ self.Wqr[l]).view(T, c.H, c.Dr).to(c.dtype),
                           key_rope=sel_rope.unsqueeze(2)) if c.rope else {}
            out, _, _ = ref.npu_sparse_flash_attention(
                q, sel_kv.unsqueeze(2), sel_kv.unsqueeze(2), idx, c.Dkv ** -0.5,
                block_table=sel_table, actual_seq_lengths_query=torch.arange(1, T + 1, dtype=torch.int32),
                actual_seq_lengths_kv=act, **rope_kw,
                sparse_block_size=1, layout_query="TND", layout_kv="PA_BSND", sparse_mode=3, attention_mode=2)
            outs.append(out)
            h = h + out.float().reshape(T, -1) @ self.Wo[l]
            if c.router:  # MoE-like router: a top-k producer that is not the DSA indexer
                r = torch.softmax(h @ self.Wr, dim=-1)
                val, _ = torch.topk(r, 2, dim=-1)
                h = h * val.sum(-1, keepdim=True)
        return h, topk4


def make_pair(cfg: SynthConfig, prefill: list[int], seed: int = 0):
    """Two identical models (baseline, to-compile) after the same prefill."""
    m = SynthDSA(cfg, seed=seed).eval()
    m.prefill(prefill)
    return m, copy.deepcopy(m)

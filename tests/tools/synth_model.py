"""A minimal DSA decode model written as docs/ARCHITECTURE.md §3 says, to get real backend dumps fast.

Only what the backend detects: per full layer the lightning indexer and the top-k view, per layer the
gather, the ``where`` indices and sparse attention over module-buffer caches. No MoE, no prefill
logic: caches start at zero and ``L`` is given, which is all the dump tests need (the graph compiles
and runs once).
"""
from __future__ import annotations

import torch
from torch import nn

import offload_passes  # noqa: F401  (registers the ops)

ref = torch.ops.offload_ref
custom = torch.ops.custom


class TinyDSA(nn.Module):
    def __init__(self, pattern: str = "FSSSFSF", B: int = 2, S: int = 2, K: int = 64, BS: int = 16,
                 maxblk: int = 8, D: int = 32, Dr: int = 16, H: int = 2, Hi: int = 2, Di: int = 16,
                 kv_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.pattern, self.B, self.S, self.K, self.H, self.Hi, self.Di, self.D, self.Dr = \
            pattern, B, S, K, H, Hi, Di, D, Dr
        T, blocks, smax = B * S, B * maxblk, K // BS
        g = torch.Generator().manual_seed(0)
        self.register_buffer("block_table", torch.arange(blocks, dtype=torch.int32).view(B, maxblk))
        self.proj = nn.Parameter(torch.randn(D, H * (D + Dr) + Hi * Di + Hi, generator=g) / D ** 0.5,
                                 requires_grad=False)
        for l, kind in enumerate(pattern):
            self.register_buffer(f"full_kv_{l}", torch.randn(blocks, BS, D, generator=g).to(kv_dtype))
            self.register_buffer(f"full_rope_{l}", torch.randn(blocks, BS, Dr, generator=g).to(kv_dtype))
            self.register_buffer(f"sel_kv_{l}", torch.zeros(T * smax, BS, D, dtype=kv_dtype))
            self.register_buffer(f"sel_rope_{l}", torch.zeros(T * smax, BS, Dr, dtype=kv_dtype))
            self.register_buffer(f"sel_table_{l}", torch.arange(T * smax, dtype=torch.int32).view(T, smax))
            self.register_buffer(f"sel_status_{l}", torch.full((B, S, 1, K + 1), -1, dtype=torch.int32))
            if kind == "F":
                self.register_buffer(f"kidx_{l}", torch.randn(blocks, BS, 1, Di, generator=g))

    def forward(self, h: torch.Tensor, L: torch.Tensor, cu_q: torch.Tensor) -> torch.Tensor:
        B, S, K, H, D, Dr, T = self.B, self.S, self.K, self.H, self.D, self.Dr, self.B * self.S
        topk4 = None
        for l, kind in enumerate(self.pattern):
            x = h @ self.proj
            q = x[:, :H * D].reshape(T, H, D).to(torch.bfloat16)
            qr = x[:, H * D:H * (D + Dr)].reshape(T, H, Dr).to(torch.bfloat16)
            sel_kv, sel_rope = getattr(self, f"sel_kv_{l}"), getattr(self, f"sel_rope_{l}")
            sel_table = getattr(self, f"sel_table_{l}")
            if kind == "F":
                o = H * (D + Dr)
                q_idx = x[:, o:o + self.Hi * self.Di].reshape(T, self.Hi, self.Di)
                w = x[:, o + self.Hi * self.Di:]
                topk, _ = ref.npu_lightning_indexer(
                    q_idx, getattr(self, f"kidx_{l}"), w, actual_seq_lengths_query=cu_q,
                    actual_seq_lengths_key=L, block_table=self.block_table, layout_query="TND",
                    layout_key="PA_BSND", sparse_count=K, sparse_mode=3)
                topk4 = topk.view(B, S, 1, K)
            act = custom.npu_gather_selection_kv_cache(
                sel_rope, sel_kv, sel_table, getattr(self, f"sel_status_{l}"), topk4,
                getattr(self, f"full_rope_{l}"), getattr(self, f"full_kv_{l}"), self.block_table, L, cu_q,
                selection_topk_block_size=1)
            ar = torch.arange(K, dtype=torch.int32)
            idx = torch.where(ar.view(1, K) < act.view(-1, 1), ar.view(1, K), -1).view(T, 1, K)
            out, _, _ = ref.npu_sparse_flash_attention(
                q, sel_kv.unsqueeze(2), sel_kv.unsqueeze(2), idx, D ** -0.5, block_table=sel_table,
                actual_seq_lengths_query=torch.arange(1, T + 1, dtype=torch.int32), actual_seq_lengths_kv=act,
                query_rope=qr, key_rope=sel_rope.unsqueeze(2), sparse_block_size=1, layout_query="TND",
                layout_kv="PA_BSND", sparse_mode=3, attention_mode=2)
            h = h + out.float().reshape(T, H, D).sum(1)
        return h

    def example_inputs(self, length: int = 100):
        T = self.B * self.S
        h = torch.randn(T, self.D, generator=torch.Generator().manual_seed(1))
        L = torch.full((self.B,), length, dtype=torch.int32)
        cu = torch.arange(1, self.B + 1, dtype=torch.int32) * self.S
        return h, L, cu

"""Inputs of the recipe model's decode ops as ``models/glm/modeling.py`` calls them (shared by
test_decode_kernels.py and test_cuda_compile.py).

A :class:`Case` is one decode step of ``B`` batch rows with ``S`` query tokens each: a paged key table
(``block_table`` a random permutation of the cache's blocks, or the identity), the rows' key lengths, the
cumulative query lengths of the ``TND`` layout. Its methods give ``(args, kwargs)`` of each op:

* :meth:`Case.indexer` / :meth:`Case.quant_indexer`: the lightning indexers (query ``TND``, key ``PA_BSND``,
  ``sparse_mode`` 3), or the ``BSND`` layouts;
* :meth:`Case.sfa`: sparse flash attention over the paged full cache with top-k ids (the model without
  offload), or over the selection buffer with its identity table, one "batch" per token and the ``act``
  lengths (the model with offload: ``GlmMoeDsaAttention.decode``).

``values``: ``"normal"`` (bf16 of N(0, 1)), ``"ties"`` (small integers: every score exact in fp32, many equal),
``"special"`` (normal with NaN, +-inf and -0.0 sprinkled in).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


class Case:
    def __init__(self, seed: int, B: int, S: int, bs: int, maxblk: int, kv_len: Sequence[int], paged: bool = True,
                 extra_blocks: int = 3, values: str = "normal"):
        self.g = torch.Generator().manual_seed(seed)
        self.B, self.S, self.T, self.bs, self.maxblk = B, S, B * S, bs, maxblk
        self.values = values
        self.num_blocks = B * maxblk + extra_blocks
        if paged:
            perm = torch.randperm(self.num_blocks, generator=self.g)[: B * maxblk]
        else:
            perm = torch.arange(B * maxblk)
        self.table = perm.view(B, maxblk).to(torch.int32)
        self.kv_len = torch.tensor(list(kv_len), dtype=torch.int32)
        self.cu_q = torch.arange(1, B + 1, dtype=torch.int32) * S

    # ------------------------------------------------------------------ values
    def _float(self, shape, dtype=torch.bfloat16) -> torch.Tensor:
        if self.values == "ties":
            return torch.randint(-2, 3, shape, generator=self.g).to(dtype)
        x = torch.randn(shape, generator=self.g).to(dtype)
        if self.values == "special":
            r = torch.rand(shape, generator=self.g)
            x = torch.where(r < 0.01, float("nan"), x)
            x = torch.where((r >= 0.01) & (r < 0.02), float("inf"), x)
            x = torch.where((r >= 0.02) & (r < 0.03), float("-inf"), x)
            x = torch.where((r >= 0.03) & (r < 0.05), -0.0, x).to(dtype)
        return x

    def _int8(self, shape) -> torch.Tensor:
        hi = 3 if self.values == "ties" else 128
        return torch.randint(-hi, hi, shape, generator=self.g, dtype=torch.int8)

    def _scale(self, shape) -> torch.Tensor:
        if self.values == "ties":  # powers of two: every product exact
            return (2.0 ** torch.randint(-3, 2, shape, generator=self.g)).to(torch.float16)
        return (torch.rand(shape, generator=self.g) * 0.1).to(torch.float16)

    # ------------------------------------------------------------------ the indexers
    def _key_kwargs(self, K: int, layout_query: str = "TND", layout_key: str = "PA_BSND", mode: int = 3) -> dict:
        kw = dict(layout_query=layout_query, layout_key=layout_key, sparse_count=K, sparse_mode=mode)
        if layout_query == "TND":
            kw["actual_seq_lengths_query"] = self.cu_q
        if layout_key == "PA_BSND":
            kw.update(actual_seq_lengths_key=self.kv_len, block_table=self.table)
        else:
            kw["actual_seq_lengths_key"] = self.kv_len
        return kw

    def _query_shape(self, layout_query: str, H: int, D: int) -> tuple:
        return (self.T, H, D) if layout_query == "TND" else (self.B, self.S, H, D)

    def _key_shape(self, layout_key: str, D: int) -> tuple:
        if layout_key == "PA_BSND":
            return (self.num_blocks, self.bs, 1, D)
        return (self.B, self.maxblk * self.bs, 1, D)

    def indexer(self, H: int, D: int, K: int, dtype=torch.bfloat16, **layout) -> tuple:
        lq = layout.get("layout_query", "TND")
        q = self._float(self._query_shape(lq, H, D), dtype)
        key = self._float(self._key_shape(layout.get("layout_key", "PA_BSND"), D), dtype)
        w = self._float(self._query_shape(lq, H, D)[:-1], dtype)
        return (q, key, w), self._key_kwargs(K, **layout)

    def quant_indexer(self, H: int, D: int, K: int, **layout) -> tuple:
        lq, lk = layout.get("layout_query", "TND"), layout.get("layout_key", "PA_BSND")
        q = self._int8(self._query_shape(lq, H, D))
        key = self._int8(self._key_shape(lk, D))
        w = self._float(self._query_shape(lq, H, D)[:-1], torch.float16)
        qs = self._scale(self._query_shape(lq, H, D)[:-1])
        ks = self._scale(self._key_shape(lk, D)[:-1])
        return (q, key, w, qs, ks, 0, 0), self._key_kwargs(K, **layout)

    # ------------------------------------------------------------------ sparse flash attention
    def topk_ids(self, K: int, fill: float = 0.8) -> torch.Tensor:
        """``[T, 1, K]`` int32: per token a -1-padded list of distinct positions inside its window (a few
        beyond it: the kernel must drop them)."""
        out = torch.full((self.T, 1, K), -1, dtype=torch.int32)
        for t in range(self.T):
            b, i = divmod(t, self.S)
            n = max(int(self.kv_len[b]) - self.S + i + 1, 0)
            c = min(K, int(round(fill * min(K, n + 2))))
            ids = torch.randperm(n + 2, generator=self.g)[:c] if n + 2 > 0 else torch.zeros(0, dtype=torch.long)
            out[t, 0, : ids.numel()] = ids.to(torch.int32)
        return out

    def sfa(self, N: int, D: int, Dr: Optional[int], K: int, offload: bool = False, dtype=torch.bfloat16,
            value: str = "key") -> tuple:
        q = self._float((self.T, N, D), dtype)
        qr = self._float((self.T, N, Dr), dtype) if Dr else None
        kw = dict(sparse_block_size=1, layout_query="TND", layout_kv="PA_BSND", sparse_mode=3, attention_mode=2)
        if offload:  # GlmMoeDsaAttention.decode with offload: the selection buffer, one "batch" per token
            sbs = self.bs
            blocks = self.T * (K // sbs)
            kv = self._float((blocks, sbs, 1, D), dtype)
            kr = self._float((blocks, sbs, 1, Dr), dtype) if Dr else None
            act = torch.randint(0, K + 1, (self.T,), generator=self.g, dtype=torch.int32)
            ar = torch.arange(K, dtype=torch.int32)
            idx = torch.where(ar < act[:, None], ar, -1).view(self.T, 1, K)
            kw.update(block_table=torch.arange(blocks, dtype=torch.int32).view(self.T, K // sbs),
                      actual_seq_lengths_query=torch.arange(1, self.T + 1, dtype=torch.int32),
                      actual_seq_lengths_kv=act)
        else:
            kv = self._float((self.num_blocks, self.bs, 1, D), dtype)
            kr = self._float((self.num_blocks, self.bs, 1, Dr), dtype) if Dr else None
            idx = self.topk_ids(K)
            kw.update(block_table=self.table, actual_seq_lengths_query=self.cu_q, actual_seq_lengths_kv=self.kv_len)
        if Dr:
            kw.update(query_rope=qr, key_rope=kr)
        v = kv if value == "key" else (None if value == "none" else self._float(tuple(kv.shape), dtype))
        return (q, kv, v, idx, D ** -0.5), kw

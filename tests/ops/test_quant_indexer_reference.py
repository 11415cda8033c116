"""offload_ref::npu_quant_lightning_indexer against a literal transcription of CANN's formula.

Formula (QuantLightningIndexer): per query token, over the visible keys ``j < n``::

    score_j = sum_h W[h] * ReLU( (ScaleQ[h] * ScaleK[j]) * (Qq[h] . Kq[j]) )

then the ``min(K, n)`` largest (score desc, smaller id first on ties), ``-1`` beyond.
"""
from __future__ import annotations

import pytest
import torch

import offload_passes  # noqa: F401  (registers the ops)

QLI = torch.ops.offload_ref.npu_quant_lightning_indexer
LI = torch.ops.offload_ref.npu_lightning_indexer


def loop_quant_indexer(q, key, w, qs, ks, cu_q, kv_len, bt, K, mode):
    """Literal transcription (python loops, python ints for the int8 dot, fp64 scaling).

    ``q [T, N, D]`` int8, ``key [blocks, bs, 1, D]`` int8, ``w``/``qs`` ``[T, N]``, ``ks [blocks, bs, 1]``.
    """
    T, N, D = q.shape
    bs = key.size(1)
    out = torch.full((T, 1, K), -1, dtype=torch.int32)
    start = 0
    for b in range(len(cu_q)):
        end = int(cu_q[b])
        sq = end - start
        for i in range(sq):
            t = start + i
            n = int(kv_len[b]) - sq + i + 1 if mode == 3 else int(kv_len[b])
            if n <= 0:
                continue
            scored = []
            for j in range(n):
                blk, off = int(bt[b, j // bs]), j % bs
                kq = [int(v) for v in key[blk, off, 0]]
                s = 0.0
                for h in range(N):
                    dot = sum(int(q[t, h, d]) * kq[d] for d in range(D))
                    s += float(w[t, h]) * max((float(qs[t, h]) * float(ks[blk, off, 0])) * dot, 0.0)
                scored.append((-s, j))
            scored.sort()
            c = min(K, n)
            out[t, 0, :c] = torch.tensor([j for _, j in scored[:c]], dtype=torch.int32)
        start = end
    return out


def _exact_case(seed: int):
    """Random ragged TND + PA_BSND case whose every score is exact in fp32 (powers-of-two scales,
    small integer weights, D = 4), so the kernel and the transcription must agree id for id."""
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 4, (1,), generator=g))
    N = int(torch.randint(1, 4, (1,), generator=g))
    D, bs = 4, int(torch.randint(2, 5, (1,), generator=g))
    sq = torch.randint(1, 5, (B,), generator=g)  # 1..4 query tokens per batch (S = 1 + next_n)
    cu = torch.cumsum(sq, 0).to(torch.int32)
    T = int(cu[-1])
    maxblk = 5
    num_blocks = B * maxblk + 2
    # kv lengths from 0 (nothing visible) up to the table's capacity; < sq exercises empty causal rows
    kv_len = torch.randint(0, maxblk * bs + 1, (B,), generator=g).to(torch.int32)
    q = torch.randint(-128, 128, (T, N, D), generator=g).to(torch.int8)
    key = torch.randint(-128, 128, (num_blocks, bs, 1, D), generator=g).to(torch.int8)
    w = torch.randint(-2, 3, (T, N), generator=g).to(torch.float16)
    qs = torch.pow(2.0, -torch.randint(0, 3, (T, N), generator=g).float()).to(torch.float16)
    ks = torch.pow(2.0, -torch.randint(0, 3, (num_blocks, bs, 1), generator=g).float()).to(torch.float16)
    bt = torch.randperm(num_blocks, generator=g)[: B * maxblk].view(B, maxblk).to(torch.int32)
    K = int(torch.randint(1, 12, (1,), generator=g))
    mode = 3 if seed % 4 else 0
    return q, key, w, qs, ks, cu, kv_len, bt, K, mode


def _call(q, key, w, qs, ks, cu, kv_len, bt, K, mode):
    return QLI(q, key, w, qs, ks, 0, 0, actual_seq_lengths_query=cu, actual_seq_lengths_key=kv_len,
               block_table=bt, layout_query="TND", layout_key="PA_BSND", sparse_count=K, sparse_mode=mode)


def test_matches_transcription_on_120_random_exact_cases():
    seen_empty = seen_padded = seen_full = 0
    for seed in range(120):
        q, key, w, qs, ks, cu, kv_len, bt, K, mode = _exact_case(seed)
        out = _call(q, key, w, qs, ks, cu, kv_len, bt, K, mode)
        ref = loop_quant_indexer(q, key, w, qs, ks, cu, kv_len, bt, K, mode)
        assert out.dtype == torch.int32 and out.shape == (q.size(0), 1, K)
        assert torch.equal(out, ref), f"seed {seed}"
        # -1 padding and the causal limit, stated directly: row t has exactly min(K, n_t) ids, all < n_t
        start = 0
        for b in range(len(cu)):
            end = int(cu[b])
            for i in range(end - start):
                n = max(int(kv_len[b]) - (end - start) + i + 1 if mode == 3 else int(kv_len[b]), 0)
                row = out[start + i, 0]
                valid = row[row >= 0]
                assert valid.numel() == min(K, n) and bool((row[valid.numel():] == -1).all())
                assert bool((valid < n).all()) and valid.unique().numel() == valid.numel()
                seen_empty += n == 0
                seen_padded += 0 < n < K
                seen_full += n >= K
            start = end
    assert seen_empty and seen_padded and seen_full  # the cases cover all three regimes


def test_equals_unquantised_indexer_on_dequantised_inputs():
    # Dequantisation commutes with the dot: relu(qs*ks*(Qq.Kq)) == relu((qs*Qq).(ks*Kq)); exact here.
    for seed in range(8):
        q, key, w, qs, ks, cu, kv_len, bt, K, mode = _exact_case(1000 + seed)
        out = _call(q, key, w, qs, ks, cu, kv_len, bt, K, mode)
        qf = q.float() * qs.float().unsqueeze(-1)
        kf = key.float() * ks.float().unsqueeze(-1)
        ref, _ = LI(qf, kf, w.float(), actual_seq_lengths_query=cu, actual_seq_lengths_key=kv_len, block_table=bt,
                    layout_query="TND", layout_key="PA_BSND", sparse_count=K, sparse_mode=mode)
        assert torch.equal(out, ref)


def test_hand_values_scales_change_the_order():
    # One token, one head, D = 1, keys [2, 3, -1, 1] with key scales [1, 0.25, 1, 2]:
    # scores = relu(qs * ks * q * k) = [2, 0.75, 0, 2] -> order [0, 3, 1, 2]; qs < 0 flips the signs.
    q = torch.ones(1, 1, 1, dtype=torch.int8)
    key = torch.tensor([2, 3, -1, 1], dtype=torch.int8).view(1, 4, 1, 1)
    ks = torch.tensor([1.0, 0.25, 1.0, 2.0], dtype=torch.float16).view(1, 4, 1)
    w = torch.ones(1, 1, dtype=torch.float16)
    kw = dict(actual_seq_lengths_query=torch.tensor([1], dtype=torch.int32),
              actual_seq_lengths_key=torch.tensor([4], dtype=torch.int32),
              block_table=torch.tensor([[0]], dtype=torch.int32), layout_query="TND", layout_key="PA_BSND",
              sparse_count=6, sparse_mode=3)
    out = QLI(q, key, w, torch.ones(1, 1, dtype=torch.float16), ks, 0, 0, **kw)
    assert out.tolist() == [[[0, 3, 1, 2, -1, -1]]]
    out = QLI(q, key, w, -torch.ones(1, 1, dtype=torch.float16), ks, 0, 0, **kw)
    assert out.tolist() == [[[2, 0, 1, 3, -1, -1]]]  # only key 2 scores > 0; ties at 0 by id


def test_bsnd_layouts_equal_tnd_pa():
    g = torch.Generator().manual_seed(7)
    B, S, N, D, Skv, K = 2, 3, 2, 8, 6, 4
    q = torch.randint(-128, 128, (B, S, N, D), generator=g).to(torch.int8)
    key = torch.randint(-128, 128, (B, Skv, 1, D), generator=g).to(torch.int8)
    w = torch.rand(B, S, N, generator=g).to(torch.float16)
    qs = torch.rand(B, S, N, generator=g).to(torch.float16)
    ks = torch.rand(B, Skv, 1, generator=g).to(torch.float16)
    kv_len = torch.tensor([2, 6], dtype=torch.int32)
    out = QLI(q, key, w, qs, ks, 0, 0, actual_seq_lengths_key=kv_len, layout_query="BSND", layout_key="BSND",
              sparse_count=K, sparse_mode=3)
    assert out.shape == (B, S, 1, K)
    assert out[0, 0, 0].tolist() == [-1, -1, -1, -1]  # L = 2, S = 3: the first token sees nothing
    ref = QLI(q.view(B * S, N, D), key, w.view(B * S, N), qs.view(B * S, N), ks, 0, 0,
              actual_seq_lengths_query=torch.tensor([3, 6], dtype=torch.int32), actual_seq_lengths_key=kv_len,
              block_table=torch.tensor([[0], [1]], dtype=torch.int32), layout_query="TND", layout_key="PA_BSND",
              sparse_count=K, sparse_mode=3)
    assert torch.equal(out.view(B * S, 1, K), ref)


def _args():
    q = torch.ones(2, 2, 4, dtype=torch.int8)
    key = torch.ones(4, 2, 1, 4, dtype=torch.int8)
    w = torch.ones(2, 2, dtype=torch.float16)
    qs = torch.ones(2, 2, dtype=torch.float16)
    ks = torch.ones(4, 2, 1, dtype=torch.float16)
    kw = dict(actual_seq_lengths_query=torch.tensor([1, 2], dtype=torch.int32),
              actual_seq_lengths_key=torch.tensor([3, 2], dtype=torch.int32),
              block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
              layout_query="TND", layout_key="PA_BSND", sparse_count=2, sparse_mode=3)
    return [q, key, w, qs, ks, 0, 0], kw


@pytest.mark.parametrize("pos, value, match", [
    (5, 1, "query_quant_mode must be 0 .per-token-head dequant scales., got 1"),
    (6, 2, "key_quant_mode must be 0 .per-token dequant scales., got 2"),
    (0, torch.ones(2, 2, 4), "query must be int8, got torch.float32"),
    (1, torch.ones(4, 2, 1, 4, dtype=torch.float8_e4m3fn),
     "key is torch.float8_e4m3fn: float8 indexer caches are Ascend 950 only"),
    (2, torch.ones(2, 2, dtype=torch.bfloat16), "weights must be float16/float32, got torch.bfloat16"),
    (3, torch.ones(2, 3, dtype=torch.float16), r"query_dequant_scale must be \[2, 2\] for layout_query 'TND', got \[2, 3\]"),
    (4, torch.ones(4, 2, dtype=torch.float16), r"key_dequant_scale must be key.shape\[:3\] = \[4, 2, 1\]"),
    (4, torch.ones(4, 2, 1, dtype=torch.int32), "key_dequant_scale must be float16/float32, got torch.int32"),
])
def test_errors_positional(pos, value, match):
    args, kw = _args()
    args[pos] = value
    with pytest.raises(RuntimeError, match="offload_ref::npu_quant_lightning_indexer: " + match):
        QLI(*args, **kw)


@pytest.mark.parametrize("change, match", [
    (dict(layout_query="SBH"), "layout_query must be 'TND' or 'BSND'"),
    (dict(layout_key="TND"), "layout_key must be 'PA_BSND' or 'BSND'"),
    (dict(sparse_mode=1), "sparse_mode must be 0 or 3"),
    (dict(sparse_count=4096), r"sparse_count must be in \(0, 2048\], got 4096"),
    (dict(key_dtype=34), r"key_dtype must be None \(key_dtype only selects HiFloat8 on Ascend 950\), got 34"),
    (dict(block_table=None), "block_table is required for layout_key 'PA_BSND'"),
    (dict(actual_seq_lengths_query=torch.tensor([1, 3], dtype=torch.int32)),
     r"actual_seq_lengths_query\[-1\] must equal the query token count T=2"),
    (dict(block_table=torch.tensor([[0, 9], [2, 3]], dtype=torch.int32)), r"block_table holds a block id outside \[0, 4\)"),
    (dict(actual_seq_lengths_key=torch.tensor([5, 2], dtype=torch.int32)),
     "a position that must be read lies beyond block_table's 2 blocks"),
])
def test_errors_keywords(change, match):
    args, kw = _args()
    kw.update(change)
    with pytest.raises(RuntimeError, match="offload_ref::npu_quant_lightning_indexer: " + match):
        QLI(*args, **kw)


def test_fake_validates_and_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kw = _args()
    with FakeTensorMode() as mode:
        fa = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fkw = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        out = QLI(*fa, **fkw)
        assert out.shape == (2, 1, 2) and out.dtype == torch.int32
        fa[4] = mode.from_tensor(torch.ones(4, 3, 1, dtype=torch.float16))
        with pytest.raises(RuntimeError, match=r"key_dequant_scale must be key.shape\[:3\]"):
            QLI(*fa, **fkw)


def test_opcheck():
    args, kw = _args()
    g = torch.Generator().manual_seed(3)
    args[0] = torch.randint(-128, 128, (2, 2, 4), generator=g).to(torch.int8)
    args[1] = torch.randint(-128, 128, (4, 2, 1, 4), generator=g).to(torch.int8)
    torch.library.opcheck(QLI.default, tuple(args), kw)
    q4 = torch.randint(-128, 128, (2, 2, 3, 8), generator=g).to(torch.int8)
    k4 = torch.randint(-128, 128, (2, 6, 1, 8), generator=g).to(torch.int8)
    f = torch.rand(2, 2, 3, generator=g)
    torch.library.opcheck(QLI.default, (q4, k4, f, f.half(), torch.rand(2, 6, 1).half(), 0, 0),
                          dict(layout_query="BSND", layout_key="BSND", sparse_count=4))

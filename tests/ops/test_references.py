"""offload_ref::npu_lightning_indexer / npu_sparse_flash_attention against loop oracles and hand values."""
from __future__ import annotations

import math

import pytest
import torch

import offload_passes  # noqa: F401  (registers the ops)

LI = torch.ops.offload_ref.npu_lightning_indexer
SFA = torch.ops.offload_ref.npu_sparse_flash_attention


# ----------------------------------------------------------------------------------------- oracles


def loop_indexer(q, key, w, cu_q, kv_len, bt, K, mode):
    """Straight transcription of docs/ops.md §6.1 (python loops, fp64 scores)."""
    T = q.size(0)
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
            scores = []
            for j in range(n):
                kj = key[int(bt[b, j // bs]), j % bs, 0].double()
                s = sum(float(w[t, h]) * max(float(q[t, h].double() @ kj), 0.0) for h in range(q.size(1)))
                scores.append((-s, j))  # score desc, ties -> smaller id first
            scores.sort()
            c = min(K, n)
            out[t, 0, :c] = torch.tensor([j for _, j in scores[:c]], dtype=torch.int32)
        start = end
    return out


def loop_sfa(q, key, idx, scale, bt, cu_q, kv_len, q_rope, k_rope, mode=3):
    """Straight transcription of docs/ops.md §6.2 (python loops, fp64)."""
    T, N, D = q.shape
    bs = key.size(1)
    out = torch.zeros(T, N, D, dtype=torch.float64)
    start = 0
    for b in range(len(cu_q)):
        end = int(cu_q[b])
        sq = end - start
        for i in range(sq):
            t = start + i
            lim = int(kv_len[b]) - sq + i if mode == 3 else int(kv_len[b]) - 1
            P = [int(p) for p in idx[t, 0] if int(p) != -1 and 0 <= int(p) <= lim]
            if not P:
                continue
            ks = torch.stack([key[int(bt[b, p // bs]), p % bs, 0].double() for p in P])
            krs = torch.stack([k_rope[int(bt[b, p // bs]), p % bs, 0].double() for p in P])
            for h in range(N):
                z = [scale * (float(q[t, h].double() @ ks[j]) + float(q_rope[t, h].double() @ krs[j]))
                     for j in range(len(P))]
                m = max(z)
                e = [math.exp(v - m) for v in z]
                ssum = sum(e)
                out[t, h] = sum((e[j] / ssum) * ks[j] for j in range(len(P)))
        start = end
    return out


def _int_tensor(g, shape, lo=-3, hi=4, dtype=torch.float32):
    # Small integers: every dot product and weighted sum is exact in fp32, so the oracle and the
    # kernel see identical scores, including exact ties (which exercise the tie-break).
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def _shuffled_table(g, B, maxblk, num_blocks):
    perm = torch.randperm(num_blocks, generator=g)[: B * maxblk]
    return perm.view(B, maxblk).to(torch.int32)


# ----------------------------------------------------------------------------------------- indexer


def test_indexer_hand_values_and_tie_break():
    # One token, one head, D = 1: scores are w * relu(q * k) = [1, 3, 0, 3, 2] for keys [1, 3, -5, 3, 2].
    q = torch.ones(1, 1, 1)
    key = torch.tensor([1.0, 3.0, -5.0, 3.0, 2.0, 9.0, 9.0, 9.0]).view(2, 4, 1, 1)  # 2 blocks of 4
    w = torch.ones(1, 1)
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    out, extra = LI(q, key, w, actual_seq_lengths_query=torch.tensor([1], dtype=torch.int32),
                    actual_seq_lengths_key=torch.tensor([5], dtype=torch.int32), block_table=bt,
                    layout_query="TND", layout_key="PA_BSND", sparse_count=4, sparse_mode=3)
    # 1 and 3 tie at 3.0 -> id 1 first; positions 5..7 (score 9) are beyond the 5 visible keys.
    assert out.tolist() == [[[1, 3, 4, 0]]]
    assert out.dtype == torch.int32 and extra.numel() == 0
    out, _ = LI(q, key, w, actual_seq_lengths_query=torch.tensor([1], dtype=torch.int32),
                actual_seq_lengths_key=torch.tensor([3], dtype=torch.int32), block_table=bt,
                layout_query="TND", layout_key="PA_BSND", sparse_count=8, sparse_mode=3)
    assert out.tolist() == [[[1, 0, 2, -1, -1, -1, -1, -1]]]  # n = 3 < K: -1 suffix, zero score still kept


@pytest.mark.parametrize("mode", [3, 0])
def test_indexer_matches_loop_tnd_pa(mode):
    g = torch.Generator().manual_seed(1)
    B, N, D, bs, maxblk, K = 3, 3, 8, 4, 5, 6
    cu = torch.tensor([1, 4, 6], dtype=torch.int32)  # ragged: Sq = 1, 3, 2
    kv_len = torch.tensor([9, 3, 17], dtype=torch.int32)  # batch 1: n = 1, 2, 3 (< K); batch 2 spans blocks
    T = int(cu[-1])
    q = _int_tensor(g, (T, N, D))
    w = _int_tensor(g, (T, N), -2, 3)
    key = _int_tensor(g, (20, bs, 1, D))
    bt = _shuffled_table(g, B, maxblk, 20)
    out, _ = LI(q, key, w, actual_seq_lengths_query=cu, actual_seq_lengths_key=kv_len, block_table=bt,
                layout_query="TND", layout_key="PA_BSND", sparse_count=K, sparse_mode=mode)
    ref = loop_indexer(q, key, w, cu, kv_len, bt, K, mode)
    assert torch.equal(out, ref)
    assert (out[1:4] >= 0).sum().item() == (3 * 3 if mode == 0 else 1 + 2 + 3)


def test_indexer_empty_rows_and_bsnd_layouts():
    g = torch.Generator().manual_seed(2)
    B, S, N, D, Skv, K = 2, 2, 2, 4, 5, 4
    q = _int_tensor(g, (B, S, N, D))
    w = _int_tensor(g, (B, S, N))
    key = _int_tensor(g, (B, Skv, 1, D))
    kv_len = torch.tensor([1, 5], dtype=torch.int32)
    out, _ = LI(q, key, w, actual_seq_lengths_key=kv_len, layout_query="BSND", layout_key="BSND",
                sparse_count=K, sparse_mode=3)
    assert out.shape == (B, S, 1, K)
    # batch 0: L = 1 with S = 2 -> token 0 sees nothing (all -1), token 1 sees id 0 only.
    assert out[0, 0, 0].tolist() == [-1, -1, -1, -1]
    assert out[0, 1, 0].tolist() == [0, -1, -1, -1]
    # Same data through TND + PA_BSND (one block per batch) gives the same ids.
    ref, _ = LI(q.view(B * S, N, D), key, w.view(B * S, N),
                actual_seq_lengths_query=torch.tensor([2, 4], dtype=torch.int32), actual_seq_lengths_key=kv_len,
                block_table=torch.tensor([[0], [1]], dtype=torch.int32), layout_query="TND",
                layout_key="PA_BSND", sparse_count=K, sparse_mode=3)
    assert torch.equal(out.view(B * S, 1, K), ref)


def _li_args():
    q = torch.randn(2, 2, 4)
    key = torch.randn(4, 2, 1, 4)
    w = torch.randn(2, 2)
    kw = dict(actual_seq_lengths_query=torch.tensor([1, 2], dtype=torch.int32),
              actual_seq_lengths_key=torch.tensor([3, 2], dtype=torch.int32),
              block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
              layout_query="TND", layout_key="PA_BSND", sparse_count=2, sparse_mode=3)
    return q, key, w, kw


@pytest.mark.parametrize("change, match", [
    (dict(layout_query="SBH"), "layout_query must be 'TND' or 'BSND'"),
    (dict(layout_key="TND"), "layout_key must be 'PA_BSND' or 'BSND'"),
    (dict(sparse_mode=1), "sparse_mode must be 0 or 3"),
    (dict(return_value=True), "return_value=True is not supported"),
    (dict(sparse_count=4096), r"sparse_count must be in \(0, 2048\]"),
    (dict(block_table=None), "block_table is required"),
    (dict(actual_seq_lengths_query=torch.tensor([1, 3], dtype=torch.int32)), r"actual_seq_lengths_query\[-1\] must equal"),
    (dict(block_table=torch.tensor([[0, 9], [2, 3]], dtype=torch.int32)), r"block_table holds a block id outside \[0, 4\)"),
    (dict(actual_seq_lengths_key=torch.tensor([5, 2], dtype=torch.int32)), "a position that must be read lies beyond block_table's 2 blocks"),
])
def test_indexer_errors(change, match):
    q, key, w, kw = _li_args()
    kw.update(change)
    with pytest.raises(RuntimeError, match="offload_ref::npu_lightning_indexer: " + match):
        LI(q, key, w, **kw)


def test_indexer_error_key_heads():
    q, key, w, kw = _li_args()
    with pytest.raises(RuntimeError, match=r"key dim 2 \(key heads N2\) must be 1, got 2"):
        LI(q, key.expand(4, 2, 2, 4).contiguous(), w, **kw)


def test_indexer_opcheck():
    q, key, w, kw = _li_args()
    torch.library.opcheck(LI.default, (q, key, w), kw)
    g = torch.Generator().manual_seed(3)
    q4 = torch.randn(2, 2, 3, 8, generator=g).to(torch.bfloat16)
    k4 = torch.randn(2, 6, 1, 8, generator=g).to(torch.bfloat16)
    w4 = torch.randn(2, 2, 3, generator=g).to(torch.bfloat16)
    torch.library.opcheck(LI.default, (q4, k4, w4), dict(layout_query="BSND", layout_key="BSND", sparse_count=4))


# ----------------------------------------------------------------------------------------- SFA


def _sfa_case(seed=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    B, N, D, Dr, bs, maxblk, K = 3, 2, 8, 4, 4, 4, 6
    cu = torch.tensor([2, 3, 6], dtype=torch.int32)
    kv_len = torch.tensor([7, 1, 14], dtype=torch.int32)
    T = 6
    q = torch.randn(T, N, D, generator=g).to(dtype)
    qr = torch.randn(T, N, Dr, generator=g).to(dtype)
    key = torch.randn(16, bs, 1, D, generator=g).to(dtype)
    kr = torch.randn(16, bs, 1, Dr, generator=g).to(dtype)
    bt = _shuffled_table(g, B, maxblk, 16)
    idx = torch.tensor([
        [6, 0, 3, -1, -1, -1],   # b0 i0: lim 5 -> id 6 ignored (future)
        [6, 2, 5, 1, 4, -1],     # b0 i1: lim 6
        [-1, -1, -1, -1, -1, -1],  # b1: nothing selected -> zeros
        [11, 0, 7, 3, -1, -1],   # b2 i0: lim 11
        [12, 1, 9, 8, 10, 2],    # b2 i1
        [13, 12, 11, 0, 5, 6],   # b2 i2
    ], dtype=torch.int32).view(T, 1, K)
    kw = dict(block_table=bt, actual_seq_lengths_query=cu, actual_seq_lengths_kv=kv_len, query_rope=qr,
              key_rope=kr, sparse_block_size=1, layout_query="TND", layout_kv="PA_BSND", sparse_mode=3,
              attention_mode=2)
    return q, key, idx, kw


def test_sfa_matches_loop():
    q, key, idx, kw = _sfa_case()
    out, m, s = SFA(q, key, key, idx, 0.3, **kw)
    ref = loop_sfa(q, key, idx, 0.3, kw["block_table"], kw["actual_seq_lengths_query"],
                   kw["actual_seq_lengths_kv"], kw["query_rope"], kw["key_rope"])
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref.float(), rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(out[2]) == 0  # empty selection -> zeros
    assert m.numel() == 0 and s.numel() == 0 and m.dtype == torch.float32


def test_sfa_single_position_returns_that_row():
    # One selected position: softmax weight 1, output = that key row exactly (value = key in mode 2).
    q, key, idx, kw = _sfa_case()
    idx = torch.full_like(idx, -1)
    idx[0, 0, 0] = 3
    out, _, _ = SFA(q, key, key, idx, 0.3, **kw)
    b0_block = int(kw["block_table"][0, 0])
    assert torch.equal(out[0], key[b0_block, 3, 0].expand(2, -1))


def test_sfa_result_independent_of_index_order():
    # The offload path presents the same set in ledger order: the reference must give the same bits.
    q, key, idx, kw = _sfa_case(dtype=torch.bfloat16)
    out, _, _ = SFA(q, key, key, idx, 0.3, **kw)
    flipped = torch.flip(idx, dims=[-1])
    out2, _, _ = SFA(q, key, key, flipped, 0.3, **kw)
    assert torch.equal(out, out2)


def test_sfa_bsnd_layout_and_no_rope():
    g = torch.Generator().manual_seed(5)
    B, S, N, D, Skv, K = 2, 2, 2, 4, 5, 3
    q = torch.randn(B, S, N, D, generator=g)
    key = torch.randn(B, Skv, 1, D, generator=g)
    idx = torch.tensor([[[[0, 2, -1]], [[4, 1, 3]]], [[[1, -1, -1]], [[0, 4, 2]]]], dtype=torch.int32)
    out, _, _ = SFA(q, key, None, idx, 0.5, layout_query="BSND", layout_kv="BSND", sparse_mode=3,
                    attention_mode=2)
    zeros_rope_q = torch.zeros(B * S, N, 1)
    zeros_rope_k = torch.zeros(B, Skv, 1, 1)
    ref = loop_sfa(q.view(B * S, N, D), key, idx.view(B * S, 1, K), 0.5, torch.tensor([[0], [1]]),
                   torch.tensor([2, 4]), torch.tensor([Skv, Skv]), zeros_rope_q, zeros_rope_k)
    torch.testing.assert_close(out.view(B * S, N, D), ref.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change, match", [
    (dict(attention_mode=0), "attention_mode must be 2"),
    (dict(sparse_block_size=16), "sparse_block_size must be 1"),
    (dict(layout_kv="TND"), "layout_kv must be 'PA_BSND' or 'BSND'"),
    (dict(sparse_mode=2), "sparse_mode must be 0 or 3"),
    (dict(return_softmax_lse=True), "return_softmax_lse=True is not supported"),
    (dict(key_rope=None), "query_rope and key_rope must be given together"),
    (dict(actual_seq_lengths_kv=None), "actual_seq_lengths_kv is required"),
    (dict(block_table=torch.zeros(2, 4, dtype=torch.int32)), r"block_table must be \[B=3, max_blocks\]"),
])
def test_sfa_errors(change, match):
    q, key, idx, kw = _sfa_case()
    kw.update(change)
    with pytest.raises(RuntimeError, match="offload_ref::npu_sparse_flash_attention: " + match):
        SFA(q, key, key, idx, 0.3, **kw)


def test_sfa_error_selected_block_out_of_table():
    q, key, idx, kw = _sfa_case()
    kw["actual_seq_lengths_kv"] = torch.tensor([7, 1, 20], dtype=torch.int32)  # lim reaches id 19
    idx = idx.clone()
    idx[5, 0, 0] = 19  # block column 4 >= maxblk 4
    with pytest.raises(RuntimeError, match="beyond block_table's 4 blocks"):
        SFA(q, key, key, idx, 0.3, **kw)


def test_sfa_opcheck_noncontiguous_query():
    q, key, idx, kw = _sfa_case(dtype=torch.bfloat16)
    # A transposed query (the model's absorbed q is a transpose view): the fake must still describe
    # the kernel's contiguous output.
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not qt.is_contiguous()
    torch.library.opcheck(SFA.default, (qt, key, key, idx, 0.3), kw)
    out, _, _ = SFA(qt, key, key, idx, 0.3, **kw)
    assert out.is_contiguous()

"""Offload vs non-offload decode paths of the tiny GLM-5.2 model (docs/models.md).

Tolerance: **exact** (``torch.equal``) for the per-layer attention outputs, the top-k and the logits.
Why this is the right tolerance and not a lucky one: both paths feed SFA the very same KV rows (the
gather is a bitwise copy of the full cache), only in a different order (ledger order vs top-k order).
The CPU SFA reference accumulates in float64, where every product of bf16 values is exact and the
sum's order changes the result by ~1e-16 relative, far below one bf16/fp32 ulp; the rounded outputs
are therefore identical, and so is everything downstream (the next full layer's indexer sees
bit-identical hidden states, so its top-k cannot flip on a near tie). Any difference at all means
a wrong row was selected or gathered.
"""
from __future__ import annotations

import functools

import pytest
import torch

from offload_passes import models
from offload_passes.models.glm import npu_ops

STEPS = 32


def _run(S: int, offload: bool, prefill_lens):
    b = models.build("tiny", enable_offload=offload, next_n=S - 1, decode_steps=STEPS)
    drv = models.Driver(b.model, b.runner, prefill_lens=prefill_lens)
    b.model.return_internals = True
    drv.prefill()
    steps, snaps = [], []
    for _ in range(STEPS):
        out = drv.step()
        steps.append(out)
        if offload:  # ledger + selection state right after this step (for the §8.9 checks)
            snaps.append([
                (a.sel_status.clone(), a.sel_kv.clone(), a.sel_rope.clone())
                for a in (layer.self_attn for layer in b.model.model.layers)
            ])
    return b, drv, steps, snaps


# S = 1 with equal prompts; S = 4 with a ragged batch whose row 1 starts below K (rows with n < K).
CASES = {1: (256, 256), 4: (256, 41)}


@functools.lru_cache(maxsize=None)
def _pair(S: int):
    return _run(S, False, CASES[S]), _run(S, True, CASES[S])


@pytest.mark.parametrize("S", [1, 4])
def test_offload_matches_the_model_without_offload_every_layer(S):
    (b0, _, ref, _), (b1, _, off, _) = _pair(S)
    L = b0.config.num_hidden_layers
    assert len(ref) == len(off) == STEPS
    for i, (x, y) in enumerate(zip(ref, off)):
        assert len(x.attn) == len(y.attn) == L
        for layer, (a, c) in enumerate(zip(x.attn, y.attn)):
            assert a.shape == (2 * S, b0.config.num_attention_heads, b0.config.kv_lora_rank)
            assert torch.equal(a, c), f"step {i} layer {layer}: max diff {(a.float() - c.float()).abs().max()}"
        for g, (t0, t1) in enumerate(zip(x.topk, y.topk)):
            assert torch.equal(t0, t1), f"step {i} group {g}: top-k differs"
        assert torch.equal(x.logits, y.logits), f"step {i}: logits differ"
        assert x.logits.shape == (2, S, b0.config.vocab_size)


@pytest.mark.parametrize("S", [1, 4])
def test_selection_is_sparse_and_indexer_rows_are_suffix_padded(S):
    (b0, drv, ref, _), _ = _pair(S)
    K = b0.config.index_topk
    for x in ref:
        L = x.positions[:, -1] + 1
        for t in x.topk:  # [B, S, K]
            for b in range(2):
                for s in range(S):
                    row = t[b, s]
                    max_sel = int(L[b]) - (S - 1 - s) - 1
                    n = int((row >= 0).sum())
                    assert n == min(K, max_sel + 1)
                    assert (row[:n] >= 0).all() and (row[n:] == -1).all()  # suffix padded
                    assert row[:n].unique().numel() == n and int(row[:n].max()) <= max_sel
    # Really sparse: at the last step row 0 holds >= 256 + 32*S tokens and the indexer keeps K = 64.
    assert int(ref[-1].positions[0, -1]) + 1 >= 256 + STEPS * S - S + 1 > 4 * K


def _check_ledger(model, snap, topk_by_group, act_by_layer, L, S):
    """docs/ops.md §8.9 for every layer and query row."""
    cfg = model.config
    K, BS = cfg.index_topk, model.block_size
    C, Dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    group_of = {l: g for g, layers in enumerate(cfg.groups()) for l in layers}
    bt = model.block_table.long()
    for l, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        status, sel_kv, sel_rope = snap[l]
        topk = topk_by_group[group_of[l]]  # [B, S, K]
        full_kv = attn.kv_cache.view(-1, C)
        full_rope = attn.k_rope_cache.view(-1, Dr)
        sbt = attn.sel_block_table.long()
        act = act_by_layer[l]
        for b in range(model.batch_size):
            for s in range(S):
                r = b * S + s
                max_sel = int(L[b]) - (S - 1 - s) - 1
                ids = [x for x in topk[b, s].tolist() if 0 <= x <= max_sel]
                n = len(ids)
                st = status[b, s, 0]
                assert sorted(st[:n].tolist()) == sorted(ids), f"layer {l} row {r}: ledger is not a permutation"
                assert (st[n:K] == -1).all(), f"layer {l} row {r}: ledger tail not -1"
                assert int(st[K]) == n == int(act[r]), f"layer {l} row {r}: status[K]={int(st[K])} act={int(act[r])} n={n}"
                p = torch.arange(n)
                srow = sbt[r, p // BS] * BS + p % BS
                x = st[:n].long()
                frow = bt[b, x // BS] * BS + x % BS
                assert torch.equal(sel_kv.view(-1, C)[srow], full_kv[frow]), f"layer {l} row {r}: kv payload"
                assert torch.equal(sel_rope.view(-1, Dr)[srow], full_rope[frow]), f"layer {l} row {r}: rope payload"


@pytest.mark.parametrize("S", [1, 4])
def test_gather_ledger_invariants(S):
    _, (b1, _, off, snaps) = _pair(S)
    kept_total = 0
    for i, (x, snap) in enumerate(zip(off, snaps)):
        L = x.positions[:, -1] + 1
        _check_ledger(b1.model, snap, x.topk, x.act, L, S)
        if i:  # reuse: ids the previous step's ledger already held at the same position
            prev = snaps[i - 1]
            kept_total += sum(int(((snap[l][0][..., :-1] == prev[l][0][..., :-1]) & (snap[l][0][..., :-1] >= 0)).sum())
                              for l in range(len(snap)))
    assert kept_total > 0  # the ledger really reuses selection entries across steps


def test_shared_layers_receive_the_owner_topk_tensor(monkeypatch):
    """Eager: every layer of a group hands the gather the very same [B,S,1,K] tensor, a view of the
    owner's indexer output; in the non-offload path SFA gets the indexer output itself."""
    for offload in (True, False):
        b = models.build("tiny", enable_offload=offload, decode_steps=1)
        b.driver.prefill()
        produced, consumed = [], []
        li, gather, sfa = npu_ops.lightning_indexer, npu_ops.gather_selection_kv_cache, npu_ops.sparse_flash_attention

        def rec_li(*a, **k):
            out = li(*a, **k)
            produced.append(out[0])
            return out

        def rec_gather(*a, **k):
            consumed.append(a[4])
            return gather(*a, **k)

        def rec_sfa(*a, **k):
            if not offload:
                consumed.append(a[3])
            return sfa(*a, **k)

        monkeypatch.setattr(npu_ops, "lightning_indexer", rec_li)
        monkeypatch.setattr(npu_ops, "gather_selection_kv_cache", rec_gather)
        monkeypatch.setattr(npu_ops, "sparse_flash_attention", rec_sfa)
        b.driver.step()
        monkeypatch.undo()
        groups = b.config.groups()
        assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert len(produced) == 2 and len(consumed) == 8
        for g, layers in enumerate(groups):
            for l in layers:
                assert consumed[l] is consumed[layers[0]], f"layer {l} does not reuse the owner's tensor"
                if offload:
                    assert consumed[l].shape == (2, 1, 1, 64)  # [B, S, 1, K] view of the owner's [T, 1, K]
                    assert consumed[l].untyped_storage().data_ptr() == produced[g].untyped_storage().data_ptr()
                else:
                    assert consumed[l] is produced[g]
        assert consumed[0] is not consumed[4]


def test_reset_row_clears_ledger_and_decoding_continues():
    b = models.build("tiny", enable_offload=True, decode_steps=4)
    drv = b.driver
    drv.prefill()
    drv.step()
    attn0 = b.model.model.layers[0].self_attn
    before_row0 = attn0.sel_status[0].clone()
    assert (attn0.sel_status[1] >= 0).any()
    drv.reset_row(1, prompt_len=100)
    assert torch.equal(attn0.sel_status[0], before_row0)  # other rows untouched
    assert (attn0.sel_status[1] == -1).all()
    # The new request's cache holds exactly 100 tokens: blocks after that are zero.
    blocks = attn0.kv_cache.size(0) // 2
    row1 = attn0.kv_cache[blocks:].view(-1, attn0.kv_lora_rank)
    assert row1[:100].abs().sum() > 0 and row1[100:].abs().sum() == 0
    ids, pos = drv.next_inputs()
    assert pos[1, 0] == 100 and pos[0, 0] == 257
    out = drv.step()
    assert torch.isfinite(out.logits.float()).all()


def test_trace_and_input_validation(tmp_path):
    (_, drv, ref, _), _ = _pair(1)
    tr = drv.trace()
    assert tr["format"] == "offload_passes.topk_trace" and tr["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert tr["topk"].shape == (STEPS, 2, 2, 1, 64) and tr["topk"].dtype == torch.int32
    assert torch.equal(tr["topk"][5, 1], ref[5].topk[1])
    assert tr["kv_len"][0].tolist() == [257, 257] and tr["kv_len"][-1].tolist() == [256 + STEPS] * 2
    saved = torch.load(drv.save_trace(tmp_path / "t.pt"))
    assert torch.equal(saved["topk"], tr["topk"])
    with pytest.raises(RuntimeError, match=r"token source exhausted after max_steps=32"):
        drv.next_inputs()
    model = drv.model
    with pytest.raises(RuntimeError, match=r"must be \[batch_size=2, 1\+next_n=1\]"):
        model(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64))

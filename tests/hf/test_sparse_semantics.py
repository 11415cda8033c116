"""The sparse attention keeps the dense masking semantics; detection verifies the HF form end to end
and refuses (graph unmodified, reason named) what it cannot prove. No transformers model needed here:
``_dense_layer`` is the HF ``glm_moe_dsa`` decode attention written the way the model writes it."""
import pytest
import torch
import torch.nn.functional as F

from offload_passes.backend import OffloadRefused, make_offload_backend
from offload_passes.passes.frontends.hf import dense_masks_left, hf_sparse_attention

B, H, S, T, C, R, N, V = 2, 3, 1, 40, 16, 8, 12, 10
MIN = torch.finfo(torch.float32).min


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, N + R, generator=g)
    latent = torch.randn(B, 1, T, C, generator=g)
    rope = torch.randn(B, 1, T, R, generator=g)
    w = torch.randn(H * (N + V), C, generator=g) / C ** 0.5
    return q, latent, rope, w


def _expand(latent, rope, w):
    kv = F.linear(latent, w).view(B, T, -1, N + V).transpose(1, 2)
    k_nope, v = torch.split(kv, [N, V], dim=-1)
    key = kv.new_empty(B, H, T, N + R)
    key[..., :N].copy_(k_nope)
    key[..., N:].copy_(rope.expand(-1, H, -1, -1))
    return key, v


def _dense_layer(q, latent, rope, w, topk, base, kind="eager", twice=False):
    """HF's dense DSA: scatter the top-k into a mask, attend over all T positions."""
    key, v = _expand(latent, rope, w)
    index_mask = topk.new_ones((B, S, T), dtype=torch.bool).scatter(-1, topk.long(), False).unsqueeze(1)
    if kind == "sdpa":
        mask = base & ~index_mask
        out = F.scaled_dot_product_attention(q, key, v, attn_mask=mask, dropout_p=0.0, scale=0.3, is_causal=False)
    else:
        mask = base.masked_fill(index_mask, MIN)
        wts = torch.matmul(q, key.transpose(2, 3)) * 0.3 + mask
        wts = F.softmax(wts, dim=-1, dtype=torch.float32).to(q.dtype)
        wts = F.dropout(wts, p=0.0, training=False)
        out = torch.matmul(wts, v)
    if twice:  # the combined mask escapes: not provably the attention's alone
        return out, mask
    return out


def _from_scores(q, latent, rope, w, scores, base, kind="eager", twice=False):
    """The indexer's end: top-k of the scores, handed on as int32 (as GlmMoeDsaIndexer returns it)."""
    topk = scores.topk(8, dim=-1)[1].to(torch.int32)
    return _dense_layer(q, latent, rope, w, topk, base, kind, twice)


def _base(kind, L, pad):
    """Causal limit L (positions < L visible) and ``pad`` left-padded positions in batch row 1."""
    ok = torch.arange(T).view(1, 1, 1, T) < L
    ok = ok.expand(B, 1, S, T).clone()
    ok[1, :, :, :pad] = False
    return ok if kind == "sdpa" else torch.where(ok, 0.0, MIN)


@pytest.mark.parametrize("kind", ["eager", "sdpa"])
def test_sparse_function_same_attention_as_dense(kind):
    q, latent, rope, w = _inputs()
    L, pad, K = 20, 3, 24  # K > L: the min(index_topk, T) rule selects masked future positions too
    g = torch.Generator().manual_seed(1)
    topk = torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(B * S)]).view(B, S, K).to(torch.int32)
    base = _base(kind, L, pad)
    dense = _dense_layer(q, latent, rope, w, topk, base, kind)
    sparse = hf_sparse_attention(q, latent, rope, w, topk, base, 0.3, N, V, kind, MIN)
    assert sparse.shape == dense.shape == (B, H, S, V)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)
    # -1 entries (padding of a shorter selection) select nothing: same as leaving them out
    tk = topk.clone()
    tk[..., K // 2:] = -1
    dense_half = _dense_layer(q, latent, rope, w, topk[..., : K // 2], base, kind)
    torch.testing.assert_close(hf_sparse_attention(q, latent, rope, w, tk, base, 0.3, N, V, kind, MIN),
                               dense_half, rtol=1e-5, atol=1e-6)


def _compile(fn, **opts):
    backend = make_offload_backend(**opts)
    graphs = []

    def capture(gm, ex):
        out = backend(gm, ex)
        graphs.append(gm)
        return out

    return torch.compile(fn, backend=capture, fullgraph=True), backend, graphs


@pytest.mark.parametrize("kind", ["eager", "sdpa"])
def test_detects_and_rewrites_the_hf_form(kind):
    torch._dynamo.reset()
    q, latent, rope, w = _inputs(2)
    base = _base(kind, 12, 2)
    # as the HF indexer: scores of masked positions are -inf, so a row's top-k holds its visible positions
    visible = base if kind == "sdpa" else base == 0
    scores = torch.randn(B, S, T, generator=torch.Generator().manual_seed(7)).masked_fill(~visible[:, 0], float("-inf"))
    fn, backend, graphs = _compile(lambda *a: _from_scores(*a, kind=kind), enable_offload=False)
    out = fn(q, latent, rope, w, scores, base)
    rep = backend.reports[-1]
    assert rep["rewritten"] and rep["hf"]["sites"][0]["kind"] == kind and rep["hf"]["sites"][0]["K"] == 8
    assert dense_masks_left(graphs[0].graph) == 0
    torch.testing.assert_close(out, _from_scores(q, latent, rope, w, scores, base, kind), rtol=1e-5, atol=1e-6)


def test_indices_not_from_a_topk_are_refused():
    torch._dynamo.reset()
    q, latent, rope, w = _inputs(4)
    topk = torch.arange(8, dtype=torch.int32).view(1, 1, 8).expand(B, S, 8).contiguous()
    fn, backend, graphs = _compile(_dense_layer, enable_offload=False)
    out = fn(q, latent, rope, w, topk, _base("eager", 12, 0))
    rep = backend.reports[-1]
    assert rep["rewritten"] is False and rep["refusals"][0]["reason"] == "hf_site_not_verified"
    assert "scatter indices do not come from topk(...)[1]" in rep["refusals"][0]["detail"]
    assert dense_masks_left(graphs[0].graph) == 1


def test_unverified_site_is_left_unmodified_with_reason():
    torch._dynamo.reset()
    q, latent, rope, w = _inputs(3)
    scores = torch.randn(B, S, T, generator=torch.Generator().manual_seed(9))
    base = _base("eager", 12, 0)
    fn, backend, graphs = _compile(lambda *a: _from_scores(*a, twice=True), enable_offload=False)
    out, _ = fn(q, latent, rope, w, scores, base)
    rep = backend.reports[-1]
    assert rep["rewritten"] is False
    assert [r["reason"] for r in rep["refusals"]] == ["hf_site_not_verified"]
    assert "the combined mask has 2 consumers, expected 1" in rep["refusals"][0]["detail"]
    assert dense_masks_left(graphs[0].graph) == 1  # unmodified
    torch.testing.assert_close(out, _from_scores(q, latent, rope, w, scores, base, twice=True)[0], rtol=0, atol=0)
    torch._dynamo.reset()
    fn, _, _ = _compile(lambda *a: _from_scores(*a, twice=True), enable_offload=False, strict=True)
    with pytest.raises(Exception, match="combined mask has 2 consumers") as ei:
        fn(q, latent, rope, w, scores, base)
    chain, e = [], ei.value
    while e is not None:
        chain.append(type(e))
        e = e.__cause__ or getattr(e, "inner_exception", None)
    assert OffloadRefused in chain, chain


def test_graph_where_dense_is_cheaper_is_left_as_is():
    """S*K >= T (a prefill-like graph): gathering S*K rows would cost more than the T dense ones."""
    torch._dynamo.reset()
    q, latent, rope, w = _inputs(5)
    qs = torch.randn(B, H, 5, N + R)
    scores = torch.randn(B, 5, T)
    base = torch.where(torch.arange(T).view(1, 1, 1, T) < 30, 0.0, MIN).expand(B, 1, 5, T)

    def prefill_like(q, latent, rope, w, scores, base):
        topk = scores.topk(8, dim=-1)[1].to(torch.int32)  # S*K = 5*8 = 40 >= T = 40
        key, v = _expand(latent, rope, w)
        index_mask = topk.new_ones((B, 5, T), dtype=torch.bool).scatter(-1, topk.long(), False).unsqueeze(1)
        mask = base.masked_fill(index_mask, MIN)
        wts = F.softmax(torch.matmul(q, key.transpose(2, 3)) * 0.3 + mask, dim=-1, dtype=torch.float32)
        return torch.matmul(F.dropout(wts.to(q.dtype), p=0.0, training=False), v)

    fn, backend, graphs = _compile(prefill_like, enable_offload=False)
    out = fn(qs, latent, rope, w, scores, base)
    rep = backend.reports[-1]
    assert rep["rewritten"] is False and [r["reason"] for r in rep["refusals"]] == ["dense_cheaper"]
    assert "S*K = 5*8 >= T = 40" in rep["refusals"][0]["detail"]
    assert dense_masks_left(graphs[0].graph) == 1
    torch.testing.assert_close(out, prefill_like(qs, latent, rope, w, scores, base), rtol=0, atol=0)


def test_offload_refusal_keeps_the_sparse_rewrite():
    """bf16, but no cache write to take the lengths from: the offload is refused with the reason (K = 8 is
    not: its ids would be padded with -1 to 64), the (exact) sparse rewrite stays."""
    torch._dynamo.reset()
    q, latent, rope, w = (t.to(torch.bfloat16) for t in _inputs(6))
    base = _base("sdpa", 12, 0)
    scores = torch.randn(B, S, T, generator=torch.Generator().manual_seed(8)).masked_fill(~base[:, 0], float("-inf"))
    fn, backend, graphs = _compile(lambda *a: _from_scores(*a, kind="sdpa"), enable_offload=True)
    out = fn(q, latent, rope, w, scores, base)
    rep = backend.reports[-1]
    assert rep["rewritten"] and rep["hf"]["offload"] is False and rep["ops"]["after"]["dsa_plan"] == 0
    reasons = {r["reason"]: r["detail"] for r in rep["hf"]["offload_refusals"]}
    assert set(reasons) == {"cache_layout"}
    assert "no index_copy_ / static_cache_write_ into the latent cache" in reasons["cache_layout"]
    assert dense_masks_left(graphs[0].graph) == 0
    torch.testing.assert_close(out, _from_scores(q, latent, rope, w, scores, base, "sdpa"), rtol=2e-2, atol=2e-2)

"""The W8A8C16 indexer path (``quant_config.li_cache_quant_mode: int8``), as the NPU recipe writes it:
Hadamard rotation, per-token dynamic int8 q/k, int8 indexer key cache + fp16 dequant-scale cache,
fp16 head weights, ``npu_quant_lightning_indexer`` (one output) as the top-k producer."""
from __future__ import annotations

import pytest
import torch

from offload_passes import models
from offload_passes.models.glm import npu_ops
from offload_passes.models.glm.modeling import hadamard_matrix


def _opnames(gm) -> list[str]:
    out = []
    for n in gm.graph.nodes:
        t = n.target
        if isinstance(t, torch._ops.OpOverloadPacket):
            out.append(t._qualified_op_name)
        elif isinstance(t, torch._ops.OpOverload):
            out.append(t._schema.name)
    return out


def test_preset_quant_config_and_errors_naming_the_key():
    c = models.load_config("tiny-w8a8")
    q = c.model.quant
    assert (q.mm_quant_mode, q.kv_cache_quant_mode, q.li_cache_quant_mode) == ("w16a16", "unquant", "int8")
    assert c.model.li_cache_int8 and not models.load_config("tiny").model.li_cache_int8
    # same structure as tiny: only the indexer path differs
    assert c.model.indexer_types == models.load_config("tiny").model.indexer_types
    big = models.load_config("glm-5.2-78l-w8a8")
    assert big.model.li_cache_int8 and len(big.model.groups()) == 21
    assert big.model.index_groups() == big.model.groups()  # the deprecated alias (docs/glossary.md)
    bad = [
        (dict(li_cache_quant_mode="float8"), r"quant_config.li_cache_quant_mode': 'float8' is not supported: "
                                             r"float8 indexer caches are Ascend 950 only"),
        (dict(kv_cache_quant_mode="int8"), r"quant_config.kv_cache_quant_mode': 'int8' is not supported"),
        (dict(li_cache_quant_mode="int4"), r"quant_config.li_cache_quant_mode': must be one of \['unquant', 'int8'\]"),
        (dict(mm_quant_mode="w8a8"), r"quant_config.mm_quant_mode': 'w8a8' is not supported"),
        (dict(foo="int8"), r"quant_config.foo': unknown key"),
    ]
    for qc, match in bad:
        with pytest.raises(ValueError, match=match):
            models.load_config("tiny", quant_config=qc)
    with pytest.raises(ValueError, match=r"config key 'index_head_dim': must be a power of two for li_cache_quant_mode"):
        models.load_config("tiny", quant_config={"li_cache_quant_mode": "int8"}, index_head_dim=48)


def test_hadamard_is_orthonormal_and_dynamic_quant_rounds_per_token():
    h = hadamard_matrix(32, torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(32, dtype=torch.float64), atol=1e-12)
    assert set(torch.unique(h.abs() * 32 ** 0.5).tolist()) == {1.0}
    x = torch.tensor([[0.5, -1.27, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    q, s = npu_ops.dynamic_quant(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (2,)
    assert q[0].tolist() == [50, -127, 0, 100] and abs(float(s[0]) - 1.27 / 127) < 1e-9
    assert q[1].tolist() == [0, 0, 0, 0] and float(s[1]) == 0.0  # all-zero token: no NaN
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 16, generator=g)
    q, s = npu_ops.dynamic_quant(x)
    assert s.shape == (64, 3) and bool((q.abs().amax(-1) == 127).all())  # per (token, head) row
    assert bool(((q.float() * s.unsqueeze(-1) - x).abs() <= s.unsqueeze(-1) / 2 + 1e-6).all())


def test_caches_written_int8_with_scales_and_decode_uses_the_quant_indexer():
    b = models.build("tiny-w8a8", decode_steps=2, prefill_len=40, pa_max_length=64)
    m = b.model
    idx = m.model.layers[0].self_attn.indexer
    assert idx.key_cache.dtype == torch.int8 and idx.key_scale_cache.dtype == torch.float16
    assert idx.key_scale_cache.shape == idx.key_cache.shape[:3]
    assert m.model.layers[1].self_attn.indexer is None  # a shared layer
    fp = m.memory_footprint()
    blocks, bs = idx.key_cache.shape[:2]
    assert fp["indexer_key_cache"] == 2 * blocks * bs * (32 * 1 + 2)  # 2 full layers: int8 keys + fp16 scale
    assert "model.layers.0.self_attn.indexer.hadamard" not in m.cache_buffers()
    assert not any("hadamard" in k for k in m.state_dict())  # not a checkpoint tensor
    b.driver.prefill()
    L = 40
    rows = torch.cat([torch.arange(L) + r * 64 for r in range(2)])  # identity table, 4 blocks of 16 per row
    ks = idx.key_scale_cache.view(-1)
    kc = idx.key_cache.view(-1, 32)
    assert bool((ks[rows] > 0).all()) and int((ks != 0).sum()) == 2 * L
    assert bool((kc[rows].abs().amax(-1) == 127).all())  # per-token dynamic quantisation
    # the first decode step's keys land at position L, as int8 with a scale
    graphs = []

    def backend(gm, ex):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(m, backend=backend, fullgraph=True)
    res = b.driver.run(steps=1, step_fn=step, collect=True)
    assert float(ks[L]) > 0 and int(kc[L].abs().max()) == 127
    names = _opnames(graphs[0])
    assert names.count("offload_ref::npu_quant_lightning_indexer") == 2
    assert "offload_ref::npu_lightning_indexer" not in names
    t = res.steps[0].topk[0]
    assert t.shape == (2, 1, 64) and t.dtype == torch.int32
    assert res.steps[0].positions[:, -1].tolist() == [L, L]
    for row in t[:, 0]:  # K = 64 > L + 1 = 41 visible keys: all of them, then -1
        assert sorted(row.tolist()[:L + 1]) == list(range(L + 1)) and row[L + 1:].tolist() == [-1] * (63 - L)


@pytest.mark.parametrize("S", [1, 4])
def test_offload_matches_the_model_without_offload_and_int8_indexer_matches_dequantised_reference(S):
    """Eager (no compile): offload and non-offload decode of tiny-w8a8 are bit-identical; the int8
    indexer's top-k equals the unquantised reference indexer on the dequantised cache."""
    runs = []
    for offload in (False, True):
        b = models.build("tiny-w8a8", enable_offload=offload, next_n=S - 1, decode_steps=4)
        b.model.return_internals = True
        runs.append((b, b.driver.run(steps=4, collect=True)))
    (b0, r0), (_, r1) = runs
    for x, y in zip(r0.steps, r1.steps):
        assert all(torch.equal(a, c) for a, c in zip(x.attn, y.attn))
        assert all(torch.equal(a, c) for a, c in zip(x.topk, y.topk))
        assert torch.equal(x.logits, y.logits)
    # the quant indexer on the final caches equals the float reference on dequantised tensors
    idx = b0.model.model.layers[0].self_attn.indexer
    g = torch.Generator().manual_seed(5)
    T, H, D = 2 * S, idx.n_heads, idx.head_dim
    qq = torch.randint(-127, 128, (T, H, D), generator=g).to(torch.int8)
    qs = (torch.rand(T, H, generator=g) + 0.5).half()
    w = (torch.rand(T, H, generator=g) - 0.5).half()
    L = r0.steps[-1].positions[:, -1].to(torch.int32) + 1
    cu = torch.arange(1, 3, dtype=torch.int32) * S
    kw = dict(actual_seq_lengths_query=cu, actual_seq_lengths_key=L, block_table=b0.model.block_table,
              layout_query="TND", layout_key="PA_BSND", sparse_count=64, sparse_mode=3)
    out = npu_ops.quant_lightning_indexer(qq, idx.key_cache, w, qs, idx.key_scale_cache, 0, 0, **kw)
    deq_k = idx.key_cache.float() * idx.key_scale_cache.float().unsqueeze(-1)
    ref, _ = torch.ops.offload_ref.npu_lightning_indexer(
        qq.float() * qs.float().unsqueeze(-1), deq_k, w.float(), **kw)
    agree = (out == ref).float().mean().item()
    assert agree > 0.97  # a different fp32 rounding may swap a near tie; the top-k sets are the same
    assert all(set(a.tolist()) == set(c.tolist()) for a, c in zip(out.view(T, -1), ref.view(T, -1)))

"""The tiny decode step compiles with plain torch.compile(fullgraph=True) and its Dynamo graph has the
shape docs/ARCHITECTURE.md §3 promises to the offload pass."""
from __future__ import annotations

import pytest
import torch

from offload_passes import models

LI = "npu_lightning_indexer"
GATHER = "custom::npu_gather_selection_kv_cache"
SFA = "npu_sparse_flash_attention"


def _opname(node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name
    return str(t)


def _capture(model, ids, pos):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend, fullgraph=True)(ids, pos)
    return graphs, out


def _src(node):
    """Follow view-like nodes back to their source."""
    while node.op in ("call_method", "call_function") and (
        node.target in ("view", "unsqueeze", "reshape") or getattr(node.target, "__name__", "") == "getitem"
    ):
        node = node.args[0]
    return node


@pytest.mark.parametrize("offload", [True, False])
def test_dynamo_graph_matches_the_contract(offload):
    b = models.build("tiny", enable_offload=offload, decode_steps=2)
    b.driver.prefill()
    ids, pos = b.driver.next_inputs()
    eager = b.model(ids, pos)
    # The eager step advanced the caches; re-prefill so the captured run sees the same state.
    b.driver.prefill()
    graphs, out = _capture(b.model, ids, pos)
    assert len(graphs) == 1  # fullgraph: one graph, no break
    assert torch.equal(out, eager)
    g = graphs[0].graph
    nodes = list(g.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    li = [n for n in nodes if _opname(n).endswith(LI)]
    sfa = [n for n in nodes if _opname(n).endswith(SFA)]
    gather = [n for n in nodes if _opname(n) == GATHER]
    assert len(li) == 2 and len(sfa) == 8  # two IndexShare groups, eight layers
    assert all(_opname(n).split("::")[0] in ("offload_ref", "npu") for n in li + sfa)
    groups = b.config.index_groups()
    if offload:
        assert len(gather) == 8
        for layer, (gn, sn) in enumerate(zip(gather, sfa)):
            owner = next(gr[0] for gr in groups if layer in gr)
            topk4 = gn.args[4]
            assert topk4 is gather[owner].args[4]  # shared layers: the very same [B,S,1,K] node
            assert topk4.target == "view" and _src(topk4) is li[groups.index(next(gr for gr in groups if layer in gr))]
            assert tuple(topk4.meta["example_value"].shape) == (2, 1, 1, 64)
            assert all(a.op == "placeholder" for a in gn.args[:4])  # sel rope/kv/table/status: lifted buffers
            assert gn.args[5].target == "view" and gn.args[5].args[0].op == "placeholder"  # full rope
            assert gn.args[6].target == "view" and gn.args[6].args[0].op == "placeholder"  # full kv
            assert gn.kwargs["selection_topk_block_size"] == 1
            # This step's KV is written into the full cache before the gather reads it.
            writes = [n for n in nodes if n.target == "index_put_" and _src(n.args[0]) is gn.args[6].args[0]]
            assert len(writes) == 1 and order[writes[0]] < order[gn]
            # SFA on the selection: key = value = sel_kv.unsqueeze(2), act as kv lengths, where() indices.
            assert sn.args[1] is sn.args[2] and sn.args[1].target == "unsqueeze" and sn.args[1].args[0] is gn.args[1]
            assert sn.kwargs["actual_seq_lengths_kv"] is gn and sn.kwargs["block_table"] is gn.args[2]
            assert sn.args[3].target == "view" and "where" in str(sn.args[3].args[0].target)
            assert sn.kwargs["attention_mode"] == 2 and sn.kwargs["layout_kv"] == "PA_BSND"
            assert sn.kwargs["layout_query"] == "TND" and sn.kwargs["sparse_mode"] == 3
    else:
        assert not gather
        for layer, sn in enumerate(sfa):
            gi = next(i for i, gr in enumerate(groups) if layer in gr)
            assert _src(sn.args[3]) is li[gi] and sn.args[3] is sfa[groups[gi][0]].args[3]
            assert sn.args[1].op == "placeholder" and sn.args[1] is sn.args[2]  # paged full kv cache


def test_aot_eager_fullgraph_matches_eager_over_steps():
    """AOTAutograd functionalises the in-place gather and the cache writes: same bits as eager."""
    ref = models.build("tiny", enable_offload=True, next_n=1, decode_steps=3)
    cmp = models.build("tiny", enable_offload=True, next_n=1, decode_steps=3)
    ref.driver.prefill()
    cmp.driver.prefill()
    torch._dynamo.reset()
    step = torch.compile(cmp.model, backend="aot_eager", fullgraph=True)
    for i in range(3):
        a = ref.driver.step().logits
        c = cmp.driver.step(step).logits
        assert torch.equal(a, c), f"step {i}"
    # The compiled run mutated the model's own buffers exactly like eager.
    for la, lc in zip(ref.model.model.layers, cmp.model.model.layers):
        assert torch.equal(la.self_attn.sel_status, lc.self_attn.sel_status)
        assert torch.equal(la.self_attn.sel_kv, lc.self_attn.sel_kv)
        assert torch.equal(la.self_attn.kv_cache, lc.self_attn.kv_cache)


def test_inductor_fullgraph_offload_step():
    """Plain torch.compile (Inductor) of the offload decode step, on a 2-layer tiny variant to keep
    the C++ codegen short. Tolerance 0.016 on logits of magnitude < 1: Inductor fuses RMSNorm / RoPE /
    softmax chains in fp32 where eager rounds to bf16 between ops, a few bf16 ulps (2^-8 relative)."""
    kw = dict(enable_offload=True, next_n=1, decode_steps=3, num_hidden_layers=2, index_topk_pattern="FS")
    ref = models.build("tiny", **kw)
    cmp = models.build("tiny", **kw)
    ref.driver.prefill()
    cmp.driver.prefill()
    torch._dynamo.reset()
    step = torch.compile(cmp.model, fullgraph=True)
    for i in range(3):
        a = ref.driver.step().logits.float()
        c = cmp.driver.step(step).logits.float()
        assert a.abs().max() < 1.0
        torch.testing.assert_close(c, a, rtol=0, atol=0.016, msg=f"step {i}")
    # The compiled step ran the in-place gather on the model's own ledger (a copy would leave it -1).
    assert (cmp.model.model.layers[1].self_attn.sel_status[..., -1] == 64).all()

"""``rewrite()`` as one pass, in the style of vLLM's pass tests: a small hand-built FX graph of each form
(the recipe's ops, the Hugging Face dense attention), fake values propagated through it (nothing runs:
``FakeTensorProp``), detection / grouping / preconditions to get the pass's inputs, then ``rewrite`` and
the ops counted before and after. The site bookkeeping (report rows, per-layer nodes) is the core's."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import offload_passes  # noqa: F401  (registers the ops)
from offload_passes.options import OffloadOptions
from offload_passes.passes._fx import count_ops
from offload_passes.passes.frontends.hf import HF, dense_masks_left, hf_sparse_attention, hf_sparse_attention_rows
from offload_passes.passes.frontends.recipe import RECIPE
from offload_passes.passes.group import group
from offload_passes.passes.rewrite import RewriteSettings, rewrite
from offload_passes.passes.state_build import build_state

custom, ref = torch.ops.custom, torch.ops.offload_ref

# the recipe form: B rows, S = 1, K = 64 ids, pages of BS = 16 tokens, F = MAXBLK * BS tokens per row
B, S, K, BS, MAXBLK, DKV, DR, H, HI, DI = 2, 1, 64, 16, 8, 32, 16, 2, 2, 16
T_ROWS = B * S
OPTS = OffloadOptions(pool_size=64)


def _fake(gm: fx.GraphModule, inputs: list) -> fx.GraphModule:
    """Every node's fake value under Dynamo's key (``meta["example_value"]``, and ``val``); nothing computes."""
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    for n in gm.graph.nodes:
        if "val" in n.meta:
            n.meta["example_value"] = n.meta["val"]
    return gm


def recipe_graph(pattern: str = "FSSFS", identity: bool = True) -> tuple[fx.GraphModule, list]:
    """The recipe's decode attention (docs/ARCHITECTURE.md §3) for ``pattern`` ("F": a layer with its own
    lightning indexer, "S": it reuses the last one's top-k), every cache a graph input; and its inputs."""
    g = fx.Graph()
    inputs: list = []

    def inp(name: str, t: torch.Tensor) -> fx.Node:
        inputs.append(t)
        return g.placeholder(name)

    blocks = B * MAXBLK
    table = torch.arange(blocks, dtype=torch.int32) if identity else torch.randperm(blocks).to(torch.int32)
    bt = inp("block_table", table.view(B, MAXBLK))
    L = inp("L", torch.full((B,), 100, dtype=torch.int32))
    cu = inp("cu_q", torch.arange(1, B + 1, dtype=torch.int32) * S)
    q = inp("q", torch.randn(T_ROWS, H, DKV, dtype=torch.bfloat16))
    q_rope = inp("q_rope", torch.randn(T_ROWS, H, DR, dtype=torch.bfloat16))
    q_idx = inp("q_idx", torch.randn(T_ROWS, HI, DI))
    w = inp("w", torch.randn(T_ROWS, HI))
    smax = K // BS
    layer_inputs = []  # every graph input before the first computing node, as in Dynamo's graphs
    for l, kind in enumerate(pattern):
        layer_inputs.append(dict(
            kidx=inp(f"kidx_{l}", torch.randn(blocks, BS, 1, DI)) if kind == "F" else None,
            full_kv=inp(f"full_kv_{l}", torch.randn(blocks, BS, DKV, dtype=torch.bfloat16)),
            full_rope=inp(f"full_rope_{l}", torch.randn(blocks, BS, DR, dtype=torch.bfloat16)),
            sel_kv=inp(f"sel_kv_{l}", torch.zeros(T_ROWS * smax, BS, DKV, dtype=torch.bfloat16)),
            sel_rope=inp(f"sel_rope_{l}", torch.zeros(T_ROWS * smax, BS, DR, dtype=torch.bfloat16)),
            sel_table=inp(f"sel_table_{l}", torch.arange(T_ROWS * smax, dtype=torch.int32).view(T_ROWS, smax)),
            status=inp(f"status_{l}", torch.full((B, S, 1, K + 1), -1, dtype=torch.int32))))
    topk4 = None
    outs = []
    for c in layer_inputs:
        if c["kidx"] is not None:
            ids = g.call_function(ref.npu_lightning_indexer.default, (q_idx, c["kidx"], w), dict(
                actual_seq_lengths_query=cu, actual_seq_lengths_key=L, block_table=bt, layout_query="TND",
                layout_key="PA_BSND", sparse_count=K, sparse_mode=3))
            topk4 = g.call_method("view", (g.call_function(operator.getitem, (ids, 0)), B, S, 1, K))
        sel_kv, sel_rope, sel_table = c["sel_kv"], c["sel_rope"], c["sel_table"]
        act = g.call_function(custom.npu_gather_selection_kv_cache.default,
                              (sel_rope, sel_kv, sel_table, c["status"], topk4, c["full_rope"], c["full_kv"], bt, L,
                               cu), {"selection_topk_block_size": 1})
        ar = g.call_function(torch.arange, (K,), {"dtype": torch.int32})
        keep = g.call_function(operator.lt, (g.call_method("view", (ar, 1, K)), g.call_method("view", (act, -1, 1))))
        idx = g.call_method("view", (g.call_function(torch.where, (keep, g.call_method("view", (ar, 1, K)), -1)),
                                     T_ROWS, 1, K))
        kv4, rope4 = g.call_method("unsqueeze", (sel_kv, 2)), g.call_method("unsqueeze", (sel_rope, 2))
        seq_q = g.call_function(torch.arange, (1, T_ROWS + 1), {"dtype": torch.int32})
        sfa = g.call_function(ref.npu_sparse_flash_attention.default, (q, kv4, kv4, idx, DKV ** -0.5), dict(
            block_table=sel_table, actual_seq_lengths_query=seq_q, actual_seq_lengths_kv=act, query_rope=q_rope,
            key_rope=rope4, sparse_block_size=1, layout_query="TND", layout_kv="PA_BSND", sparse_mode=3,
            attention_mode=2))
        outs.append(g.call_function(operator.getitem, (sfa, 0)))
    g.output(tuple(outs))
    return _fake(fx.GraphModule(torch.nn.Module(), g), inputs), inputs


def _rewrite(fe, gm: fx.GraphModule, inputs: list, opts: OffloadOptions = OPTS, offload: bool = True,
             policy: str = "fifo"):
    """The pass's inputs from the front-end's own passes, then ``rewrite`` alone; returns its report."""
    det = fe.detect(gm)
    assert det.refusals == [] and det.has_dsa
    grp = group(det)
    plans = []
    state = None
    if offload:
        pr = fe.check_preconditions(gm, grp, inputs, opts)
        assert pr.refusals == [], pr.refusals
        plans = pr.groups
        state = build_state(gm, plans, inputs, "graph_test", state_from_caches=False)
    return rewrite(gm, fe, grp, plans, state, RewriteSettings(replacement_policy=policy))


def _targets(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


# ----------------------------------------------------------------------------------------- recipe form

@pytest.mark.parametrize("policy, install", [("fifo", "dsa_install"), ("second_chance", "dsa_install_sc")])
def test_recipe_form_op_counts(policy, install):
    gm, inputs = recipe_graph("FSSFS")
    before = count_ops(gm.graph)
    rr = _rewrite(RECIPE, gm, inputs, policy=policy)
    after = count_ops(gm.graph)
    assert {k: v for k, v in before.items() if v} == {
        "npu_lightning_indexer": 2, "npu_gather_selection_kv_cache": 5, "npu_sparse_flash_attention": 5}
    # one plan per group, a serve and an install per layer; every gather gone; the attention and indexers stay
    assert {k: v for k, v in after.items() if v} == {
        "npu_lightning_indexer": 2, "npu_sparse_flash_attention": 5, "dsa_plan": 2, "dsa_serve": 5, install: 5}
    gm.graph.lint()
    # the core filed every site: report rows, the nodes before / after, each install under the layer it refills
    assert [s.layer for s in rr.sites] == [0, 1, 2, 3, 4] and [s.group_id for s in rr.sites] == [0, 0, 0, 1, 1]
    names = {n.name for n in gm.graph.nodes}
    assert all(s.serve_node in names and s.sfa_node in names and s.gather_node not in names for s in rr.sites)
    assert [len(s.install_nodes) for s in rr.sites] == [1] * 5
    assert {n for s in rr.sites for n in s.install_nodes} <= names
    plans = [n.name for n in gm.graph.nodes if "dsa_plan" in str(n.target)]
    assert [rr.layer_nodes_after[layer][0] for layer in (0, 3)] == plans  # the owners' plan comes first
    assert all(rr.layer_nodes_after[layer][0] not in plans for layer in (1, 2, 4))
    assert rr.layer_nodes_before[0][0].startswith("npu_lightning_indexer") and len(rr.layer_nodes_before[0]) == 3
    assert len(rr.layer_nodes_before[1]) == 2  # a shared layer: its gather and its attention
    assert rr.offload and rr.guards and rr.extra == {}


def test_recipe_form_paged_keeps_the_gather():
    """A non-identity block table: serve places the pool hits, the model's gather reads the rest (kept)."""
    gm, inputs = recipe_graph("FSS", identity=False)
    rr = _rewrite(RECIPE, gm, inputs)
    after = {k: v for k, v in count_ops(gm.graph).items() if v}
    assert after == {"npu_lightning_indexer": 1, "npu_gather_selection_kv_cache": 3, "npu_sparse_flash_attention": 3,
                     "dsa_plan": 1, "dsa_serve": 3, "dsa_install": 3}
    # every serve sits before its layer's kept gather
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: n for n in gm.graph.nodes}
    for s in rr.sites:
        assert order[by_name[s.serve_node]] < order[by_name[s.gather_node]]


# ------------------------------------------------------------------------------ Hugging Face form

# the HF form: bf16 latent caches [B, 1, T, C], T = 128 cached positions, K = 64 selected, 3 heads
HB, HH, HT, HC, HR, HN, HV = 2, 3, 128, 32, 16, 12, 10
MIN = torch.finfo(torch.bfloat16).min


def _dense(q, latent, rope, w, topk, base):
    """HF's ``glm_moe_dsa`` eager decode attention, dense: the top-k as a mask over all T positions."""
    kv = F.linear(latent, w).view(HB, HT, -1, HN + HV).transpose(1, 2)
    k_nope, v = torch.split(kv, [HN, HV], dim=-1)
    key = kv.new_empty(HB, HH, HT, HN + HR)
    key[..., :HN].copy_(k_nope)
    key[..., HN:].copy_(rope.expand(-1, HH, -1, -1))
    index_mask = topk.new_ones((HB, S, HT), dtype=torch.bool).scatter(-1, topk.long(), False).unsqueeze(1)
    mask = base.masked_fill(index_mask, MIN)
    wts = torch.matmul(q, key.transpose(2, 3)) * 0.3 + mask
    wts = F.softmax(wts, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(wts, v)


def hf_step(q, latent0, rope0, latent1, rope1, w, scores, base, pos, new_latent, new_rope):
    """Two HF layers sharing one indexer's top-k (one group), each writing this step's row into its caches."""
    latent0.index_copy_(2, pos, new_latent)
    rope0.index_copy_(2, pos, new_rope)
    latent1.index_copy_(2, pos, new_latent)
    rope1.index_copy_(2, pos, new_rope)
    topk = scores.topk(K, dim=-1)[1].to(torch.int32)
    return _dense(q, latent0, rope0, w, topk, base), _dense(q, latent1, rope1, w, topk, base)


def hf_graph() -> tuple[fx.GraphModule, list]:
    bf = torch.bfloat16
    inputs = [torch.randn(HB, HH, S, HN + HR, dtype=bf),
              torch.randn(HB, 1, HT, HC, dtype=bf), torch.randn(HB, 1, HT, HR, dtype=bf),
              torch.randn(HB, 1, HT, HC, dtype=bf), torch.randn(HB, 1, HT, HR, dtype=bf),
              torch.randn(HH * (HN + HV), HC, dtype=bf), torch.randn(HB, S, HT),
              torch.zeros(HB, 1, S, HT, dtype=bf), torch.tensor([99]),
              torch.randn(HB, 1, S, HC, dtype=bf), torch.randn(HB, 1, S, HR, dtype=bf)]
    return _fake(fx.symbolic_trace(hf_step), inputs), inputs


def _hf_counts(gm: fx.GraphModule) -> dict:
    ours = {k: v for k, v in count_ops(gm.graph).items() if v}
    return dict(ours, sparse=len(_targets(gm, hf_sparse_attention)),
                sparse_rows=len(_targets(gm, hf_sparse_attention_rows)), masks=dense_masks_left(gm.graph),
                softmax=len(_targets(gm, F.softmax)))


def test_hf_form_op_counts_with_offload():
    gm, inputs = hf_graph()
    before = _hf_counts(gm)
    rr = _rewrite(HF, gm, inputs)
    assert before == {"sparse": 0, "sparse_rows": 0, "masks": 2, "softmax": 2}
    # each dense attention (mask, expansion, softmax) became one sparse attention over the served rows
    assert _hf_counts(gm) == {"dsa_plan": 1, "dsa_serve": 2, "dsa_install": 2, "sparse": 0, "sparse_rows": 2,
                              "masks": 0, "softmax": 0}
    gm.graph.lint()
    assert [(s.layer, s.group_id, s.kind) for s in rr.sites] == [(0, 0, "eager"), (1, 0, "eager")]
    assert rr.offload and rr.extra["dense_masks_left"] == 0 and rr.extra["erased_nodes"] > 0
    assert [len(rr.layer_nodes_before[layer]) for layer in (0, 1)] == [3, 3]  # scatter, mask, attention


def test_hf_form_op_counts_sparse_only():
    """No offload: the sparse attention reads the caches; no plan, serve or install."""
    gm, inputs = hf_graph()
    rr = _rewrite(HF, gm, inputs, offload=False)
    assert _hf_counts(gm) == {"sparse": 2, "sparse_rows": 0, "masks": 0, "softmax": 0}
    assert not rr.offload and [s.serve_node for s in rr.sites] == [None, None]
    assert all(s.install_nodes == [] for s in rr.sites) and rr.guards == []


def test_plan_ids_of_a_narrow_topk_are_padded_and_negatives_moved_to_the_end():
    """A top-k of 5 ids (not a multiple of the ops' 64): the plan reads the ids in their order with the
    negative ones moved behind them (the plan stops a microtask at a negative id, docs/ops.md §2.4) and -1
    up to 64, int32 ``[B, S, 1, K]``."""
    from offload_passes.passes.emit import Builder
    from offload_passes.passes.preconditions import GroupGeometry
    from offload_passes.passes.rewrite import _plan_topk

    g = torch.fx.Graph()
    tk = g.placeholder("tk")
    tk.meta["val"] = FakeTensorMode().from_tensor(torch.zeros(2, 1, 5, dtype=torch.int64))
    p = GroupGeometry(0, 0, 0, [0], 2, 1, 64, 64, 128, 8, 1024, None, tk, "tk", {}, ids_width=5)
    g.output(_plan_topk(Builder(g, [tk]), p))
    out = torch.fx.GraphModule(torch.nn.Module(), g)(torch.tensor([[[3, -1, 7, -1, 9]], [[-1, 2, 4, 6, 8]]]))
    assert out.shape == (2, 1, 1, 64) and out.dtype == torch.int32
    assert out[0, 0, 0, :3].tolist() == [3, 7, 9] and out[1, 0, 0, :4].tolist() == [2, 4, 6, 8]
    assert (out[0, 0, 0, 3:] == -1).all() and (out[1, 0, 0, 4:] == -1).all()

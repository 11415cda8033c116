"""The unmodified transformers GLM-5 DSA model, compiled with the backend: real sparse attention (and
the shared-indexer offload) with the same logits as the dense model, over 64 decode steps."""

import pytest
import torch

from offload_passes.passes import _fx
from offload_passes.passes.frontends.hf import dense_masks_left, hf_sparse_attention, hf_sparse_attention_rows

from hf_helpers import BF16_FACTOR, STEPS, rel_err, run_pair, teacher_forced_bf16_check

FP32_TOL = 1e-4
# bf16 (offload ops take f16/bf16 KV): no fixed bound. Both bf16 models, unmodified and rewritten, are compared
# with the fp32 unmodified model (same weights, rounded): the rewritten one must be no further from it than
# BF16_FACTOR times the unmodified one, and its greedy tokens equal fp32's except at near-ties (hf_helpers).
GROUPS = {"FSSS": [[0, 1, 2, 3]], "irregular": [[0, 1], [2], [3, 4, 5]]}


def _sparse_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target in (hf_sparse_attention, hf_sparse_attention_rows)]


def _dense_expansions(gm):
    """kv_b_proj linears whose input is a whole cache (graph input): the O(T) expansion."""
    return [n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "linear"
            and isinstance(n.args[0], torch.fx.Node) and _fx.strip_views(n.args[0]).op == "placeholder"
            and _fx.example(n.args[0]) is not None and _fx.example(n.args[0]).dim() == 4]


@pytest.mark.parametrize("pattern", ["FSSS", "irregular"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sparse_matches_dense_fp32(attn, pattern):
    p = run_pair(attn, pattern, "float32", offload=False)
    assert len(p.out) == STEPS >= 64
    err = rel_err(p.ref, p.out)
    assert err <= FP32_TOL, f"{attn}/{pattern}: relative logits error {err:.3g} > {FP32_TOL}"
    rep = p.report
    assert rep["rewritten"] and not rep["refusals"]
    assert [g["layers"] for g in rep["groups"]] == GROUPS[pattern]
    assert rep["hf"]["offload"] is False
    # structure: no dense scatter-mask, no full-cache expansion, one sparse attention per layer
    layers = sum(len(g) for g in GROUPS[pattern])
    assert dense_masks_left(p.graph.graph) == 0
    assert _dense_expansions(p.graph) == []
    calls = _sparse_calls(p.graph)
    assert len(calls) == layers and all(c.target is hf_sparse_attention for c in calls)
    assert all(c.args[6] and c.args[9] == attn for c in calls)  # scaling, kind
    # every layer of a group attends with the group's one top-k node
    tk = [_fx.strip_views(c.args[4], casts=True) for c in calls]
    for g in GROUPS[pattern]:
        assert len({tk[l] for l in g}) == 1
    assert len(set(tk)) == len(GROUPS[pattern])


@pytest.mark.parametrize("attn,pattern", [("sdpa", "FSSS"), ("eager", "irregular")])
def test_offload_matches_dense_bf16(attn, pattern):
    p = run_pair(attn, pattern, "bfloat16", offload=True)
    # the pool state lives with the compiled graph, which the next run_pair's torch._dynamo.reset() drops
    tot = p.backend.state.totals()
    steps = {c["total"]["steps"] for c in p.backend.state.counters()}
    ref32 = run_pair(attn, pattern, "float32", offload=False).ref  # the fp32 unmodified model
    eu, er = teacher_forced_bf16_check(ref32, p.ref, p.out)
    assert 0 < er <= BF16_FACTOR * eu, (attn, pattern, eu, er)
    rep = p.report
    groups = GROUPS[pattern]
    layers = sum(len(g) for g in groups)
    assert rep["rewritten"] and rep["hf"]["offload"] and not rep["hf"]["offload_refusals"]
    assert [g["layers"] for g in rep["groups"]] == groups
    ops = rep["ops"]["after"]
    assert (ops["dsa_plan"], ops["dsa_serve"], ops["dsa_install"]) == (len(groups), layers, layers)
    g = p.graph.graph
    assert dense_masks_left(g) == 0 and _dense_expansions(p.graph) == []
    # one plan per group, fed by that group's top-k; one serve per layer using its group's plan
    plans = [n for n in g.nodes if _fx.is_op(n, "dsa_plan")]
    serves = [n for n in g.nodes if _fx.is_op(n, "dsa_serve")]
    installs = [n for n in g.nodes if _fx.is_op(n, "dsa_install")]
    assert len(plans) == len(groups) and len(serves) == layers
    plan_of_serve = [_fx.getitem_of(s.args[0])[0] for s in serves]
    for gi, lay in enumerate(groups):
        assert all(plan_of_serve[l] is plans[gi] for l in lay)
    assert sorted(i.kwargs["metadata_update"] for i in installs) == [0] * (layers - len(groups)) + [1] * len(groups)
    assert all(c.target is hf_sparse_attention_rows for c in _sparse_calls(p.graph))
    # the pool really serves: hits after the first steps, and every step planned once per group
    assert tot["hits"] > 0 and tot["misses"] > 0
    assert steps == {STEPS}


def test_fp32_offload_request_keeps_sparse_and_says_why():
    """fp32 caches: the offload ops take f16/bf16 KV; the exact sparse rewrite stays, the reason is reported."""
    p = run_pair("sdpa", "FSSS", "float32", offload=True, steps=2)
    rep = p.report
    assert rep["rewritten"] and rep["hf"]["offload"] is False
    reasons = {r["reason"] for r in rep["hf"]["offload_refusals"]}
    assert reasons == {"kv_dtype"}
    assert "float16/bfloat16" in rep["hf"]["offload_refusals"][0]["detail"]
    assert rel_err(p.ref, p.out) <= FP32_TOL


def test_the_runner_passes_the_cache_under_the_installed_releases_name():
    """transformers 5.24 renamed forward's ``past_key_values`` to ``cache`` (the old name warns until 5.40): the
    runner and ``static_cache_state`` use whichever name the installed release takes, with no deprecation noise."""
    import inspect
    import warnings

    from offload_passes import _compat
    from offload_passes.decorator import static_cache_state
    from offload_passes.models import hf

    b = hf.build("hf-tiny", num_hidden_layers=2, index_topk_pattern="FS")
    name = _compat.hf_cache_kwarg()
    assert name in inspect.signature(type(b.model).forward).parameters
    dec = b.decoder()
    assert list(dec.cache_kwargs()) == [name] and dec.cache_kwargs()[name] is dec.cache
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dec.prefill(4)
        dec.step()
    assert [str(w.message) for w in caught if "deprecated" in str(w.message)] == []
    out = b.model(dec.tokens[:, 5:6], use_cache=True, **dec.cache_kwargs())
    assert getattr(out, name) is dec.cache
    assert static_cache_state(out).groups == static_cache_state(dec.cache).groups == []  # nothing compiled on it
    with pytest.raises(TypeError, match=rf"static_cache_state: cache must be a transformers Cache \(with \.layers\) "
                                        rf"or a generate\(\) / model output holding one in \.{name}, got dict"):
        static_cache_state({"layers": []})

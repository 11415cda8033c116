"""Detection of DSA sites for every top-k producer form of ``producers.TOPK_PRODUCERS``.

The graphs are written by hand with ``torch.fx`` (no Dynamo: milliseconds), one or two layers of
indexer -> view [B, S, 1, K] -> ``custom.npu_gather_selection_kv_cache`` -> where -> SFA, exactly the
data flow of docs/ARCHITECTURE.md §3. The producer is varied: ``npu_lightning_indexer`` (tuple,
``getitem 0``), ``npu_quant_lightning_indexer`` (single output), in the ``offload_ref`` namespace here
and in the ``npu`` / ``custom`` namespaces in a subprocess (schema-only test doubles of torch_npu's and
CANN's ops, so this process never gains ``torch.ops.npu`` ops other tests could see).
"""
from __future__ import annotations

import json
import operator
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import fx

import offload_passes  # noqa: F401  (registers the ops)
from offload_passes.options import OffloadOptions
from offload_passes.passes import _fx
from offload_passes.passes.frontends.recipe import check_preconditions, detect
from offload_passes.passes.group import group
from offload_passes.passes.producers import PRODUCER_NAMES, TOPK_PRODUCERS, producer_of_call, topk_source

ROOT = Path(__file__).resolve().parents[2]


def build_graph(ns: str = "offload_ref", producer: str = "npu_quant_lightning_indexer", layers: int = 2,
                output: int | None = None, caches_as_attrs: bool = False) -> fx.GraphModule:
    """``layers`` DSA layers sharing one top-k producer call ``torch.ops.<ns>.<producer>``.

    ``output``: for the tuple producer, which output the gather reads (0 = the ids). With
    ``caches_as_attrs`` every cache / table is a ``get_attr`` node (module buffers as attributes,
    ``inline_inbuilt_nn_modules=False``) instead of a placeholder.
    """
    g = fx.Graph()
    root = torch.nn.Module()
    custom = torch.ops.custom

    def inp(name: str) -> fx.Node:
        if caches_as_attrs and name not in ("q", "w", "qs", "h"):
            root.register_buffer(name, torch.zeros(1))
            return g.get_attr(name)
        return g.placeholder(name)

    q, w, qs, h = inp("q"), inp("w"), inp("qs"), inp("h")
    key, ks, bt, L, cu = inp("key"), inp("ks"), inp("bt"), inp("L"), inp("cu")
    op = getattr(getattr(torch.ops, ns), producer).default
    kw = dict(actual_seq_lengths_query=cu, actual_seq_lengths_key=L, block_table=bt, layout_query="TND",
              layout_key="PA_BSND", sparse_count=64, sparse_mode=3)
    if producer == "npu_quant_lightning_indexer":
        call = g.call_function(op, (q, key, w, qs, ks, 0, 0), kw)
        ids = call
    else:
        call = g.call_function(op, (q, key, w), kw)
        ids = g.call_function(operator.getitem, (call, 0 if output is None else output))
    ids4 = g.call_method("view", (ids, 2, 1, 1, 64))
    outs = []
    for i in range(layers):
        sel_rope, sel_kv, sel_tab = inp(f"sel_rope{i}"), inp(f"sel_kv{i}"), inp(f"sel_tab{i}")
        status, full_rope, full_kv = inp(f"status{i}"), inp(f"full_rope{i}"), inp(f"full_kv{i}")
        act = g.call_function(custom.npu_gather_selection_kv_cache.default,
                              (sel_rope, sel_kv, sel_tab, status, ids4, full_rope, full_kv, bt, L, cu),
                              {"selection_topk_block_size": 1})
        idx = g.call_function(torch.where, (act, act, -1))
        kv4 = g.call_method("unsqueeze", (sel_kv, 2))
        rope4 = g.call_method("unsqueeze", (sel_rope, 2))
        sfa = g.call_function(torch.ops.offload_ref.npu_sparse_flash_attention.default,
                              (h, kv4, kv4, idx, 0.1),
                              dict(block_table=sel_tab, actual_seq_lengths_query=cu, actual_seq_lengths_kv=act,
                                   query_rope=h, key_rope=rope4, sparse_block_size=1, layout_query="TND",
                                   layout_kv="PA_BSND", sparse_mode=3, attention_mode=2))
        outs.append(g.call_function(operator.getitem, (sfa, 0)))
    g.output(tuple(outs))
    return fx.GraphModule(root, g)


def test_table_has_both_forms():
    assert {(p.name, p.output) for p in TOPK_PRODUCERS} == {
        ("npu_lightning_indexer", 0), ("npu_quant_lightning_indexer", None)}
    assert PRODUCER_NAMES == {"npu_lightning_indexer", "npu_quant_lightning_indexer"}


@pytest.mark.parametrize("producer", ["npu_lightning_indexer", "npu_quant_lightning_indexer"])
@pytest.mark.parametrize("attrs", [False, True], ids=["placeholders", "get_attr"])
def test_both_forms_detected_and_grouped(producer, attrs):
    gm = build_graph(producer=producer, layers=3, caches_as_attrs=attrs)
    det = detect(gm)
    call = next(n for n in gm.graph.nodes if producer_of_call(n) is not None)
    assert det.refusals == [] and det.gathers == 3 and len(det.sites) == 3
    assert det.indexers == [call.name]
    assert all(s.producer is call for s in det.sites)
    assert [s.layer for s in det.sites] == [0, 1, 2]
    grp = group(det)
    assert [g.layers for g in grp.groups] == [[0, 1, 2]] and grp.groups[0].producer is call
    assert _fx.count_ops(gm.graph)[producer] == 1


def test_quant_form_is_the_call_itself_tuple_form_is_getitem_0():
    gm = build_graph(producer="npu_quant_lightning_indexer", layers=1)
    call = next(n for n in gm.graph.nodes if producer_of_call(n) is not None)
    assert topk_source(call) is call
    gm = build_graph(producer="npu_lightning_indexer", layers=1)
    call = next(n for n in gm.graph.nodes if producer_of_call(n) is not None)
    assert topk_source(call) is None  # the tuple itself is not the ids
    gi = next(n for n in call.users)
    assert topk_source(gi) is call


def test_tuple_producer_values_output_is_refused():
    gm = build_graph(producer="npu_lightning_indexer", layers=2, output=1)
    det = detect(gm)
    assert det.sites == [] and det.gathers == 2
    assert [r.reason for r in det.refusals] == ["unknown_topk_producer"] * 2
    assert "not a lightning indexer (npu_lightning_indexer, npu_quant_lightning_indexer)" in det.refusals[0].detail


def test_float8_indexer_cache_is_a_named_refusal():
    for dtype, refused in ((torch.float8_e4m3fn, True), (torch.int8, False)):
        gm = build_graph(producer="npu_quant_lightning_indexer", layers=1)
        key = next(n for n in gm.graph.nodes if n.name == "key")
        key.meta["val"] = torch.zeros(8, 16, 1, 32, dtype=dtype)
        det = detect(gm)
        pr = check_preconditions(gm, group(det), [], OffloadOptions())
        f8 = [r for r in pr.refusals if r.reason == "float8_indexer_cache"]
        if refused:
            assert len(f8) == 1 and f8[0].layer == 0
            assert "torch.float8_e4m3fn indexer key cache" in f8[0].detail and "Ascend 950" in f8[0].detail
        else:
            assert f8 == []


def test_npu_and_custom_namespaces_in_a_subprocess():
    """torch_npu's ``npu::`` and CANN's ``custom::`` spellings (schema-only test doubles)."""
    code = textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import offload_passes
        from offload_passes.custom_ops import npu_lightning_indexer as li, npu_quant_lightning_indexer as qli
        # TEST DOUBLES: schema-only stand-ins of torch_npu's npu:: and CANN's custom:: indexer ops.
        libs = [torch.library.Library(ns, "FRAGMENT") for ns in ("npu", "custom")]
        for lib in libs:
            lib.define(li.SPEC.schema)
            lib.define(qli.SPEC.schema)
        from test_detect_producers import build_graph
        from offload_passes.passes.frontends.recipe import detect
        from offload_passes.passes.group import group
        out = {{}}
        for ns in ("npu", "custom"):
            for prod in ("npu_lightning_indexer", "npu_quant_lightning_indexer"):
                det = detect(build_graph(ns=ns, producer=prod, layers=2))
                out[ns + "::" + prod] = [len(det.sites), len(group(det).groups), len(det.refusals), det.indexers]
        print(json.dumps(out))
    """)
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(got) == {f"{ns}::{p}" for ns in ("npu", "custom")
                        for p in ("npu_lightning_indexer", "npu_quant_lightning_indexer")}
    for k, (sites, groups, refusals, indexers) in got.items():
        assert (sites, groups, refusals, len(indexers)) == (2, 1, 0, 1), k


def test_glm_78l_w8a8_traced_graph_has_21_groups():
    """The production layout (78 layers, 21 IndexShare groups, K = 2048, int8 indexer cache): Dynamo's
    graph of the decode step, detection and grouping only (meta tensors: nothing is computed). The MLPs
    are all dense (``first_k_dense_replace=78``) to halve the trace time; attention / indexer / caches
    are the preset's."""
    from offload_passes import models

    b = models.build("glm-5.2-78l-w8a8", device="meta", enable_offload=True, first_k_dense_replace=78)
    got = {}

    def capture(gm, example_inputs):
        det = detect(gm)
        got.update(det=det, groups=group(det), ops=_fx.count_ops(gm.graph),
                   producers={_fx.op_name(s.producer) for s in det.sites})
        return gm.forward

    B, S = b.runner.batch_size, b.runner.seq_per_step
    ids = torch.zeros(B, S, dtype=torch.long, device="meta")
    pos = torch.full((B, S), b.runner.prefill_len, dtype=torch.long, device="meta")
    torch._dynamo.reset()
    try:
        torch.compile(b.model, backend=capture, fullgraph=True)(ids, pos)
    finally:
        torch._dynamo.reset()
    det = got["det"]
    assert det.refusals == [] and det.gathers == 78 and len(det.sites) == 78 and len(det.indexers) == 21
    assert got["producers"] == {"offload_ref::npu_quant_lightning_indexer"}
    expected = [[0], [1]] + [list(range(i, i + 4)) for i in range(2, 78, 4)]
    assert [g.layers for g in got["groups"].groups] == expected == b.model.index_groups()
    assert got["ops"]["npu_quant_lightning_indexer"] == 21 and got["ops"]["npu_lightning_indexer"] == 0

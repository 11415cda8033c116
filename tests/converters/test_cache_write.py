"""In-place KV-cache writes and metadata updates for the NPU modes, on small functional FX graphs
(the form AOT produces for ``cache.view(-1, D).index_put_((slots,), kv)``): graph shape and numbers."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from offload_passes.passes.cache_writes import cache_writes_in_place, cache_writes_to_scatter_nd
from offload_passes.passes.npu_install_chains import inplace_masked_input_updates

aten = torch.ops.aten
SHAPE = (4, 3, 1, 5)  # [blocks, block size, 1, D]: the model's paged cache layout
D = SHAPE[-1]


def write(cache, slots, vals):
    v = aten.view.default(cache, [-1, D])
    w = aten.index_put.default(v, [slots], vals)
    x = aten.view.default(w, list(SHAPE))
    out = x.sum(dim=(1, 2, 3))
    aten.copy_.default(cache, x)
    return out


def write_and_read_old(cache, slots, vals):
    old = cache.sum(dim=(1, 2, 3))  # reads the old value: the write cannot be in place
    return write(cache, slots, vals) + old


def _inputs():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(SHAPE, generator=g)
    slots = torch.tensor([11, 2, 7], dtype=torch.int64)
    vals = torch.randn(3, D, generator=g)
    return cache, slots, vals


def _run_both(fn, gm):
    c1, s, v = _inputs()
    c2 = c1.clone()
    want = fn(c1, s, v)
    got = gm(c2, s, v)
    assert torch.equal(got, want) and torch.equal(c2, c1)
    return c2


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_ge_cache_write_becomes_scatter_nd_update_on_the_cache_input():
    gm = make_fx(write, tracing_mode="fake")(*_inputs())
    rep = cache_writes_to_scatter_nd(gm)
    assert rep.in_place == ["cache_1"] and rep.copied == [] and rep.left == []
    op = torch.ops.offload_ge.scatter_nd_update.default
    (node,) = [n for n in gm.graph.nodes if n.target is op]
    assert node.args[0].op == "placeholder"  # no reshape between the Data and the ref op
    assert list(node.args[1].meta["val"].shape) == [3, 3]  # slot -> (block, row, 0)
    assert aten.index_put.default not in _targets(gm)
    (cp,) = [n for n in gm.graph.nodes if n.target is aten.copy_.default]
    assert cp.args == (node.args[0], node)  # the epilogue TorchAir turns into the ref output
    cache = _run_both(write, gm)
    flat = cache.view(-1, D)
    assert torch.equal(flat[[11, 2, 7]], _inputs()[2])


def test_ge_cache_write_with_another_reader_stays_a_copy():
    gm = make_fx(write_and_read_old, tracing_mode="fake")(*_inputs())
    rep = cache_writes_to_scatter_nd(gm)
    assert rep.in_place == [] and len(rep.copied) == 1
    op = torch.ops.offload_ge.scatter_nd_update.default
    (node,) = [n for n in gm.graph.nodes if n.target is op]
    assert node.args[0].op != "placeholder"  # on the flattened view: GE keeps its TensorMove
    _run_both(write_and_read_old, gm)


def test_npugraph_ex_cache_write_runs_in_place_without_epilogue():
    gm = make_fx(write, tracing_mode="fake")(*_inputs())
    rep = cache_writes_in_place(gm)
    assert rep.in_place == ["cache_1"]
    targets = _targets(gm)
    assert aten.index_put_.default in targets and aten.index_put.default not in targets
    assert aten.copy_.default not in targets
    _run_both(write, gm)
    gm2 = make_fx(write_and_read_old, tracing_mode="fake")(*_inputs())
    rep2 = cache_writes_in_place(gm2)
    assert rep2.in_place == [] and len(rep2.left) == 1 and aten.copy_.default in _targets(gm2)


def test_scatter_nd_update_op_checks_its_index():
    with pytest.raises(ValueError, match=r"indices must be \[n, k\] with k <= 2, got \[2, 3\]"):
        torch.ops.offload_ge.scatter_nd_update(torch.zeros(3, 4), torch.zeros(2, 3, dtype=torch.int64),
                                               torch.zeros(2))


def invalidate(meta, new_rows):
    mask = aten.view.default(new_rows, [2, 1])
    w = aten.where.self(mask, aten.scalar_tensor.default(-1, dtype=torch.int32), meta)
    out = w.sum(dim=1)
    aten.copy_.default(meta, w)
    return out


def test_masked_metadata_update_is_made_in_place():
    meta = torch.arange(8, dtype=torch.int32).view(2, 4)
    rows = torch.tensor([True, False])
    gm = make_fx(invalidate, tracing_mode="fake")(meta.clone(), rows)
    assert inplace_masked_input_updates(gm) == 1
    targets = _targets(gm)
    assert aten.masked_fill_.Tensor in targets and aten.where.self not in targets
    assert aten.copy_.default not in targets  # the epilogue would copy the input onto itself
    m1, m2 = meta.clone(), meta.clone()
    assert torch.equal(gm(m2, rows), invalidate(m1, rows)) and torch.equal(m1, m2)
    assert m2.tolist() == [[-1, -1, -1, -1], [4, 5, 6, 7]]

"""Soundness of ``passes/reinplace.py`` on small graphs (docs/design.md §1): storage aliasing through any view,
copy_ epilogues, chains, ``auto_functionalized`` v1/v2, inputs as ``get_attr``.

Every case runs the functional graph AOT produces (``keep_inference_input_mutations=True``, as the
backend lowers) through the pass, then compares the result and the caller's buffers with eager; what the
pass did is counted in the graph before and after (``count_ops``), the report says why an op stayed.
"""
from __future__ import annotations

import operator

import pytest
import torch
from functorch.compile import aot_function, make_boxed_func
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from offload_passes.passes._fx import count_ops
from offload_passes.passes.reinplace import ReinplaceReport, reinplace

aten = torch.ops.aten
HOPS = {torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2}

# A mutable custom op that no Functionalize kernel covers, so AOT emits auto_functionalized(_v2).
_LIB = torch.library.Library("offload_reinplace_test", "FRAGMENT")
_LIB.define("scale_(Tensor(a!) x, float f) -> ()")
_LIB.define("scale_both_(Tensor(a!) x, Tensor(b!) y, float f) -> Tensor")


def _scale(x, f):
    x.mul_(f)


_LIB.impl("scale_", _scale, "CPU")


def _scale_both(x, y, f):
    x.mul_(f)
    y.mul_(f)
    return x.sum().reshape(1) + y.sum()


_LIB.impl("scale_both_", _scale_both, "CPU")
torch.library.register_fake("offload_reinplace_test::scale_", lambda x, f: None, lib=_LIB)
torch.library.register_fake("offload_reinplace_test::scale_both_", lambda x, y, f: x.new_empty(1), lib=_LIB)
ops = torch.ops.offload_reinplace_test


#: the functional forms the pass rewrites and their in-place ops (what a case counts)
COUNTED = (aten.index_copy.default, aten.index_copy_.default, aten.index_put.default, aten.index_put_.default,
           aten.copy.default, aten.copy_.default)
#: graph -> its counts before the pass
BEFORE: dict = {}


def _compile(fn):
    """``fn`` through AOT with our reinplace as the compiler; returns (compiled, reports, final graphs)."""
    reports: list[ReinplaceReport] = []
    graphs: list[fx.Graph] = []

    def compiler(gm: fx.GraphModule, _ex):
        BEFORE[gm.graph] = count_ops(gm.graph, COUNTED)
        reports.append(reinplace(gm.graph))
        gm.recompile()
        graphs.append(gm.graph)
        return make_boxed_func(gm.forward)

    return aot_function(fn, compiler, keep_inference_input_mutations=True), reports, graphs


def _targets(graph: fx.Graph) -> list:
    return [n.target for n in graph.nodes if n.op == "call_function"]


def _moved(graph: fx.Graph) -> dict:
    """Per counted op, how many calls the pass added (> 0) or removed (< 0); unchanged ones left out."""
    after = count_ops(graph, COUNTED)
    return {op: after[op] - BEFORE[graph][op] for op in COUNTED if after[op] != BEFORE[graph][op]}


def _check_against_eager(fn, *args):
    """Run ``fn`` eagerly and compiled on copies; results and mutated inputs must be identical."""
    eager_args = [a.clone() for a in args]
    comp_args = [a.clone() for a in args]
    want = fn(*eager_args)
    compiled, reports, graphs = _compile(fn)
    got = compiled(*comp_args)
    want, got = (list(x) if isinstance(x, (tuple, list)) else [x] for x in (want, got))
    assert len(want) == len(got)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    for w, g in zip(eager_args, comp_args):
        assert torch.equal(w, g)
    return reports[0], graphs[0]


# --- the issue-11 reproductions --------------------------------------------------------------

def _repro(buf, idx, src):
    head = buf[0:2]
    out = buf.index_copy(0, idx, src)  # out of place: buf is not mutated
    return head.sum() + out[2]


def test_out_of_place_index_copy_on_viewed_input_stays_functional_through_aot():
    buf, idx, src = torch.ones(4), torch.tensor([0, 1]), torch.tensor([2.5, 2.5])
    compiled, reports, graphs = _compile(_repro)
    assert compiled(buf, idx, src).item() == 3.0  # 6.0 when index_copy was turned into index_copy_
    assert torch.equal(buf, torch.ones(4))  # the caller's buffer is untouched
    (rep,) = reports
    assert rep.reinplaced == {}
    assert rep.kept_functional == [{
        "node": "index_copy", "op": "aten.index_copy.default",
        "reason": "no copy_ back into arg0_1: the graph does not mutate it, cannot re-inplace"}]
    assert aten.index_copy.default in _targets(graphs[0]) and aten.index_copy_.default not in _targets(graphs[0])


def test_out_of_place_index_copy_on_viewed_input_stays_functional_in_the_graph():
    """The pass on the traced graph itself (no AOT): running it must leave the input untouched."""
    buf, idx, src = torch.ones(4), torch.tensor([0, 1]), torch.tensor([2.5, 2.5])
    gm = make_fx(_repro, tracing_mode="fake")(buf, idx, src)
    rep = reinplace(gm.graph)
    gm.recompile()
    assert rep.reinplaced == {} and len(rep.kept_functional) == 1
    assert "no copy_ back" in rep.kept_functional[0]["reason"]
    assert gm(buf, idx, src).item() == 3.0
    assert torch.equal(buf, torch.ones(4))


# --- aliasing through any view -----------------------------------------------------------------

VIEWS = {
    "slice": lambda b: b[1:3],
    "select": lambda b: b.select(0, 1),
    "permute": lambda b: b.permute(1, 0),
    "as_strided": lambda b: b.as_strided((2, 2), (3, 1), 1),
}


def _check_traced(fn, *args):
    """``fn`` written in functional form + ``copy_`` epilogue (what AOT emits), traced as is with
    fake tensors; the pass's graph must give eager's result and leave the inputs as eager does."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    BEFORE[gm.graph] = count_ops(gm.graph, COUNTED)
    rep = reinplace(gm.graph)
    gm.recompile()
    eager_args = [a.clone() for a in args]
    want = fn(*eager_args)
    got = gm(*args)
    assert torch.equal(want, got)
    for w, g in zip(eager_args, args):
        assert torch.equal(w, g)
    return rep, gm.graph


@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("late_read", [True, False])
def test_old_value_read_through_a_view_after_the_write_blocks_reinplace(view, late_read):
    make_view = VIEWS[view]

    def fn(buf, idx, src):
        v = make_view(buf)
        early = v.sum() * 1
        new = aten.index_copy.default(buf, 0, idx, src)
        late = v.sum() * 10 if late_read else early  # reads the OLD buf after the out-of-place write
        aten.copy_.default(buf, new)  # the epilogue: new becomes buf's value
        return early + late

    buf = torch.arange(12.0).view(4, 3)
    rep, graph = _check_traced(fn, buf, torch.tensor([1, 2]), torch.full((2, 3), -5.0))
    if late_read:
        assert rep.reinplaced == {}
        (kept,) = rep.kept_functional
        assert kept["op"] == "aten.index_copy.default"
        assert f"(old value of buf_1) is read after index_copy by sum_2" in kept["reason"]
        assert aten.index_copy.default in _targets(graph)
    else:
        # index_copy -> index_copy_, its copy_ epilogue gone: no copy of the buffer left
        assert _moved(graph) == {aten.index_copy.default: -1, aten.index_copy_.default: 1, aten.copy_.default: -1}
        assert rep.kept_functional == [] and aten.copy_.default not in _targets(graph)


def test_a_write_whose_input_is_read_later_stays_out_of_place():
    """AOT's form of ``buf.copy_(buf.index_copy(...))`` with a view read in between: the functional
    ``copy`` is the writer of the epilogue (reinplaced), the ``index_copy`` stays out of place."""
    def fn(buf, idx, src):
        v = buf[1:3]
        new = buf.index_copy(0, idx, src)
        late = v.sum() * 10
        buf.copy_(new)
        return late

    rep, graph = _check_against_eager(fn, torch.arange(12.0).view(4, 3), torch.tensor([1, 2]),
                                      torch.full((2, 3), -5.0))
    # the functional copy becomes the epilogue's in-place write (one copy_ for two); index_copy stays
    assert _moved(graph) == {aten.copy.default: -1}
    assert rep.kept_functional == [{"node": "index_copy", "op": "aten.index_copy.default",
                                    "reason": "arg0_1 (old value of arg0_1) is read after index_copy by copy"}]


def test_only_the_writer_whose_value_is_written_back_is_reinplaced():
    def fn(buf, i, v):
        y = buf.index_put((i,), v * 2)  # out of place, its value is returned
        buf.index_put_((i,), v)  # in place: written back
        return y.sum(), buf.sum()

    rep, graph = _check_against_eager(fn, torch.ones(6), torch.tensor([1, 4]), torch.tensor([3.0, 4.0]))
    assert _moved(graph) == {aten.index_put.default: -1, aten.index_put_.default: 1, aten.copy_.default: -1}
    (kept,) = rep.kept_functional
    assert kept == {"node": "index_put", "op": "aten.index_put.default",
                    "reason": "arg0_1 (old value of arg0_1) is read after index_put by index_put_1"}


def test_chain_of_writers_ending_in_the_epilogue_is_reinplaced_whole():
    def fn(buf, i, j, v):
        buf.index_put_((i,), v)
        mid = buf.sum()  # the middle value, read before the next write
        buf.index_copy_(0, j, v + 1)
        return mid + buf.sum()

    rep, graph = _check_against_eager(fn, torch.zeros(5), torch.tensor([0, 1]), torch.tensor([3, 4]),
                                      torch.tensor([1.0, 2.0]))
    assert _moved(graph) == {aten.index_put.default: -1, aten.index_put_.default: 1, aten.index_copy.default: -1,
                             aten.index_copy_.default: 1, aten.copy_.default: -1}
    assert rep.kept_functional == [] and aten.copy_.default not in _targets(graph)


def test_new_value_returned_to_the_caller_stays_functional():
    def fn(buf, i, v):
        buf.index_put_((i,), v)
        return buf * 1, buf.index_put((i,), v + 1)  # the second write's value is an output

    rep, _ = _check_against_eager(fn, torch.ones(4), torch.tensor([1]), torch.tensor([3.0]))
    assert rep.reinplaced == {"aten.index_put_.default": 1}
    assert [k["node"] for k in rep.kept_functional] == ["index_put_1"]


def test_functional_update_then_writers_through_aot():
    def fn(buf, mask, i, v):
        buf.copy_(torch.where(mask, -1.0, buf))
        first = buf.sum()
        buf.index_put_((i,), v)
        return first + buf.sum()

    args = (torch.arange(6.0), torch.tensor([True, False, True, False, False, True]), torch.tensor([1, 2]),
            torch.tensor([7.0, 8.0]))
    rep, graph = _check_against_eager(fn, *args)
    # where(...) is written into buf early (one copy_ added), the functional copy and index_put go in place
    assert _moved(graph) == {aten.copy.default: -1, aten.index_put.default: -1, aten.index_put_.default: 1}
    assert rep.kept_functional == [] and rep.removed_copies == 1


@pytest.mark.parametrize("late_read", [False, True])
def test_chain_starting_from_a_functional_update_is_written_early(late_read):
    """The graph the offload rewrite's in-graph invalidation reaches AOT as (functionalization drops
    ``buf.copy_(where(...))``): the first writer mutates the intermediate ``where``. It is written
    into buf right away (the program's own copy, metadata-sized) so the writers run in place."""
    def fn(buf, mask, i, v):
        x = torch.where(mask, -1.0, buf)
        first = x.sum()  # a reader of the new value, before the writer
        late = buf.sum() * 10 if late_read else first  # the OLD buf, after x
        y = aten.index_put.default(x, [i], v)
        aten.copy_.default(buf, y)
        return first + late

    rep, graph = _check_traced(fn, torch.arange(6.0), torch.tensor([True, False, True, False, False, True]),
                               torch.tensor([1, 2]), torch.tensor([7.0, 8.0]))
    if late_read:
        assert rep.written_early == [] and rep.reinplaced == {}
        assert rep.kept_functional == [{"node": "index_put", "op": "aten.index_put.default", "reason":
                                        "mutated argument self (where) is an intermediate, not a graph input "
                                        "/ state buffer"}]
    else:
        assert rep.written_early == ["where -> buf_1"]
        assert rep.reinplaced == {"aten.index_put_.default": 1} and rep.kept_functional == []
        assert rep.removed_copies == 1
        assert [n.args[0].name for n in graph.nodes if n.target is aten.copy_.default] == ["buf_1"]


# --- auto_functionalized / auto_functionalized_v2 -------------------------------------------------

@pytest.mark.parametrize("v2", [True, False])
def test_auto_functionalized_on_a_slice_of_an_input_is_reinplaced(v2):
    import torch._inductor.config as inductor_config

    def fn(buf):
        ops.scale_(buf[1:3] if v2 else buf, 3.0)
        return buf.sum()

    # config.patch, not monkeypatch: pytest >= 9.2 monkeypatch reads a module's __dict__, where torch's
    # config entries do not live, and its undo then deletes (hides) the option for the rest of the session.
    with inductor_config.patch(enable_auto_functionalized_v2=v2):
        rep, graph = _check_against_eager(fn, torch.arange(4.0))
    assert rep.reinplaced == {"offload_reinplace_test.scale_.default": 1} and rep.kept_functional == []
    assert not HOPS & set(_targets(graph))
    assert aten.copy_.default not in _targets(graph) and aten.clone.default not in _targets(graph)
    if v2:
        assert aten.slice.Tensor in _targets(graph)  # the view is regenerated on the input itself


def test_auto_functionalized_two_mutated_inputs_and_an_output():
    def fn(a, b):
        out = ops.scale_both_(a, b, 2.0)
        return out + 1

    rep, graph = _check_against_eager(fn, torch.arange(3.0), torch.ones(2))
    assert rep.reinplaced == {"offload_reinplace_test.scale_both_.default": 1} and rep.removed_copies == 2
    assert not HOPS & set(_targets(graph))


def test_auto_functionalized_on_an_intermediate_stays_functional():
    def fn(buf):
        t = buf * 2
        ops.scale_(t, 3.0)
        return t + buf

    rep, graph = _check_against_eager(fn, torch.arange(4.0))
    (kept,) = rep.kept_functional
    assert kept["op"] == "offload_reinplace_test.scale_.default"
    assert "is an intermediate, not a graph input / state buffer" in kept["reason"]
    assert HOPS & set(_targets(graph))


@pytest.mark.parametrize("late_read", [True, False])
def test_auto_functionalized_with_old_value_read_later_stays_functional(late_read):
    """AOT's form written out: the HOP's new value is the epilogue's source; a read of the input's old
    value between them must keep the clone."""
    def fn(buf):
        _, new = torch.ops.higher_order.auto_functionalized(ops.scale_.default, x=buf, f=3.0)
        late = buf.sum() * 10 if late_read else new.sum()
        aten.copy_.default(buf, new)
        return late

    rep, graph = _check_traced(fn, torch.arange(4.0))
    if late_read:
        assert rep.reinplaced == {}
        assert rep.kept_functional == [{"node": "auto_functionalized", "op": "offload_reinplace_test.scale_.default",
                                        "reason": "buf_1 (old value of buf_1) is read after auto_functionalized "
                                                  "by sum_1"}]
        assert torch.ops.higher_order.auto_functionalized in _targets(graph)
    else:
        assert rep.reinplaced == {"offload_reinplace_test.scale_.default": 1} and rep.removed_copies == 1
        assert not HOPS & set(_targets(graph))


# --- inputs as get_attr (inline_inbuilt_nn_modules=False keeps buffers as attributes) ----------

def _attr_graph(late_read: bool, with_meta: bool) -> fx.GraphModule:
    """``buf`` a module buffer: new = index_put(view(buf)); [late: sum(buf)]; copy_(buf, view(new))."""
    root = torch.nn.Module()
    root.register_buffer("buf", torch.zeros(2, 3))
    g = fx.Graph()
    buf = g.get_attr("buf")
    i, v = g.placeholder("i"), g.placeholder("v")
    flat = g.call_function(aten.view.default, (buf, [-1]))
    early = g.call_function(aten.sum.default, (flat,))
    new = g.call_function(aten.index_put.default, (flat, [i], v))
    back = g.call_function(aten.view.default, (new, [2, 3]))
    reads = [g.call_function(aten.sum.default, (buf,))] if late_read else []
    g.call_function(aten.copy_.default, (buf, back))
    out = g.call_function(aten.add.Tensor, (early, g.call_function(aten.sum.default, (back,))))
    g.output((out, *reads))
    gm = fx.GraphModule(root, g)
    if with_meta:
        # get_attr values stay the real buffer; views get fake values (their classes meet through
        # the views' schemas)
        FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(torch.tensor([1, 5]), torch.tensor([7.0, 8.0]))
    return gm


@pytest.mark.parametrize("late_read", [False, True])
def test_get_attr_buffers_are_reinplaced_like_inputs(late_read):
    gm = _attr_graph(late_read, with_meta=True)
    rep = reinplace(gm.graph)
    gm.recompile()
    before = torch.zeros(6)
    want = before.index_put((torch.tensor([1, 5]),), torch.tensor([7.0, 8.0]))
    out = gm(torch.tensor([1, 5]), torch.tensor([7.0, 8.0]))
    assert torch.equal(gm.buf.view(-1), want) and out[0].item() == 15.0
    if late_read:
        assert rep.reinplaced == {} and "read after" in rep.kept_functional[0]["reason"]
        assert out[1].item() == 0.0  # the old value
    else:
        assert rep.reinplaced == {"aten.index_put_.default": 1} and rep.removed_copies == 1
        assert aten.copy_.default not in _targets(gm.graph)


def test_get_attr_without_example_values_uses_the_attribute_and_view_schemas():
    """No ``meta["val"]`` at all: storage of the attribute itself, views from their alias annotations;
    the layout of the copy back cannot be proven, so the write stays functional (never guessed)."""
    gm = _attr_graph(late_read=True, with_meta=False)
    rep = reinplace(gm.graph)
    assert rep.reinplaced == {}
    assert "read after" in rep.kept_functional[0]["reason"]
    gm2 = _attr_graph(late_read=False, with_meta=False)
    rep2 = reinplace(gm2.graph)
    assert rep2.reinplaced == {} and "does not preserve the layout" in rep2.kept_functional[0]["reason"]


def test_schema_declared_views_alias_without_example_values():
    """``getitem`` of a multi-output view (split) and plain views are members of the input's class."""
    root = torch.nn.Module()
    root.register_buffer("buf", torch.zeros(4))
    g = fx.Graph()
    buf = g.get_attr("buf")
    parts = g.call_function(aten.split.Tensor, (buf, 2))
    first = g.call_function(operator.getitem, (parts, 0))
    new = g.call_function(aten.copy.default, (buf, g.call_function(aten.ones_like.default, (buf,))))
    late = g.call_function(aten.sum.default, (first,))
    g.call_function(aten.copy_.default, (buf, new))
    g.output((late,))
    gm = fx.GraphModule(root, g)
    rep = reinplace(gm.graph)
    assert rep.reinplaced == {}
    assert rep.kept_functional[0]["reason"] == "getitem (old value of buf) is read after copy_default by sum_default"

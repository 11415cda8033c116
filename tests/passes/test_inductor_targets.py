"""passes/inductor_targets.py: in-place custom ops retargeted to aliases every Inductor version runs.

torch 2.8's Inductor refuses a mutable custom op that has a Functionalize kernel ("NYI: Can't generate
FallbackKernel for custom.dsa_serve.default"); the alias has the same schema and kernels, no
Functionalize kernel, and so is auto-functionalizable on every version.
"""
from __future__ import annotations

import pytest
import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import can_auto_functionalize

from offload_passes import _compat
from offload_passes.passes._fx import count_ops
from offload_passes.passes.inductor_targets import (NAMESPACE, define_aliases, inductor_alias, needs_alias,
                                                    retarget_for_inductor)

custom = torch.ops.custom
INPLACE = [custom.dsa_serve.default, custom.dsa_install.default, custom.npu_gather_selection_kv_cache.default]


def test_which_ops_need_an_alias():
    for op in INPLACE:
        assert needs_alias(op) and not can_auto_functionalize(op)
    for op in (custom.dsa_plan.default, custom.dsa_serve_functional.default, torch.ops.aten.copy_.default,
               torch.ops.aten.index_put_.default, "not an op"):
        assert not needs_alias(op)


@pytest.mark.parametrize("op", INPLACE, ids=lambda o: str(o))
def test_alias_has_the_same_schema_and_no_functionalize_kernel(op):
    alias = inductor_alias(op)
    assert inductor_alias(op) is alias  # defined once
    assert alias.namespace == NAMESPACE and not needs_alias(alias)
    assert str(alias._schema) == str(op._schema).replace(f"{op.namespace}::", f"{NAMESPACE}::", 1)
    assert not _compat.dispatcher_has_kernel(alias.name(), "Functionalize")
    assert can_auto_functionalize(alias)


def _serve_case(B=2, S=1, K=64, sbs=16, PS=32, F=40, Dkv=8, Dr=4):
    g = torch.Generator().manual_seed(0)
    rows = B * S * K
    kind = torch.tensor([1, 2, 3, 0, 4, 5], dtype=torch.int32)[torch.randint(0, 6, (rows,), generator=g)]
    val = torch.where(kind == 1, torch.randint(0, PS, (rows,), generator=g),
                      torch.randint(0, F, (rows,), generator=g)).to(torch.int32)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    args = (torch.stack([kind, val], 1).contiguous(), r(B, F, Dkv), r(B, F, Dr), r(B, PS, Dkv), r(B, PS, Dr),
            torch.zeros(rows // sbs, sbs, Dkv, dtype=torch.bfloat16), torch.zeros(rows // sbs, sbs, Dr, dtype=torch.bfloat16))
    return args, dict(raw_seq=S, topk=K, selection_block_size=sbs, compact_layout=1)


def test_alias_runs_the_op_eagerly_and_under_inductor():
    args, kw = _serve_case()
    want = [a.clone() for a in args]
    custom.dsa_serve.default(*want, **kw)
    assert want[5].abs().sum() > 0  # the case really writes the selection buffers
    alias = inductor_alias(custom.dsa_serve.default)
    got = [a.clone() for a in args]
    alias(*got, **kw)
    assert torch.equal(got[5], want[5]) and torch.equal(got[6], want[6])

    def serve(*a):
        alias(*a, **kw)
        return a[5].sum()

    torch._dynamo.reset()
    got = [a.clone() for a in args]
    with torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(serve, backend="inductor", fullgraph=True)(*got)  # the path 2.8 refuses for the original op
    assert torch.equal(got[5], want[5]) and torch.equal(got[6], want[6])


def test_retarget_keeps_arguments_and_meta():
    g = fx.Graph()
    a = [g.placeholder(f"a{i}") for i in range(7)]
    n = g.call_function(custom.dsa_serve.default, tuple(a), {"raw_seq": 1})
    n.meta["val"] = None
    c = g.call_function(torch.ops.aten.copy_.default, (a[5], a[6]))
    g.output((c,))
    counted = (custom.dsa_serve.default, inductor_alias(custom.dsa_serve.default), torch.ops.aten.copy_.default)
    before = count_ops(g, counted)
    rep = retarget_for_inductor(g)
    assert (before, count_ops(g, counted)) == ({counted[0]: 1, counted[1]: 0, counted[2]: 1},
                                               {counted[0]: 0, counted[1]: 1, counted[2]: 1})
    assert rep.retargeted == {"custom.dsa_serve.default": 1}  # the report names what moved
    assert n.target is inductor_alias(custom.dsa_serve.default) and n.args == tuple(a) and n.kwargs == {"raw_seq": 1}
    assert "val" in n.meta and c.target is torch.ops.aten.copy_.default
    assert retarget_for_inductor(g).retargeted == {}  # idempotent
    assert define_aliases(INPLACE + [torch.ops.aten.copy_.default]) == [inductor_alias(op) for op in INPLACE]


def test_same_name_from_another_namespace_is_refused():
    # a test-only op that shares dsa_serve's name in another namespace (test double of e.g. an npu:: twin)
    lib = torch.library.Library("offload_test_alias", "FRAGMENT")
    lib.define("dsa_serve(Tensor(a!) x) -> ()")
    inductor_alias(custom.dsa_serve.default)
    with pytest.raises(RuntimeError, match=r"offload_inductor::dsa_serve already stands for custom.dsa_serve.default; "
                                           r"cannot alias offload_test_alias.dsa_serve.default too"):
        inductor_alias(torch.ops.offload_test_alias.dsa_serve.default)


def test_guards_are_kept_exactly_where_inductor_would_drop_them():
    """torch 2.8's Inductor decomposes ``aten._assert_async.msg`` to nothing; there (only) the guards are
    retargeted to ``offload_inductor::assert_async_``, which checks exactly as aten does."""
    from offload_passes.passes.inductor_targets import ASSERT_ASYNC

    g = fx.Graph()
    x = g.placeholder("x")
    ok = g.call_function(torch.ops.aten.all.default, (x,))
    guard = g.call_function(torch.ops.aten._assert_async.msg, (ok, "offload guard: test"))
    g.output((x,))
    rep = retarget_for_inductor(g)
    if _compat.inductor_lowers_assert_async():  # 2.13: the guard stays aten's
        assert rep.retargeted == {} and guard.target is torch.ops.aten._assert_async.msg
    else:
        assert rep.retargeted == {"aten._assert_async.msg": 1} and guard.target is ASSERT_ASYNC
        assert guard.args == (ok, "offload guard: test")
        assert torch.ops.aten._assert_async.msg not in _compat.inductor_decompositions_keeping_asserts()
    assert ASSERT_ASYNC._schema.is_mutable and str(ASSERT_ASYNC._schema.returns) == "[]"
    ASSERT_ASYNC(torch.tensor(True), "offload guard: test")  # no error
    with pytest.raises(RuntimeError, match="offload guard: test"):
        ASSERT_ASYNC(torch.tensor(False), "offload guard: test")

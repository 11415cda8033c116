"""Reinplace registrations in npugraph_ex's and TorchAir-ACL's ``inplaceable_npu_ops``.

Graph-level tests run the packages' real passes on functionalized ``make_fx`` graphs (our Functionalize
kernels produce ``*_functional`` + ``copy_`` epilogues, as AOT does); the result is executed and compared
with eager. One test compiles through the whole npugraph_ex backend with ``force_eager=True``.
"""
from __future__ import annotations

import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from offload_passes import _compat
from offload_passes.passes.npu_install_chains import split_install_chains

pytestmark = pytest.mark.usefixtures("reinplace_registered")

B, S, K, BS, F, PS, D, DR, IR = 2, 1, 64, 16, 128, 32, 32, 8, 256
REGISTRIES = ("npugraph_ex._acl_concrete_graph.graph_pass", "torchair._acl_concrete_graph.graph_pass")
c = torch.ops.custom


def _gp(name):
    import importlib

    return importlib.import_module(name)


def _functional_graph(fn, args):
    return make_fx(torch.func.functionalize(fn, remove="mutations"), tracing_mode="fake")(*args)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _copies(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]


def _clone(args):
    return [a.clone() for a in args]


def _assert_same(got, want):
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def _plan_inputs():
    topk = torch.stack([torch.randperm(100)[:K] for _ in range(B * S)]).to(torch.int32).reshape(B, S, 1, K)
    topk[:, :, :, K - 5:] = -1
    L = torch.full((B,), 101, dtype=torch.int32)
    pool_ids = torch.full((B, PS), -1, dtype=torch.int32)
    id_to_slot = torch.full((B, IR), -1, dtype=torch.int32)
    lru = torch.zeros((B, PS // 16), dtype=torch.int32)
    return topk, L, pool_ids, id_to_slot, lru


def _layer():
    h = torch.float16
    nb = B * S * K // BS
    return [torch.randn(B, F, D).to(h), torch.randn(B, F, DR).to(h), torch.randn(B, PS, D).to(h),
            torch.randn(B, PS, DR).to(h), torch.zeros(nb, BS, D, dtype=h), torch.zeros(nb, BS, DR, dtype=h)]


def _sbt():
    nb = B * S * K // BS
    return torch.arange(nb, dtype=torch.int32).reshape(B * S, K // BS)


# ------------------------------------------------------------------------------------------ registry


@pytest.mark.parametrize("module", REGISTRIES)
def test_both_registries_hold_our_pairs(module):
    from offload_passes.converters.npu_reinplace_registry import registered

    gp = _gp(module)
    assert registered(gp) == {
        "custom::dsa_serve_functional": [5, 6],
        "custom::dsa_install_functional": [4, 5, 6, 7, 8],
        "custom::npu_gather_selection_kv_cache_functional": [0, 1, 2, 3],
    }
    entry = gp.inplaceable_npu_ops[c.dsa_serve_functional.default]
    assert entry.inplace_op is c.dsa_serve.default


def test_registration_is_idempotent(reinplace_registered):
    from offload_passes import converters

    gp = _gp(REGISTRIES[0])
    before = dict(gp.inplaceable_npu_ops)
    again = converters.register_npugraph_ex()
    assert again == reinplace_registered
    assert set(gp.inplaceable_npu_ops) == set(before)


# -------------------------------------------------------------------------------------- serve paths


def serve_on_inputs(plan, fkv, fr, pkv, pr, skv, sr):
    c.dsa_serve(plan, fkv, fr, pkv, pr, skv, sr, raw_seq=S, topk=K, selection_block_size=BS)
    return skv.float().sum(dim=(1, 2)) + sr.float().sum(dim=(1, 2))


def serve_on_intermediates(plan, fkv, fr, pkv, pr, skv, sr):
    skv2, sr2 = skv * 2, sr * 2  # intermediates: reinplacing them is what TorchAir gets wrong
    c.dsa_serve(plan, fkv, fr, pkv, pr, skv2, sr2, raw_seq=S, topk=K, selection_block_size=BS)
    return skv2.float().sum(dim=(1, 2)) + sr2.float().sum(dim=(1, 2)) + skv.float().sum()


def _serve_args():
    topk, L, pool_ids, id_to_slot, lru = _plan_inputs()
    plan, _, _ = c.dsa_plan(topk, L, pool_ids, id_to_slot, lru, raw_seq=S)
    return [plan, *_layer()]


@pytest.mark.parametrize("module", REGISTRIES)
def test_serve_on_graph_inputs_is_reinplaced(module):
    args = _serve_args()
    gm = _functional_graph(serve_on_inputs, args)
    assert c.dsa_serve_functional.default in _targets(gm) and len(_copies(gm)) == 2
    _gp(module)._reinplace_input_mutated_ops(gm)
    gm.recompile()
    assert c.dsa_serve.default in _targets(gm)
    assert c.dsa_serve_functional.default not in _targets(gm) and not _copies(gm)
    want_args = _clone(args)
    want = serve_on_inputs(*want_args)
    got_args = _clone(args)
    got = gm(*got_args)
    _assert_same([got[0] if isinstance(got, (list, tuple)) else got], [want])
    _assert_same(got_args, want_args)


@pytest.mark.parametrize("module", REGISTRIES)
def test_serve_on_intermediates_stays_functional(module):
    args = _serve_args()
    gm = _functional_graph(serve_on_intermediates, args)
    gp = _gp(module)
    fake = [torch.empty_like(a) for a in args]
    gm = gp._reinplace_inplaceable_ops_pass(gm, False, *fake) or gm
    gp._reinplace_input_mutated_ops(gm)
    gm.recompile()
    assert c.dsa_serve_functional.default in _targets(gm) and c.dsa_serve.default not in _targets(gm)
    # the serve's outputs are still read through getitem, not through its first mutated argument
    (node,) = [n for n in gm.graph.nodes if n.target is c.dsa_serve_functional.default]
    assert all(u.target is operator.getitem for u in node.users)
    want = serve_on_intermediates(*_clone(args))
    got = gm(*_clone(args))
    _assert_same([got[0] if isinstance(got, (list, tuple)) else got], [want])


def test_extra_check_refuses_aliasing_and_intermediate_arguments():
    """The check itself: graph inputs only, each mutated argument distinct."""
    from torch import fx

    gp = _gp(REGISTRIES[0])
    check = gp.inplaceable_npu_ops[c.dsa_serve_functional.default].extra_check
    g = fx.Graph()
    ph = [g.placeholder(f"a{i}") for i in range(7)]
    twice = g.call_function(c.dsa_serve_functional.default, (*ph[:5], ph[5], ph[5]))
    inter = g.call_function(torch.ops.aten.clone.default, (ph[6],))
    mixed = g.call_function(c.dsa_serve_functional.default, (*ph[:5], ph[5], inter))
    ok = g.call_function(c.dsa_serve_functional.default, tuple(ph))
    for n in g.nodes:
        n.meta["stream_label"] = None
    assert check(twice) is False
    assert check(mixed) is False
    assert check(ok) is True


def test_aliasing_mutated_arguments_are_not_reinplaced():
    D2 = DR
    h = torch.float16
    plan = _serve_args()[0]
    nb = B * S * K // BS
    args = [plan, torch.randn(B, F, D2).to(h), torch.randn(B, F, D2).to(h), torch.randn(B, PS, D2).to(h),
            torch.randn(B, PS, D2).to(h), torch.zeros(nb, BS, D2, dtype=h)]

    def serve_same_buffer(plan, fkv, fr, pkv, pr, sel):
        c.dsa_serve(plan, fkv, fr, pkv, pr, sel, sel, raw_seq=S, topk=K, selection_block_size=BS)
        return sel.float().sum()

    gm = _functional_graph(serve_same_buffer, args)
    reference = _functional_graph(serve_same_buffer, args)
    _gp(REGISTRIES[0])._reinplace_input_mutated_ops(gm)
    gm.recompile()
    assert c.dsa_serve.default not in _targets(gm)
    got_args, want_args = _clone(args), _clone(args)
    _assert_same([gm(*got_args)], [reference(*want_args)])
    _assert_same(got_args, want_args)


# ------------------------------------------------------------------------------------ gather (1 out)


def gather_on_inputs(sel_rope, sel_kv, sbt, status, topk, full_rope, full_kv, fbt, L, cu_q):
    act = c.npu_gather_selection_kv_cache(sel_rope, sel_kv, sbt, status, topk, full_rope, full_kv, fbt, L, cu_q,
                                          selection_topk_block_size=1)
    return act * 2, sel_kv.float().sum()


def _gather_args():
    h = torch.float16
    blk = 16
    full_blocks = B * (F // blk)
    topk = torch.stack([torch.randperm(100)[:K] for _ in range(B * S)]).to(torch.int32).reshape(B, S, 1, K)
    nb = B * S * K // blk
    return [torch.zeros(nb, blk, DR, dtype=h), torch.zeros(nb, blk, D, dtype=h),
            torch.arange(nb, dtype=torch.int32).reshape(B * S, K // blk),
            torch.full((B, S, 1, K + 1), -1, dtype=torch.int32), topk,
            torch.randn(full_blocks, blk, DR).to(h), torch.randn(full_blocks, blk, D).to(h),
            torch.arange(full_blocks, dtype=torch.int32).reshape(B, F // blk),
            torch.full((B,), 101, dtype=torch.int32), torch.arange(1, B + 1, dtype=torch.int32) * S]


@pytest.mark.parametrize("module", REGISTRIES)
def test_gather_on_graph_inputs_is_reinplaced_and_returns_its_length(module):
    args = _gather_args()
    gm = _functional_graph(gather_on_inputs, args)
    _gp(module)._reinplace_input_mutated_ops(gm)
    gm.recompile()
    (node,) = [n for n in gm.graph.nodes if n.target is c.npu_gather_selection_kv_cache.default]
    assert not _copies(gm)
    assert not any(u.target is operator.getitem for u in node.users)  # the in-place op returns the tensor
    got_args, want_args = _clone(args), _clone(args)
    got, want = gm(*got_args), gather_on_inputs(*want_args)
    _assert_same(got, want)
    _assert_same(got_args, want_args)


# ---------------------------------------------------------------------------------- install chains


def group_step(topk, L, pool_ids, id_to_slot, lru, sbt, *layers):
    a, b = layers[:6], layers[6:]
    plan, rec, act = c.dsa_plan(topk, L, pool_ids, id_to_slot, lru, raw_seq=S)
    out = act.float().sum()
    for fkv, fr, pkv, pr, skv, sr in (a, b):
        c.dsa_serve(plan, fkv, fr, pkv, pr, skv, sr, raw_seq=S, topk=K, selection_block_size=BS)
        out = out + skv.float().sum()
    for (fkv, fr, pkv, pr, skv, sr), mu in ((b, 0), (a, 1)):
        c.dsa_install(rec, skv, sr, sbt, pkv, pr, pool_ids, id_to_slot, lru, raw_seq=S, topk=K,
                      selection_block_size=BS, metadata_update=mu)
    return out


def _group_args():
    return [*_plan_inputs(), _sbt(), *_layer(), *_layer()]


def _run_group(gm, args, steps=3):
    """Several decode steps on the same state; returns outputs and final state."""
    outs = []
    for step in range(steps):
        args[1].add_(1)  # one more token each step
        outs.append(gm(*args))
    return outs


@pytest.mark.parametrize("module", REGISTRIES)
def test_install_chain_is_reinplaced_after_splitting(module):
    args = _group_args()
    gm = _functional_graph(group_step, args)
    assert split_install_chains(gm) == 1
    _gp(module)._reinplace_input_mutated_ops(gm)
    gm.recompile()
    t = _targets(gm)
    assert t.count(c.dsa_install.default) == 2 and t.count(c.dsa_serve.default) == 2
    assert c.dsa_install_functional.default not in t and not _copies(gm)
    got_args, want_args = _clone(args), _clone(args)
    got = _run_group(gm, got_args)
    want = _run_group(group_step, want_args)
    _assert_same([g if not isinstance(g, (list, tuple)) else g[0] for g in got], want)
    _assert_same(got_args, want_args)
    assert int((got_args[2] >= 0).sum()) > 0  # the pools really filled


def test_install_chain_without_splitting_keeps_copies():
    """Documents why split_install_chains exists: the registry alone cannot reinplace a chain."""
    gm = _functional_graph(group_step, _group_args())
    _gp(REGISTRIES[0])._reinplace_input_mutated_ops(gm)
    gm.recompile()
    assert _targets(gm).count(c.dsa_install_functional.default) == 2
    assert len(_copies(gm)) == 7  # pools of both layers + 3 metadata tensors copied every step


def test_split_leaves_chains_alone_when_metadata_is_read_elsewhere():
    def reads_metadata_late(topk, L, pool_ids, id_to_slot, lru, sbt, *layers):
        out = group_step(topk, L, pool_ids, id_to_slot, lru, sbt, *layers)
        return out, pool_ids.sum()

    gm = _functional_graph(reads_metadata_late, _group_args())
    # after functionalization the late read sees install A's output, not the graph input: still splittable
    assert split_install_chains(gm) == 1

    def reads_input_between(topk, L, pool_ids, id_to_slot, lru, sbt, *layers):
        a, b = layers[:6], layers[6:]
        plan, rec, _ = c.dsa_plan(topk, L, pool_ids, id_to_slot, lru, raw_seq=S)
        c.dsa_install(rec, b[4], b[5], sbt, b[2], b[3], pool_ids, id_to_slot, lru, raw_seq=S, topk=K,
                      selection_block_size=BS, metadata_update=0)
        snapshot = id_to_slot.clone()
        c.dsa_install(rec, a[4], a[5], sbt, a[2], a[3], pool_ids, id_to_slot, lru, raw_seq=S, topk=K,
                      selection_block_size=BS, metadata_update=1)
        return snapshot

    gm2 = _functional_graph(reads_input_between, _group_args())
    # the clone reads install B's metadata output (not the input), which is not an install: refused
    assert split_install_chains(gm2) == 0


# ------------------------------------------------------------------------------ npugraph_ex compile


def test_npugraph_ex_compile_reinplaces_and_matches_eager(npugraph_ex_pkg, stub_torch_npu):
    gp = _gp(REGISTRIES[0])
    seen = {}
    original = gp._reinplace_input_mutated_ops

    def spy(gm):
        out = original(gm)
        gm.recompile()
        seen["after"] = list(_targets(gm))
        seen["copies"] = len(_copies(gm))
        return out

    cfg = npugraph_ex_pkg.CompilerConfig()
    cfg.mode = "npugraph_ex"
    _compat.set_npugraph_ex_option(cfg, "force_eager", True)
    _compat.set_npugraph_ex_option(cfg, "pattern_fusion_pass", False)  # traces torch.ops.npu kernels, absent on CPU
    cfg.post_grad_custom_post_pass = lambda gm, example_inputs, config: split_install_chains(gm)
    gp._reinplace_input_mutated_ops = spy
    try:
        torch._dynamo.reset()
        compiled = torch.compile(group_step, backend=npugraph_ex_pkg.get_npu_backend(compiler_config=cfg),
                                 fullgraph=True, dynamic=False)
        args = _group_args()
        got_args, want_args = _clone(args), _clone(args)
        got = _run_group(compiled, got_args)
    finally:
        gp._reinplace_input_mutated_ops = original
    want = _run_group(group_step, want_args)
    _assert_same(got, want)
    _assert_same(got_args, want_args)
    assert seen["after"].count(c.dsa_install.default) == 2 and seen["after"].count(c.dsa_serve.default) == 2
    assert c.dsa_install_functional.default not in seen["after"]
    assert c.dsa_serve_functional.default not in seen["after"] and seen["copies"] == 0


def _side_stream(gm, events: bool):
    """Put each install on a side stream as npu_modes does, with or without the event fence."""
    import npugraph_ex.ops._tagged_event  # noqa: F401
    import npugraph_ex.scope  # noqa: F401

    ops = _compat.npugraph_ex_ops()
    g = gm.graph
    installs = [n for n in g.nodes if n.target is c.dsa_install_functional.default]
    output = next(n for n in g.nodes if n.op == "output")
    for i, inst in enumerate(installs):
        last = max((u for u in inst.users), key=lambda u: list(g.nodes).index(u))
        with g.inserting_before(inst):
            if events:
                g.call_function(ops.tagged_event_record.default, (f"t{i}_ready",))
            g.call_function(ops.scope_enter.default, (["_user_stream_label"], ["side"]))
            if events:
                g.call_function(ops.tagged_event_wait.default, (f"t{i}_ready",))
        with g.inserting_after(last):
            ex = g.call_function(ops.scope_exit.default, ())
        if events:
            with g.inserting_before(ex):
                g.call_function(ops.tagged_event_record.default, (f"t{i}_done",))
            with g.inserting_before(output):
                g.call_function(ops.tagged_event_wait.default, (f"t{i}_done",))
    gm.recompile()


@pytest.mark.parametrize("events", [True, False])
def test_side_stream_installs_are_reinplaced_only_when_fenced_by_events(npugraph_ex_pkg, stub_torch_npu, events):
    gm = _functional_graph(group_step, _group_args())
    split_install_chains(gm)
    _side_stream(gm, events)
    _gp(REGISTRIES[0])._reinplace_input_mutated_ops(gm)
    gm.recompile()
    t = _targets(gm)
    if events:
        assert t.count(c.dsa_install.default) == 2 and t.count(c.dsa_serve.default) == 2
        assert not [x for x in t if "_functional" in str(x)]
    else:
        # unfenced cross-stream users: the pools (read by the serves on the main stream) and the
        # selection buffers (read by the installs on the side stream) are not written in place
        assert t.count(c.dsa_install_functional.default) == 2 and c.dsa_install.default not in t
        assert t.count(c.dsa_serve_functional.default) == 2 and c.dsa_serve.default not in t

"""Never silently wrong at run time (docs/design.md §1): guards for compile-time assumptions, automatic new-request
detection, state chosen by the caches (two models / two cache sets / graph breaks), memory freed with the
model, one stale-state rule for every mode.

Each test first reproduces the failure the issue reported (in its comment) and asserts the fixed
behaviour. The rewrite is bit-exact on these models (SFA references accumulate in fp64), so outputs
are compared with ``== 0``.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import dsa_synth as synth
from backend_helpers import check_pool_invariants, check_pool_state, full_row
from offload_passes import make_offload_backend, offload
from offload_passes.state import REGISTRY, GroupLayout, OffloadState, StateBinder, StateRegistry, module_state

PS = 64


def _step_pair(base, m, c, L, s):
    with torch.no_grad():
        h0, a0 = base(*base.inputs(L, s))
        h1, a1 = c(*m.inputs(L, s))
    return (h0 - h1).abs().max().item(), (a0 - a1).abs().max().item()


# -- run-time guards ------------------------------------------------------------------------------
def test_permuted_block_table_raises_instead_of_wrong_step():
    # reproduced before the fix: no recompile, no warning, attention off by ~1 from the next step on
    cfg = synth.SynthConfig(pattern="FS", S=1, router=False)
    base, m = synth.make_pair(cfg, [300, 280])
    be = make_offload_backend(pool_size=PS)
    c = torch.compile(m, backend=be)
    L = torch.tensor([300, 280])
    for s in range(3):
        L = L + 1
        assert _step_pair(base, m, c, L, s) == (0.0, 0.0)
    assert be.reports[-1]["guards"], "the rewritten graph carries run-time guards"
    st = be.state
    before = [g.pool_ids.clone() for g in st.groups]
    with torch.no_grad():
        m.block_table[0] = m.block_table[0].flip(0)  # in place: Dynamo sees the same tensor
        with pytest.raises(RuntimeError, match=r"offload guard: block table 'l_self_buffers_block_table_' is no "
                                               r"longer the identity layout"):
            c(*m.inputs(L + 1, 3))
    # nothing of the offload state was touched by the refused step
    assert all(torch.equal(g.pool_ids, b) for g, b in zip(st.groups, before))
    with torch.no_grad():
        m.block_table[0] = m.block_table[0].flip(0)  # restored: the graph runs again, still exact
    assert _step_pair(base, m, c, L + 1, 4) == (0.0, 0.0)


def test_selection_table_and_lengths_guards():
    cfg = synth.SynthConfig(pattern="FS", S=1, router=False)
    base, m = synth.make_pair(cfg, [300, 280])
    c = torch.compile(m, backend=make_offload_backend(pool_size=PS))
    L = torch.tensor([301, 281])
    assert _step_pair(base, m, c, L, 0) == (0.0, 0.0)
    F = cfg.maxblk * cfg.BS
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=rf"offload guard: cache lengths 'l_l_' .* must be in \[0, {F}\]"):
            c(*m.inputs(torch.tensor([F + 1, 281]), 1))
        m.sel_table_1[0, 0], m.sel_table_1[0, 1] = 1, 0
        with pytest.raises(RuntimeError, match=r"offload guard: selection block table 'l_self_buffers_sel_table_1_'"):
            c(*m.inputs(L + 1, 1))


def test_guard_raises_in_inductor_mode():
    cfg = synth.SynthConfig(pattern="F", S=1, router=False)
    _, m = synth.make_pair(cfg, [300, 280])
    c = torch.compile(m, backend=make_offload_backend(pool_size=PS, exe_mode="inductor"))
    with torch.no_grad():
        c(*m.inputs(torch.tensor([301, 281]), 0))
        m.block_table[1] = m.block_table[1].flip(0)
        with pytest.raises(RuntimeError, match="offload guard: block table"):
            c(*m.inputs(torch.tensor([302, 282]), 1))


def test_tiny_permuted_block_table_raises():
    """The issue's reproduction on the real GLM-5.2 ``tiny`` preset."""
    from offload_passes import models

    comp = models.build("tiny", enable_offload=True, decode_steps=4)
    step = torch.compile(comp.model, backend=make_offload_backend(pool_size=PS))
    comp.driver.prefill()
    comp.driver.step(step)
    with torch.no_grad():
        comp.model.block_table[1] = comp.model.block_table[1].flip(0)
    with pytest.raises(RuntimeError, match=r"offload guard: block table '.*block_table.*' is no longer the identity"):
        comp.driver.step(step)


# -- automatic new-request detection --------------------------------------------------------------
def test_model_ledger_reset_and_refill_invalidates_every_row():
    """Row 0 starts a new request of the same length (the model re-fills its caches and resets its own
    ledger). The caches' version counters moved, and a counter cannot tell which rows were written, so
    every row is invalidated (docs/new-requests.md: no announcement keeps other rows warm): both rows
    then hold only what the next step installed, and no row is ever served stale."""
    cfg = synth.SynthConfig(pattern="FSS", S=1)
    base, m = synth.make_pair(cfg, [300, 280])
    c = torch.compile(m, backend=make_offload_backend(pool_size=512))  # large: nothing is evicted
    L = torch.tensor([300, 280])
    for s in range(6):
        L = L + 1
        assert _step_pair(base, m, c, L, s) == (0.0, 0.0)
    st = _state_of(m)
    assert all(int((g.pool_ids[1] >= 0).sum()) > cfg.K for g in st.groups)  # row 1 is warm before
    for mod in (base, m):  # row 0: a new request of the same length; the model resets its own ledger
        mod.prefill([int(x) for x in L], seed=99, rows=[0])
    for s in range(6, 12):
        L = L + 1
        assert _step_pair(base, m, c, L, s) == (0.0, 0.0)
        if s == 6:
            for g in st.groups:  # both rows hold only what this step installed
                for row in (0, 1):
                    assert int((g.pool_ids[row] >= 0).sum()) <= cfg.K, (g.group_id, row)
        check_pool_invariants(st, m)  # pool content == full cache: no stale row


def test_length_going_down_invalidates_the_row():
    cfg = synth.SynthConfig(pattern="FS", S=1, router=False)
    base, m = synth.make_pair(cfg, [300, 280])
    be = make_offload_backend(pool_size=PS)
    c = torch.compile(m, backend=be)
    L = torch.tensor([300, 280])
    for s in range(4):
        L = L + 1
        _step_pair(base, m, c, L, s)
    st = be.state
    # a shorter new request in row 0 whose caches are rewritten while the ledger is left as it was
    ledgers = [getattr(m, f"sel_status_{l}").clone() for l in range(2)]
    m.prefill([200, int(L[1])], seed=123, rows=[0])
    for l, led in enumerate(ledgers):
        getattr(m, f"sel_status_{l}").copy_(led)
    with pytest.raises(AssertionError, match="differs from full cache"):
        check_pool_invariants(st, m)  # the pool still holds the old request's rows
    L = torch.tensor([201, int(L[1]) + 1])
    with torch.no_grad():
        c(*m.inputs(L, 4))
    check_pool_invariants(st, m)
    for g in st.groups:
        ids = g.pool_ids[0][g.pool_ids[0] >= 0]
        assert int(ids.max()) < 201  # only rows of the new request


def test_tiny_model_reset_rows_mid_run_is_exact():
    """The real model's own ``Driver.reset_row`` (prefill of one row: caches + ledger reset), no
    ``offload_state.reset``: every step equals the unmodified model bit for bit, the pool never stale."""
    from offload_passes import models

    over = dict(enable_offload=True, decode_steps=16)
    base, comp = models.build("tiny", **over), models.build("tiny", **over)
    B = comp.model.batch_size
    step = torch.compile(comp.model, backend=make_offload_backend(pool_size=PS))
    base.driver.prefill()
    comp.driver.prefill()

    def full_of(l):
        a = comp.model.model.layers[l].self_attn
        return (full_row(a.kv_cache, B), full_row(a.k_rope_cache, B))

    for i in range(12):
        if i == 5:
            for d in (base.driver, comp.driver):
                d.reset_row(1, prompt_len=100)
        x, y = base.driver.step(), comp.driver.step(step)
        assert (x.logits.float() - y.logits.float()).abs().max().item() == 0, f"step {i}"
        check_pool_state(_state_of(comp.model), B, full_of)


def _state_of(model):
    return module_state(model)


# -- state belongs to the caches ------------------------------------------------------------------
def test_one_backend_two_models_get_separate_state():
    # before: Dynamo reused one graph for both models, one OffloadState served both (logits off by ~0.5)
    cfg = synth.SynthConfig(pattern="FSFS", S=1)
    be = make_offload_backend(pool_size=PS)
    b1, m1 = synth.make_pair(cfg, [300, 280], seed=0)
    b2, m2 = synth.make_pair(cfg, [250, 320], seed=1)
    c1, c2 = torch.compile(m1, backend=be), torch.compile(m2, backend=be)
    L1, L2 = torch.tensor([300, 280]), torch.tensor([250, 320])
    for s in range(6):
        L1, L2 = L1 + 1, L2 + 1
        assert _step_pair(b1, m1, c1, L1, s) == (0.0, 0.0)
        assert _step_pair(b2, m2, c2, L2, s) == (0.0, 0.0)
        check_pool_invariants(_state_of(m1), m1)
        check_pool_invariants(_state_of(m2), m2)
    assert len(be.reports) == 1  # one compiled graph served both models
    s1, s2 = _state_of(m1), _state_of(m2)
    assert s1.groups[0].pool_ids.data_ptr() != s2.groups[0].pool_ids.data_ptr()
    assert s1.totals()["hits"] > 0 and s2.totals()["hits"] > 0
    assert len(be.states) == 2 and s1.resets == s2.resets == 0  # never reset: each kept warm


def test_graph_break_module_state_covers_both_graphs():
    # before: m.offload_state.reset(rows=[0]) reset only the graph that ran last
    cfg = synth.SynthConfig(pattern="FSFS", S=1, router=False, graph_break_after=1)
    base, m = synth.make_pair(cfg, [300, 280])
    w = offload(m, pool_size=PS)
    assert w.offload_state.groups == [] and w.offload_state.bytes() == {}
    w.offload_state.reset(rows=[0])  # before the first call: nothing cached, nothing to do
    L = torch.tensor([300, 280])
    for s in range(4):
        L = L + 1
        assert _step_pair(base, m, w, L, s) == (0.0, 0.0)
    assert len([r for r in w.offload_reports if r["rewritten"]]) == 2  # two rewritten graphs
    st = w.offload_state
    assert [g.layers for g in st.groups] == [[0, 1], [2, 3]] and sorted(st.pools) == [0, 1, 2, 3]
    check_pool_invariants(st, m)
    assert all(bool((g.pool_ids[0] >= 0).any()) for g in st.groups)
    st.reset(rows=[0])
    for g in w.offload_state.groups:  # both graphs' groups
        assert bool((g.pool_ids[0] == -1).all()) and bool((g.id_to_slot[0] == -1).all())
        assert bool((g.pool_ids[1] >= 0).any())
    for s in range(4, 6):
        L = L + 1
        assert _step_pair(base, m, w, L, s) == (0.0, 0.0)
    assert w.offload_state.counters()[1]["total"]["steps"] == 6


def test_deleting_the_model_frees_its_pools():
    cfg = synth.SynthConfig(pattern="FS", S=1, router=False)
    be = make_offload_backend(pool_size=PS)
    _, m = synth.make_pair(cfg, [300, 280])
    c = torch.compile(m, backend=be)
    with torch.no_grad():
        c(*m.inputs(torch.tensor([301, 281]), 0))
    st = be.state
    pool = weakref.ref(st.pools[0][0])
    meta = weakref.ref(st.groups[0].id_to_slot)
    n_bind = len(REGISTRY.bindings())
    del st, c, m
    gc.collect()
    # no torch._dynamo.reset(): the compiled graph lives on, the model's pools are gone
    assert pool() is None and meta() is None
    assert be.states == [] and len(REGISTRY.bindings()) == n_bind - 1


def test_dynamo_reset_frees_the_pools_of_a_live_model():
    cfg = synth.SynthConfig(pattern="FS", S=1, router=False)
    be = make_offload_backend(pool_size=PS)
    _, m = synth.make_pair(cfg, [300, 280])
    c = torch.compile(m, backend=be)
    with torch.no_grad():
        c(*m.inputs(torch.tensor([301, 281]), 0))
    pool = weakref.ref(be.state.pools[0][0])
    gc.collect()
    assert pool() is not None  # the model and its graph live: so do the pools
    torch._dynamo.reset()  # no graph uses them any more
    gc.collect()
    assert pool() is None and be.states == []


def test_same_layout_graphs_share_state_other_layouts_reset_on_switch():
    cfg = synth.SynthConfig(pattern="FS", S=1)
    base, m = synth.make_pair(cfg, [300, 280])
    be = make_offload_backend(pool_size=PS)
    c = torch.compile(m, backend=be)
    L = torch.tensor([300, 280])
    for s in range(3):
        L = L + 1
        _step_pair(base, m, c, L, s)
    g1 = be.state
    m.cfg.router = base.cfg.router = False  # guarded attribute: a second graph on the same caches
    L = L + 1
    assert _step_pair(base, m, c, L, 3) == (0.0, 0.0)
    g2 = be.state
    assert g2 is not g1 and len(be.reports) == 2
    # same group layout on the same caches: the same pools, warm (hits), no reset
    assert g2.groups[0].pool_ids is g1.groups[0].pool_ids and g1.resets == g2.resets == 0
    assert g2.counters()[0]["step"]["hits"] > 0
    # another backend (pool 128) on the same caches: each switch resets the state switched to
    be2 = make_offload_backend(pool_size=128)
    c2 = torch.compile(m, backend=be2)
    for s in range(4, 10):
        L = L + 1
        cc, bb = (c2, be2) if s % 2 == 0 else (c, be)
        assert _step_pair(base, m, cc, L, s) == (0.0, 0.0)
        check_pool_invariants(bb.state, m)
    assert be2.state.resets == 2 and g2.resets == 3


# -- the common piece of every mode (CPU backend and npu_modes) ------------------------------------
def test_state_binder_stale_rule_private_state():
    """A graph with a private state (the NPU modes' buffers): served caches switch -> reset first."""
    reg = StateRegistry()
    lay = [GroupLayout(0, 0, [0], 2, 16, 32, [(4, 2, torch.bfloat16)])]
    st = OffloadState.allocate("g", lay)
    ca, cb = [torch.zeros(3), torch.zeros(3)], [torch.zeros(3), torch.zeros(3)]
    binder = StateBinder("g", lay, [[("arg", 0), ("arg", 1)]], None, st, registry=reg)
    assert binder.extra_inputs(ca) == [] and st.resets == 0
    st.groups[0].pool_ids.fill_(3)
    binder.extra_inputs(ca)
    assert st.resets == 0 and bool((st.groups[0].pool_ids == 3).all())  # same caches: warm
    binder.extra_inputs(cb)  # another model's caches through the same graph: cold, never stale
    assert st.resets == 1 and bool((st.groups[0].pool_ids == -1).all())
    st.groups[0].pool_ids.fill_(5)
    del ca
    gc.collect()
    binder.extra_inputs(cb)
    assert st.resets == 1 and bool((st.groups[0].pool_ids == 5).all())

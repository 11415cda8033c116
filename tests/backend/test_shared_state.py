"""One offload state per set of caches, shared by every graph that serves them (docs/new-requests.md,
"Graphs that share caches"; offload_passes/state.py: ``cache_key``, ``StateRegistry``, ``GroupPools``).

Batch-size buckets (a B=4 and a B=2 graph over one set of caches, alternating), fresh view objects of
the caches on every call, two graphs and a second backend on one state: each stays warm after the
first step and equals the unmodified model exactly (eager). A different pool geometry cannot share:
cold, warned once per graph, counted in the report; a cache freed and its memory re-used never finds
the old pools."""
from __future__ import annotations

import copy
import gc
import logging
import os

import pytest
import torch

import dsa_synth as synth
from backend_helpers import check_pool_state
from offload_passes import make_offload_backend
from offload_passes.state import REGISTRY, GroupLayout, StateRegistry, cache_key, module_state

PS = 64
CACHES = ("full_kv_{}", "full_rope_{}", "kidx_{}")


def _cache_names(cfg: synth.SynthConfig) -> list[str]:
    n = len(cfg.pattern)
    return [f.format(l) for l in range(n) for f in CACHES if not (f.startswith("kidx") and cfg.pattern[l] != "F")]


def _buckets(cfg4: synth.SynthConfig, prefill: list[int]):
    """A B=4 model and a B=2 model with the same weights over the same full caches, twice (the unmodified
    pair and the pair to compile). As an engine's buckets do, the B=2 bucket uses rows 0..1 of one set of
    per-row buffers: its block table is rows 0..1 of the B=4 one, its selection buffers and ledgers are
    views of the B=4 model's first rows."""
    cfg2 = copy.copy(cfg4)
    cfg2.B = 2
    m4 = synth.SynthDSA(cfg4).eval()
    m2 = synth.SynthDSA(cfg2).eval()
    m4.prefill(prefill)
    with torch.no_grad():
        m2.block_table.copy_(m4.block_table[:2])
    for name in _cache_names(cfg4):
        m2._buffers[name] = m4._buffers[name]  # one set of caches
    for l in range(len(cfg4.pattern)):  # one set of selection buffers and ledgers: bucket B uses rows 0..B-1
        for name in (f"sel_kv_{l}", f"sel_rope_{l}", f"sel_status_{l}"):
            m2._buffers[name] = m4._buffers[name][: m2._buffers[name].size(0)]
    base = (m4, m2)
    return base, copy.deepcopy(base)  # deepcopy keeps the sharing (one memo)


def _step(base, comp, fn, L, s):
    h0, a0 = base(*base.inputs(L, s))
    h1, a1 = fn(*comp.inputs(L, s))
    return max((h0 - h1).abs().max().item(), (a0 - a1).abs().max().item())


def test_batch_bucket_graphs_share_one_pool():
    """B=4 and B=2 graphs alternate over one set of caches: the B=2 graph serves rows 0..1 of the pool the
    B=4 graph filled (and the other way round): warm from the second step on, exact, never reset."""
    cfg = synth.SynthConfig(pattern="FSS", B=4, S=2, router=False, identity_table=False)
    (b4, b2), (m4, m2) = _buckets(cfg, [300, 280, 260, 240])
    be = make_offload_backend(pool_size=PS)
    c4, c2 = torch.compile(m4, backend=be), torch.compile(m2, backend=be)
    L = torch.tensor([300, 280, 260, 240])
    diffs, hits, rows = [], [], []
    with torch.no_grad():
        for s in range(8):
            if s % 2 == 0:
                L = L + cfg.S
                diffs.append(_step(b4, m4, c4, L, s))
            else:
                L[:2] += cfg.S  # rows 2, 3 wait (the B=2 bucket does not serve them)
                diffs.append(_step(b2, m2, c2, L[:2], s))
            st = be.state
            hits.append(st.totals("step")["hits"])
            rows.append(st.groups[0].pool_ids.size(0))
    assert max(diffs) == 0.0, diffs
    assert hits[0] == 0 and min(hits[1:]) > 0, hits
    assert hits == [0, 71, 121, 51, 116, 73, 121, 68], hits  # deterministic (eager, one thread)
    assert rows == [4, 2] * 4
    assert len(be.reports) == 2 and [r["cold_resets"] for r in be.reports] == [0, 0]
    st = module_state(m4)  # one state over both graphs: every row of the shared pool
    assert [g.pool_ids.size(0) for g in st.groups] == [4] and st.groups[0].stats[1, 6].item() == 8
    full = {l: (m4._buffers[f"full_kv_{l}"], m4._buffers[f"full_rope_{l}"]) for l in range(3)}
    table = m4.block_table.long()

    def rows_of(l):  # [B, F, D] through the block table
        return tuple(t[table].flatten(1, 2) for t in full[l])
    assert check_pool_state(st, 4, rows_of) > 0


# Inductor compiles two graphs (about a minute on 2 cores): with the long runs
MODES = ["eager", "inductor"] if os.environ.get("OFFLOAD_PASSES_LONG") == "1" else ["eager"]


@pytest.mark.parametrize("mode", MODES)
def test_a_smaller_bucket_compiled_first_grows_in_place_of_resetting(mode):
    """The B=2 graph runs first, then the B=4 graph joins: the shared state grows to 4 rows, rows 0..1
    keep what they hold (hits on the B=4 graph's first step), rows 2..3 start empty; the B=2 graph,
    compiled on 2-row tensors, then gets rows 0..1 of the grown ones (views)."""
    from new_request_cases import TOL

    cfg = synth.SynthConfig(pattern="FS", B=4, S=1, router=False, identity_table=False)
    (b4, b2), (m4, m2) = _buckets(cfg, [300, 280, 260, 240])
    be = make_offload_backend(pool_size=PS, exe_mode=mode)
    c4, c2 = torch.compile(m4, backend=be), torch.compile(m2, backend=be)
    L = torch.tensor([300, 280, 260, 240])
    with torch.no_grad():
        for s in range(2):
            L[:2] += 1
            assert _step(b2, m2, c2, L[:2], s) <= TOL[mode]
        small = be.state.groups[0].shared
        assert small.rows == 2
        L = L + 1
        assert _step(b4, m4, c4, L, 2) <= TOL[mode]
        st = be.state
        assert st.groups[0].shared is small and small.rows == 4 and small.gen == 1
        assert st.totals("step")["hits"] > 0 and be.reports[-1]["cold_resets"] == 0
        for s in range(3, 5):  # the B=2 graph again: its inputs are rows 0..1 of the grown tensors
            L[:2] += 1
            assert _step(b2, m2, c2, L[:2], s) <= TOL[mode]
            assert be.state.totals("step")["hits"] > 0


def _run_views(fresh: bool):
    cfg = synth.SynthConfig(pattern="FSS", S=1, router=False, identity_table=False)
    base, m = synth.make_pair(cfg, [300, 280])
    owners = {name: m._buffers[name] for name in _cache_names(cfg)}
    be = make_offload_backend(pool_size=PS)
    c = torch.compile(m, backend=be)
    L = torch.tensor([300, 280])
    diffs, hits, sizes = [], [], []
    with torch.no_grad():
        for s in range(6):
            if fresh:
                for name, t in owners.items():
                    m._buffers[name] = t.view(t.shape)  # a new view object of the same memory
            L = L + 1
            diffs.append(_step(base, m, c, L, s))
            hits.append(be.state.totals("step")["hits"])
            sizes.append(len(REGISTRY.bindings([be.reports[-1]["graph_id"]])))
    return m, be, diffs, hits, sizes


def test_fresh_view_objects_of_the_caches_keep_the_pool():
    """An engine hands the model new view objects of its caches every step: the state is found by the
    caches' storage, not by the view objects: exact, the very hits of the same run on the module's own
    buffers, no recompile, no reset, and the registry does not grow per step."""
    m, be, diffs, hits, sizes = _run_views(fresh=True)
    assert module_state(m).groups[0].stats[1, 6].item() == 6  # the module's view buffers find their owner
    assert len(be.reports) == 1 and be.reports[0]["cold_resets"] == 0
    assert sizes == [1] * 6, sizes
    torch._dynamo.reset()
    _, _, same_diffs, same_hits, _ = _run_views(fresh=False)
    assert max(diffs) == 0.0 and max(same_diffs) == 0.0, (diffs, same_diffs)
    assert hits == same_hits == [0, 28, 37, 22, 32, 39], (hits, same_hits)


def test_two_backends_with_the_same_geometry_share_one_state():
    """Two backend instances (same pool size) compile the same model; alternating, each finds the pool the
    other filled: warm, exact, no reset."""
    cfg = synth.SynthConfig(pattern="FS", S=1, router=False)
    base, m = synth.make_pair(cfg, [300, 280])
    be1, be2 = make_offload_backend(pool_size=PS), make_offload_backend(pool_size=PS)
    c1, c2 = torch.compile(m, backend=be1), torch.compile(m, backend=be2)
    L = torch.tensor([300, 280])
    hits = []
    with torch.no_grad():
        for s in range(6):
            L = L + 1
            be, c = (be1, c1) if s % 2 == 0 else (be2, c2)
            assert _step(base, m, c, L, s) == 0.0
            hits.append(be.state.totals("step")["hits"])
    assert hits[0] == 0 and min(hits[1:]) > 0, hits
    assert hits == [0, 22, 23, 17, 28, 39], hits  # deterministic: those of one backend alone
    assert be1.state.groups[0].shared is be2.state.groups[0].shared
    assert be1.reports[-1]["cold_resets"] == be2.reports[-1]["cold_resets"] == 0
    assert be1.state.counters()[0]["total"]["steps"] == 6  # one counter for both graphs


def test_a_different_geometry_is_cold_warned_and_reported(caplog):
    """A B=2 graph with another pool size than the B=4 graph on the same caches cannot share: each call
    resets the pool the other filled: exact, 0 hits, one warning per graph, ``cold_resets`` counted."""
    cfg = synth.SynthConfig(pattern="FS", B=4, S=1, router=False, identity_table=False)
    (b4, b2), (m4, m2) = _buckets(cfg, [300, 280, 260, 240])
    be4, be2 = make_offload_backend(pool_size=PS), make_offload_backend(pool_size=2 * PS)
    c4, c2 = torch.compile(m4, backend=be4), torch.compile(m2, backend=be2)
    L = torch.tensor([300, 280, 260, 240])
    hits = []
    with caplog.at_level(logging.WARNING, logger="offload_passes"), torch.no_grad():
        for s in range(6):
            if s % 2 == 0:
                L = L + 1
                assert _step(b4, m4, c4, L, s) == 0.0
                hits.append(be4.state.totals("step")["hits"])
            else:
                L[:2] += 1
                assert _step(b2, m2, c2, L[:2], s) == 0.0
                hits.append(be2.state.totals("step")["hits"])
    assert hits == [0] * 6, hits
    assert be4.reports[-1]["cold_resets"] == 2 and be2.reports[-1]["cold_resets"] == 2
    warned = [r.getMessage() for r in caplog.records if "reset again" in r.getMessage()]
    assert sorted(w.split(":")[0] for w in warned) == sorted([be4.reports[-1]["graph_id"], be2.reports[-1]["graph_id"]])


def test_a_cache_freed_and_its_memory_reused_does_not_inherit_the_pool():
    """The registry by storage: a view of the same memory finds the state; a new cache tensor over the very
    memory of a freed one (same address, shape, dtype: here the same host buffer) gets a new, empty state."""
    reg = StateRegistry()
    lay = [GroupLayout(0, 0, [0], 2, 16, 64, [(8, 4, torch.bfloat16)])]
    mem_kv, mem_rope = bytearray(2 * 64 * 8 * 2), bytearray(2 * 64 * 4 * 2)

    def caches():
        return [torch.frombuffer(mem_kv, dtype=torch.bfloat16).view(2, 64, 8),
                torch.frombuffer(mem_rope, dtype=torch.bfloat16).view(2, 64, 4)]

    kv, rope = caches()
    st = reg.bind("g", lay, [[kv, rope]])
    reg.activate(st, [[kv, rope]])
    st.groups[0].pool_ids.fill_(7)
    view = [kv.view(kv.shape), rope[:]]
    assert cache_key(view[0]) == cache_key(kv) and cache_key(kv[1:]) != cache_key(kv)
    assert reg.bind("g", lay, [view]).groups[0].shared is st.groups[0].shared
    old, ptr = st.groups[0].shared, kv.data_ptr()
    del st, view, kv, rope
    gc.collect()
    kv2, rope2 = caches()
    assert kv2.data_ptr() == ptr
    st2 = reg.bind("g", lay, [[kv2, rope2]])
    assert st2.groups[0].shared is not old and bool((st2.groups[0].pool_ids == -1).all())
    assert not reg.activate(st2, [[kv2, rope2]])  # fresh, nothing to reset, nothing claimed by the old one

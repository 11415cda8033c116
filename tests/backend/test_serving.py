"""Serving the way engines serve (docs/new-requests.md, "Paged KV" and "The engine's contract"): any block
table, rows that shift or get other blocks, outside writes no version counter shows, and the serving loop
of models/glm/serve.py (continuous batching, a C++ KV transfer, varying MTP acceptance) step by step
against the unmodified model."""
from __future__ import annotations

import dataclasses

import os

import pytest
import torch

import dsa_synth as synth
from backend_helpers import ops_of
from offload_passes import make_offload_backend, models
from offload_passes.models.glm.serve import Lane, Server, ServeConfig, bucket_model
from offload_passes.state import module_state

PS = 64


def _swap_rows(m: synth.SynthDSA, perm: list[int]) -> None:
    """The engine moved requests between batch rows (row b now holds the request of row perm[b]): its block
    table row, and the ledger / selection rows that belong to the request, follow it."""
    c = m.cfg
    idx = torch.tensor(perm)
    with torch.no_grad():
        m.block_table.copy_(m.block_table[idx])
        for l in range(len(c.pattern)):
            st = getattr(m, f"sel_status_{l}")
            st.copy_(st[idx])
            for name in (f"sel_kv_{l}", f"sel_rope_{l}"):
                t = getattr(m, name)
                v = t.view(c.B, -1, *t.shape[1:])
                v.copy_(v[idx])


def _reallocate(m: synth.SynthDSA, row: int) -> None:
    """The cache manager moved row ``row``'s request to other physical blocks, same content: its blocks
    trade places with the other row's, data and table entries both. The data moves through ``.data``, which
    moves no version counter (as a C++ op or a KV transfer would): only the block table shows it."""
    other = 1 - row
    with torch.no_grad():
        a, b = m.block_table[row].long().clone(), m.block_table[other].long().clone()
        for l in range(len(m.cfg.pattern)):
            for name in (f"full_kv_{l}", f"full_rope_{l}") + ((f"kidx_{l}",) if m.cfg.pattern[l] == "F" else ()):
                t = getattr(m, name).data
                ta, tb = t[a].clone(), t[b].clone()
                t[a], t[b] = tb, ta
        m.block_table[row], m.block_table[other] = b.to(torch.int32), a.to(torch.int32)


def _run(cfg, steps, events=None, announce=None, prefill=(300, 280)):
    """The unmodified and the compiled synthetic model side by side, ``events[step](model)`` applied to
    both before that step; ``announce[step](state)`` to the compiled side only. Returns per-step max
    |diff| and per-step hits."""
    base, m = synth.make_pair(cfg, list(prefill))
    be = make_offload_backend(pool_size=PS)
    c = torch.compile(m, backend=be)
    L = torch.tensor(list(prefill))
    diffs, hits = [], []
    with torch.no_grad():
        for s in range(steps):
            if events and s in events:
                L = events[s](base, L)
                events[s](m, L)
            if announce and s in announce and be.state is not None:
                announce[s](be.state)
            L = L + cfg.S
            h0, a0 = base(*base.inputs(L, s))
            h1, a1 = c(*m.inputs(L, s))
            diffs.append(max((h0 - h1).abs().max().item(), (a0 - a1).abs().max().item()))
            hits.append(be.state.totals("step")["hits"])
    return be, diffs, hits


def test_any_block_table_is_served_exactly():
    """A permuted block table (what a cache manager hands out) is rewritten, not refused: serve takes the
    pool hits, the model's gather (kept) reads the rest through the table; bit-identical, warm."""
    for S in (1, 2):
        cfg = synth.SynthConfig(pattern="FSS", S=S, router=False, identity_table=False)
        be, diffs, hits = _run(cfg, 6)
        rep = be.reports[-1]
        assert rep["rewritten"] and not rep["refusals"] and [g["paged"] for g in rep["groups"]] == [True]
        assert max(diffs) == 0.0, diffs
        assert hits[0] == 0 and min(hits[1:]) > 0, hits
        g = be.final_graph()
        assert len(ops_of(g, "dsa_serve")) == 3 and len(ops_of(g, "npu_gather_selection_kv_cache")) == 3
        assert not [n for n in g.nodes if n.op == "call_function" and "_functional" in str(n.target)]
        # no guard on the full table is left: only the lengths guard (and the selection table's)
        assert not [n for n in rep.get("guards", []) if "identity" in n]


def _rows_shift(m, L):
    _swap_rows(m, [1, 0])
    return L[[1, 0]]


def _blocks_move(m, L):
    _reallocate(m, 0)
    return L


def test_rows_that_shift_or_get_other_blocks_are_never_stale():
    """Rows swap requests, then the requests' blocks are re-allocated; the lengths stay inside the
    continuation window (equal prompts), the ledgers follow their requests and no full cache's version
    counter moves: only the block-table signal sees it, and invalidates exactly those rows."""
    cfg = synth.SynthConfig(pattern="FSS", S=2, router=False, identity_table=False)
    be, diffs, hits = _run(cfg, 8, events={3: _rows_shift, 6: _blocks_move}, prefill=(300, 300))
    assert max(diffs) == 0.0, diffs
    assert hits[2] > 0 and hits[3] == 0 and hits[5] > 0 and hits[6] == 0, hits  # cold, never stale


def test_move_rows_keeps_shifted_rows_warm():
    """``OffloadState.move_rows`` carries each request's pool rows to its new batch row: exact and warm."""
    cfg = synth.SynthConfig(pattern="FSS", S=2, router=False, identity_table=False)
    _, cold, hits_cold = _run(cfg, 6, events={3: _rows_shift}, prefill=(300, 300))
    _, warm, hits_warm = _run(cfg, 6, events={3: _rows_shift}, announce={3: lambda st: st.move_rows([1, 0])},
                              prefill=(300, 300))
    assert max(cold) == 0.0 and max(warm) == 0.0, (cold, warm)
    assert hits_cold[3] == 0 and hits_warm[3] > 0 and hits_warm[3] >= hits_warm[2] // 2, (hits_cold, hits_warm)


def test_begin_request_limits_an_outside_write_to_the_announced_rows():
    """An eager re-fill of row 1 moves the caches' version counters: without an announcement every row
    goes cold; ``begin_request([1])`` (the engine names every row it wrote) keeps row 0 warm; exact both."""
    cfg = synth.SynthConfig(pattern="FSS", S=1, router=False, identity_table=False)

    def refill(m, L):
        m.prefill([300, 290], seed=5, rows=[1])
        return torch.tensor([int(L[0]), 290])

    _, d0, h0 = _run(cfg, 6, events={3: refill})
    _, d1, h1 = _run(cfg, 6, events={3: refill}, announce={3: lambda st: st.begin_request([1])})
    assert max(d0) == 0.0 and max(d1) == 0.0, (d0, d1)
    assert h0[3] == 0 and h1[3] > 0, (h0, h1)


# -- the serving loop (models/glm/serve.py) ------------------------------------------------------------
KW = dict(enable_offload=True, batch_size=2, next_n=1, pa_max_length=256, prefill_len=64, decode_steps=8)
SERVE = ServeConfig(seed=3, prompt_len=(24, 120), output_len=(1, 3))


def _serve(steps: int, backend, follow: bool = True, reference=None, **kw):
    """The serving loop with the unmodified model (``reference(model)``: how it runs, e.g. under Inductor)
    and the model compiled with ``backend`` as lanes; per step max |logits diff| and pool hits. ``kw``:
    overrides of the ``tiny`` preset (KW)."""
    torch._dynamo.reset()
    over = dict(KW, **kw)
    ref = models.build("tiny", **over).model
    cm = models.build("tiny", **over).model
    pm = models.build("tiny", **dict(over, batch_size=1)).model
    step = torch.compile(cm, backend=backend)
    hook = (lambda src: module_state(cm).move_rows(src)) if follow else None
    srv = Server([Lane(ref, reference(ref) if reference else None), Lane(cm, step, hook)], pm, SERVE)
    diffs, hits = [], []
    for _ in range(steps):
        a, b = srv.step()
        diffs.append((a.float() - b.float()).abs().max().item())
        hits.append(module_state(cm).totals("step")["hits"])
    return srv, diffs, hits


# The whole tiny preset under Inductor compiles it twice (the reference too; minutes on 2 cores): with the
# long matrix (tests/backend/test_new_requests.py). CI runs the Inductor loop on a 4-layer tiny below.
MODES = ["eager", "inductor"] if os.environ.get("OFFLOAD_PASSES_LONG") == "1" else ["eager"]


@pytest.mark.parametrize("mode", MODES)
def test_serving_loop_matches_the_unmodified_model_every_step(mode):
    """Exact in eager; under Inductor the demo's tolerance, against the unmodified model under Inductor (as
    the new-request matrix compares)."""
    from new_request_cases import TOL

    ref = (lambda m: torch.compile(m, backend="inductor")) if mode == "inductor" else None
    srv, diffs, hits = _serve(10, make_offload_backend(pool_size=256, exe_mode=mode), reference=ref)
    assert srv.batch_changes >= 3 and srv.finished >= 2  # rows shifted, requests came and went
    assert max(diffs) <= TOL[mode], diffs
    assert sum(hits) > 0, hits


def test_serving_loop_with_batch_buckets_is_exact_and_warm():
    """Batch buckets (2, 4) as engines capture them: a B=2 graph beside the B=4 one over the same caches,
    its ledgers rows 0..1 of the B=4 ones (``bucket_model``); requests arrive at half the free rows
    (``arrival``), so the running count varies and the loop picks the smallest bucket that holds it,
    padding the rest. Every step of the compiled lane equals the unmodified lane exactly on the rows that
    hold a request; both bucket graphs run, each warm after its first step (the shared offload state,
    offload_passes/state.py), and no graph ever resets the other's pool."""
    torch._dynamo.reset()
    over = dict(KW, batch_size=4)
    ref = models.build("tiny", **over).model
    cm = models.build("tiny", **over).model
    pm = models.build("tiny", **dict(over, batch_size=1)).model
    be = make_offload_backend(pool_size=256)
    ref2, cm2 = bucket_model(ref, 2), bucket_model(cm, 2)
    assert cm2.model.layers[1].self_attn.kv_cache is cm.model.layers[1].self_attn.kv_cache
    assert cm2.lm_head.weight is cm.lm_head.weight and cm2.block_table.shape == (2, cm.block_table.size(1))
    lanes = [Lane(ref, None, None, {2: (ref2, None)}),
             Lane(cm, torch.compile(cm, backend=be), lambda src: module_state(cm).move_rows(src),
                  {2: (cm2, torch.compile(cm2, backend=be))})]
    srv = Server(lanes, pm, ServeConfig(seed=3, prompt_len=(24, 120), output_len=(1, 3), arrival=0.5))
    seen: set = set()
    warm = []  # (bucket, hits) of the steps after each bucket's first on which some request continues
    for s in range(12):
        before = set(srv.rows) - {None}
        a, b = srv.step()
        assert a.shape[0] == b.shape[0] == len(set(srv.rows) - {None}), (a.shape, srv.rows)
        assert torch.equal(a, b), (s, (a.float() - b.float()).abs().max().item())
        hits = module_state(cm).totals("step")["hits"]
        if srv.bucket in seen and before & set(srv.rows):
            warm.append((srv.bucket, hits))
        seen.add(srv.bucket)
    assert srv.bucket_steps[2] > 0 and srv.bucket_steps[4] > 0, srv.bucket_steps
    assert srv.finished >= 2 and srv.batch_changes >= 3, (srv.finished, srv.batch_changes)
    assert {k for k, _ in warm} == {2, 4} and min(h for _, h in warm) > 0, warm
    assert be.reports and all(r["rewritten"] and r["cold_resets"] == 0 for r in be.reports), be.reports
    assert [g.pool_ids.size(0) for g in module_state(cm).groups] == [4] * len(module_state(cm).groups)


def test_serve_config_and_bucket_model_name_bad_input():
    with pytest.raises(ValueError, match=r"ServeConfig.arrival must be in \(0, 1\], got 0.0"):
        ServeConfig(arrival=0.0)
    m = models.build("tiny", **KW).model
    with pytest.raises(ValueError, match=r"bucket_model: batch_size must be in \[1, 2\) \(the model's batch\), got 2"):
        bucket_model(m, 2)
    other = models.build("tiny", **dict(KW, batch_size=1)).model  # its own caches: not a bucket of m
    with pytest.raises(ValueError, match="the bucket 1 model must share the lane model's caches"):
        Server([Lane(m, buckets={1: (other, None)})], other)
    with pytest.raises(ValueError, match=r"every lane must have the same bucket sizes, got \[\] and \[1\]"):
        Server([Lane(m, buckets={1: (bucket_model(m, 1), None)}), Lane(m)], other)


def test_serving_loop_under_inductor_is_within_the_demo_tolerance_every_step():
    """The serving loop with the offload lowered by Inductor, in CI: tiny cut to 4 layers (IndexShare
    ``FSFS``: two groups, both paged), 6 steps, each compared with the unmodified model under Inductor
    (as the demo and the new-request matrix compare) within the demo's tolerance; rows shift, requests
    come and go, and the pool is warm."""
    from offload_passes.apps.common import LOGITS_TOL

    be = make_offload_backend(pool_size=256, exe_mode="inductor")
    srv, diffs, hits = _serve(6, be, reference=lambda m: torch.compile(m, backend="inductor"),
                              num_hidden_layers=4, index_topk_pattern="FSFS")
    assert be.reports[-1]["rewritten"] and be.reports[-1]["mode"] == "inductor"
    assert srv.batch_changes >= 3 and srv.finished >= 2, (srv.batch_changes, srv.finished)
    assert max(diffs) <= LOGITS_TOL, diffs
    assert len(hits) == 6 and hits[0] == 0 and sum(h > 0 for h in hits) >= 4, hits
    st = module_state(srv.lanes[1].model)
    assert [g.layers for g in st.groups] == [[0, 1], [2, 3]]


def test_serving_loop_with_the_per_row_signals_patched_out_is_served_stale(monkeypatch):
    """The same loop with no in-graph new-request detection and no move_rows: the KV transfer moves no
    version counter, so nothing sees the new requests and their rows are served the old ones' pool."""
    from offload_passes import pipeline
    from offload_passes.passes import rewrite as rw

    orig = rw.rewrite
    monkeypatch.setattr(pipeline, "rewrite", lambda gm, fe, grp, plans, st, settings:
                        orig(gm, fe, grp, plans, st, dataclasses.replace(settings, detect_new_requests=False)))
    _, diffs, _ = _serve(10, make_offload_backend(pool_size=256), follow=False)
    assert max(diffs) > 0.1, diffs


def test_with_the_block_table_signal_patched_out_shifted_rows_are_served_stale(monkeypatch):
    """The shift / re-allocation test above without the block-table signal: served stale (so it can fail)."""
    from offload_passes.passes import rewrite as rw

    orig = rw.invalidate_new_rows
    monkeypatch.setattr(rw, "invalidate_new_rows",
                        lambda b, p, meta, L, ledgers, table=None: orig(b, p, meta, L, ledgers, None))
    cfg = synth.SynthConfig(pattern="FSS", S=2, router=False, identity_table=False)
    _, diffs, _ = _run(cfg, 8, events={3: _rows_shift, 6: _blocks_move}, prefill=(300, 300))
    assert max(diffs[:3]) == 0.0 and max(diffs[3:]) > 0.1, diffs


def test_demo_serve_bad_input_is_one_line_and_exit_2(capsys):
    from offload_passes.apps import demo

    assert demo.main(["--serve", "--model", "hf"]) == 2
    assert demo.main(["--serve", "--record-trace", "x.npz"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["offload-demo: error: --serve applies to --model glm on one process (no --world)",
                   "offload-demo: error: --serve does not take --record-trace / --replacement-policy / --dump-dir"], err


def test_graphs_that_keep_the_pool_cold_are_reported_once(caplog):
    """Two graphs over one set of caches that cannot share a pool (other pool layouts: here two backends
    with other pool sizes), alternating: each call resets the other's pools. Exact, but cold: one warning,
    and ``cold_resets`` in each graph's report."""
    import logging

    cfg = synth.SynthConfig(pattern="FS", S=1, router=False)
    base, m = synth.make_pair(cfg, [300, 280])
    be1, be2 = make_offload_backend(pool_size=64), make_offload_backend(pool_size=128)
    c1, c2 = torch.compile(m, backend=be1), torch.compile(m, backend=be2)
    L = torch.tensor([300, 280])
    with caplog.at_level(logging.WARNING, logger="offload_passes"), torch.no_grad():
        for s in range(6):
            L = L + 1
            h0, _ = base(*base.inputs(L, s))
            h1, _ = (c1 if s % 2 == 0 else c2)(*m.inputs(L, s))
            assert torch.equal(h0, h1), s
    assert be1.reports[-1]["cold_resets"] == 2 and be2.reports[-1]["cold_resets"] == 2
    warned = [r for r in caplog.records if "reset again" in r.getMessage()]
    assert len(warned) == 2 and {be1.reports[-1]["graph_id"], be2.reports[-1]["graph_id"]} == {
        w.getMessage().split(":")[0] for w in warned}


def test_move_rows_carries_pool_rows_and_names_bad_input():
    """``move_rows(src)``: row b takes the pool rows of row src[b] (in place), -1 rows start empty, and the
    call counts as the engine's announcement; a wrong ``src`` is refused naming the limit."""
    import pytest

    from offload_passes.state import GroupLayout, OffloadState

    st = OffloadState.allocate("g", [GroupLayout(0, 0, [0], 3, 16, 64, [(8, 4, torch.bfloat16)], 4)])
    g = st.groups[0]
    kv, rope = st.pools[0]
    for b in range(3):
        g.pool_ids[b].fill_(b)
        g.seen_len[b] = 10 * (b + 1)
        g.seen_table[b].fill_(b + 1)
        kv[b].fill_(b + 1)
    ptr = kv.data_ptr()
    st.move_rows([2, 0, -1])
    assert g.pool_ids[:, 0].tolist() == [2, 0, -1] and g.seen_len.tolist() == [30, 10, 0]
    assert g.seen_table[:2, 0].tolist() == [3, 1]  # (row 2's does not matter: with seen_len 0 nothing is compared)
    assert kv[:, 0, 0].tolist() == [3.0, 1.0, 0.0] and kv.data_ptr() == ptr
    assert g.shared.announced
    # a smaller batch bucket next: src names its rows, the rows past it hold no request (emptied)
    st.move_rows([1])
    assert g.pool_ids[:, 0].tolist() == [0, -1, -1] and g.seen_len.tolist() == [10, 0, 0]
    assert kv[:, 0, 0].tolist() == [1.0, 0.0, 0.0]
    for src, msg in (([0, 1, 2, 0], r"src must have one entry per batch row of the next step, 1 to 3 .*got 4"),
                     ([], r"src must have one entry per batch row of the next step, 1 to 3 .*got 0"),
                     ([0, 1, 3], r"src entries must be in \[-1, 3\) .*got \[3\]"),
                     ([0, 0, 1], "a request cannot move to two rows")):
        with pytest.raises(ValueError, match=msg):
            st.move_rows(src)


def test_the_kv_transfer_is_built_at_install_and_moves_no_version_counter():
    """``glm_serve::copy_blocks_`` comes from the library ``pip install`` built (setup.py), named for this
    torch build; it copies whole blocks by id and, like an engine's transfer, moves no version counter."""
    from offload_passes import _extensions
    from offload_passes.models.glm import serve

    lib = serve.transfer_library()
    assert lib is not None and lib.name.startswith(_extensions.kv_transfer_name(torch.__version__)), lib
    op = serve.load_transfer_op()
    assert serve.transfer_origin() in ("prebuilt", "loaded")
    dst, src = torch.zeros(4, 2, 3), torch.arange(18.0).view(3, 2, 3)
    op(dst, src, torch.tensor([3, 1]), torch.tensor([0, 2]))
    assert torch.equal(dst[3], src[0]) and torch.equal(dst[1], src[2]) and dst[[0, 2]].abs().sum() == 0
    assert dst._version == 0
    tag = _extensions.torch_tag(torch.__version__)
    assert serve.transfer_build_dir().name == f"glm_serve_kv_transfer_{tag}"  # the JIT fallback: one per torch


def test_a_build_lock_left_by_a_stopped_build_is_removed_and_named(tmp_path, caplog):
    """The JIT fallback's wait (``_extensions.wait_for_build_lock``): a lock older than the limit is a build
    that was stopped (removed, named in a warning); a fresh one is waited on until it goes (another
    process's build), or until it is older than the limit."""
    import logging
    import os

    from offload_passes import _extensions

    lock = tmp_path / "lock"
    lock.write_text("")
    os.utime(lock, (1000.0, 1000.0))
    with caplog.at_level(logging.WARNING, logger="offload_passes.extensions"):
        assert _extensions.wait_for_build_lock(tmp_path, stale_after=300, clock=lambda: 1400.0) == lock
    assert not lock.exists() and any(str(lock) in r.getMessage() and "stale" in r.getMessage()
                                     for r in caplog.records)
    assert _extensions.wait_for_build_lock(tmp_path) is None  # no lock: nothing to wait for
    lock.write_text("")
    os.utime(lock, (1000.0, 1000.0))
    waits = []
    # another process's build ends after two polls
    assert _extensions.wait_for_build_lock(tmp_path, stale_after=300, clock=lambda: 1010.0,
                                           sleep=lambda s: waits.append(s) or (len(waits) == 2 and lock.unlink())
                                           ) is None
    assert len(waits) == 2
    lock.write_text("")
    os.utime(lock, (1000.0, 1000.0))
    now = [1010.0]
    # ... or is stopped while we wait: removed once it is older than the limit
    assert _extensions.wait_for_build_lock(tmp_path, stale_after=300, clock=lambda: now[0],
                                           sleep=lambda s: now.__setitem__(0, now[0] + 100.0)) == lock
    assert not lock.exists() and now[0] >= 1300.0


def test_demo_serve_with_buckets_in_any_order_exits_0_exact(capsys):
    """``offload-demo --serve --buckets 1,2,4`` with a varying running count: bucket 1 runs first, 2 and 4
    compile later (the engine's announcement for their first step comes before their graph binds: the
    shared state grows at once); exit 0, max |diff| 0, every bucket ran. The order given does not matter
    (``4,2`` is ``2,4``); tests/backend/test_engine_schedules.py runs the buckets large first and
    interleaved too."""
    import json

    from offload_passes.apps import demo

    assert demo.parse_buckets("4,2", 4) == demo.parse_buckets("2,4", 4) == [2, 4]
    torch._dynamo.reset()
    assert demo.main(["--serve", "--buckets", "1,2,4", "--arrival", "0.05", "--steps", "30", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_abs_diff"] == 0.0 and out["within_tolerance"], out
    assert set(out["buckets"]) == {"1", "2", "4"} and all(out["buckets"].values()), out

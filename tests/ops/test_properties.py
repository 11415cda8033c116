"""Property-based tests (hypothesis) of the four CPU ops (docs/ops.md §8 invariants).

* ``test_plan_serve_install_pipeline``: random B, S, K, pool sizes, id ranges, lengths (also <= 0),
  ``-1`` sentinels anywhere, other negatives, duplicate ids, ids past ``max_sel`` and past ``id_range``,
  consistent or garbage pool metadata. One decode step of a group through the C++ kernels:
  ``dsa_plan`` == reference == literal docs/ops.md §2.4 transcription; ``dsa_serve`` == reference and §8.1
  (served rows are the full-cache rows; zeros else); ``dsa_install`` (metadata_update 0 and 1) ==
  reference == literal §4.2 transcription and §8.4 / §8.6 / §8.7.
* ``test_gather_ledger``: ``npu_gather_selection_kv_cache`` C++ == reference, and the §8.9 ledger
  invariants for contract-abiding rows, over random geometries and previous ledgers.
* ``test_bad_input_is_refused_by_name``: a valid call with one defect (wrong dtype, wrong rank or size,
  bad int argument, empty batch, out-of-range / negative block-table entries, non-contiguous tensor)
  must raise ``RuntimeError("custom::<op>: ...")`` naming the damaged argument and leave every tensor
  (and a guard region around the mutated outputs) untouched — or, for defects the spec defines
  (non-contiguous inputs, sizes that stay legal), give exactly the reference's result.

Tensor contents come from a seeded generator drawn by hypothesis (the geometry, counts and switches are
drawn directly, so failures shrink to the smallest geometry). Profiles (``tests/conftest.py``): ``ci``
(default, fast, derandomized) and ``long`` (``--hypothesis-profile=long``). Always the default FIFO
install policy.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import assume, given, note
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
import _gen as G  # noqa: E402
from test_dsa_install import literal_install  # noqa: E402  (literal docs/ops.md §4.2)
from test_dsa_plan import literal_plan, records_as_dict  # noqa: E402  (literal docs/ops.md §2.4)
import test_npu_gather_selection_kv_cache as TG  # noqa: E402  (gather Case / ledger checker)

from offload_passes.custom_ops import _library as Lib  # noqa: E402
from offload_passes.custom_ops import dsa_install as MI  # noqa: E402
from offload_passes.custom_ops import dsa_plan as MP  # noqa: E402
from offload_passes.custom_ops import dsa_serve as MS  # noqa: E402
from offload_passes.custom_ops import npu_gather_selection_kv_cache as MG  # noqa: E402

plan_op = torch.ops.custom.dsa_plan.default
serve_op = torch.ops.custom.dsa_serve.default
install_op = torch.ops.custom.dsa_install.default
gather_op = torch.ops.custom.npu_gather_selection_kv_cache.default


@pytest.fixture(scope="module", autouse=True)
def cpp_kernels(force_cpp_kernels):
    """The C++ path (built once, cached on disk), single-threaded like the other bulk op tests."""
    for name in ("dsa_plan", "dsa_serve", "dsa_install", "npu_gather_selection_kv_cache"):
        Lib.cpu_op(name)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int8)


# --------------------------------------------------------------------------------------------
# plan -> serve -> install
# --------------------------------------------------------------------------------------------

@st.composite
def group_step(draw):
    B = draw(st.integers(1, 3))
    S = draw(st.integers(1, 4))
    sbs = draw(st.sampled_from([16, 32, 64]))
    K = draw(st.sampled_from([k for k in (64, 128, 192, 256) if k % sbs == 0]))
    PS = 16 * 2 ** draw(st.integers(0, 4))
    assume(PS % sbs == 0)  # docs/ops.md §9: install assumes PS % selection_block_size == 0
    IR = draw(st.integers(1, 3 * K))
    L = draw(st.lists(st.integers(-2, 2 * K + S), min_size=B, max_size=B))
    return dict(
        B=B, S=S, K=K, PS=PS, IR=IR, sbs=sbs, L=L,
        F=max(max(L), 1) + draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
        fill=draw(st.sampled_from([1.0, 0.5, 0.1])),
        hole=draw(st.sampled_from([0.0, 0.0, 0.5, 1.0])),  # -1/-2/-3 inside the valid prefix
        dup=draw(st.sampled_from([0.0, 0.5, 1.0])),
        future=draw(st.sampled_from([0.0, 0.5])),
        beyond=draw(st.booleans()),  # ids >= id_range
        garbage=draw(st.booleans()),  # inconsistent pool metadata (plan / install must stay in bounds)
        pool_fill=draw(st.sampled_from([0.0, 0.5, 1.0])),
        D=draw(st.integers(1, 8)), Dr=draw(st.integers(0, 4)),  # Dr = 0: the no-rope mode (docs/ops.md §3.3)
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])),
    )


def _make_step(c):
    g = G.gen(c["seed"])
    B, S, K, PS, IR = c["B"], c["S"], c["K"], c["PS"], c["IR"]
    L = torch.tensor(c["L"], dtype=torch.int32)
    tk = G.topk(L, S, K, g, fill=c["fill"], hole=c["hole"], dup=c["dup"], future=c["future"],
                beyond=IR if c["beyond"] else 0)
    if c["garbage"]:
        pool_ids, i2s, lru = G.garbage_state(B, PS, IR, g)
    else:
        pool_ids, i2s, lru = G.pool_state(B, PS, IR, g, fill=c["pool_fill"], prefer=tk)
    F = c["F"]
    full_kv, full_rope = G.payload((B, F, c["D"]), c["dtype"], g), G.payload((B, F, c["Dr"]), c["dtype"], g)
    # pool content consistent with the metadata (docs/ops.md §8 hypothesis), garbage elsewhere
    pool_kv, pool_rope = G.payload((B, PS, c["D"]), c["dtype"], g), G.payload((B, PS, c["Dr"]), c["dtype"], g)
    if not c["garbage"]:
        for b in range(B):
            ids = pool_ids[b].long()
            ok = (ids >= 0) & (ids < F)
            pool_kv[b, ok] = full_kv[b, ids[ok]]
            pool_rope[b, ok] = full_rope[b, ids[ok]]
    return L, tk, pool_ids, i2s, lru, full_kv, full_rope, pool_kv, pool_rope


@given(c=group_step())
def test_plan_serve_install_pipeline(c):
    B, S, K, PS, IR, sbs = c["B"], c["S"], c["K"], c["PS"], c["IR"], c["sbs"]
    note(f"geometry {dict((k, v) for k, v in c.items() if k != 'L')} L={c['L']}")
    L, tk, pool_ids, i2s, lru, full_kv, full_rope, pool_kv, pool_rope = _make_step(c)
    meta0 = (pool_ids.clone(), i2s.clone(), lru.clone())

    # ---- dsa_plan: C++ == reference == literal docs/ops.md §2.4
    plan, rec, act = plan_op(tk, L, pool_ids, i2s, lru, raw_seq=S)
    rplan, rrec, ract = MP.reference_dsa_plan(tk, L, pool_ids, i2s, lru, raw_seq=S)
    assert torch.equal(plan, rplan) and torch.equal(rec, rrec) and torch.equal(act, ract)
    lplan, lact, lrecs = literal_plan(tk, L, i2s, PS, S)
    assert torch.equal(plan, lplan) and torch.equal(act, lact)
    got_recs, counts = records_as_dict(rec, B, S, K)
    assert got_recs == lrecs  # §8.3: records = kind-2 rows per microtask, in order, set = x & (NS-1)
    assert all(int(counts[mt]) == 0 for mt in range(B * S * 8) if mt not in lrecs)
    assert bool((rec[records_layout_required(B, S, K):] == 0).all())  # the +4095 slack stays zero
    kinds = plan[:, 0].view(B * S, K)
    if c["hole"] == 0 and c["future"] == 0 and not c["beyond"]:  # suffix-padded rows (§8.2, §8.8)
        first_neg = torch.where((tk.view(B * S, K) < 0).any(1),
                                (tk.view(B * S, K) < 0).int().argmax(1), torch.full((B * S,), K))
        served = (kinds >= 1) & (kinds <= 3)
        assert torch.equal(served.sum(1).to(torch.int32), act)
        assert bool((served == (torch.arange(K) < act.unsqueeze(1).long())).all())
        empty_rows = act == 0
        assert bool(((act.long() == first_neg) | empty_rows).all())
    assert torch.equal(pool_ids, meta0[0]) and torch.equal(i2s, meta0[1]) and torch.equal(lru, meta0[2])

    # ---- dsa_serve: C++ == reference, §8.1
    rows = B * S * K
    nb = rows // sbs
    guard_kv = torch.full((nb + 2, sbs, c["D"]), float("nan"), dtype=c["dtype"])
    guard_rope = torch.full((nb + 2, sbs, c["Dr"]), float("nan"), dtype=c["dtype"])
    sel_kv, sel_rope = guard_kv[1:-1], guard_rope[1:-1]  # views inside NaN guard blocks
    kw = dict(raw_seq=S, topk=K, selection_block_size=sbs)
    serve_op(plan, full_kv, full_rope, pool_kv, pool_rope, sel_kv, sel_rope, **kw)
    ref_kv, ref_rope = torch.empty_like(sel_kv), torch.empty_like(sel_rope)
    MS.reference_dsa_serve(plan, full_kv, full_rope, pool_kv, pool_rope, ref_kv, ref_rope, **kw)
    assert torch.equal(bits(sel_kv), bits(ref_kv)) and torch.equal(bits(sel_rope), bits(ref_rope))
    for t in (guard_kv, guard_rope):
        assert bool(t[0].isnan().all() and t[-1].isnan().all()), "serve wrote outside the selection buffer"
    flat_kv, flat_rope = sel_kv.flatten(0, 1), sel_rope.flatten(0, 1)  # [rows, D] (D may be 0)
    ids = tk.reshape(B * S, K).long()
    b_of = (torch.arange(B * S) // S).unsqueeze(1).expand(-1, K)
    k = kinds.reshape(-1)
    take = (k >= 1) & (k <= 3)
    if not c["garbage"]:  # §8.1 needs the pool invariant
        src_ok = take & (ids.reshape(-1) < c["F"])
        want_kv = full_kv[b_of.reshape(-1)[src_ok], ids.reshape(-1)[src_ok]]
        assert torch.equal(bits(flat_kv[src_ok]), bits(want_kv))
        assert torch.equal(bits(flat_rope[src_ok]), bits(full_rope[b_of.reshape(-1)[src_ok], ids.reshape(-1)[src_ok]]))
    assert bool((bits(flat_kv[~take]) == 0).all() and (bits(flat_rope[~take]) == 0).all())

    # ---- dsa_install: metadata_update 0 then 1 (the group's order), C++ == reference == literal §4.2
    table = torch.arange(rows // sbs, dtype=torch.int32).view(B * S, K // sbs)
    outs = {}
    for mu in (0, 1):
        states = []
        for impl in ("cpp", "ref", "literal"):
            pkv, prope = pool_kv.clone(), pool_rope.clone()
            pid, i2, lr = pool_ids.clone(), i2s.clone(), lru.clone()
            ikw = dict(raw_seq=S, topk=K, selection_block_size=sbs, metadata_update=mu)
            if impl == "cpp":
                install_op(rec, sel_kv, sel_rope, table, pkv, prope, pid, i2, lr, **ikw)
            elif impl == "ref":
                MI.reference_dsa_install(rec, sel_kv, sel_rope, table, pkv, prope, pid, i2, lr, **ikw)
            else:
                literal_install(rec, sel_kv, sel_rope, pkv, prope, pid, i2, lr, S, K, sbs, mu)
            states.append((bits(pkv), bits(prope), pid, i2, lr))
        for a, b in zip(states[0], states[1]):
            assert torch.equal(a, b)
        for a, b in zip(states[0], states[2]):
            assert torch.equal(a, b)
        outs[mu] = states[0]
    # §8.6: metadata_update=0 leaves the metadata bit-identical and writes the mu=1 payload
    assert torch.equal(outs[0][2], pool_ids) and torch.equal(outs[0][3], i2s) and torch.equal(outs[0][4], lru)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    if not c["garbage"]:
        _check_pool_after_install(c, tk, L, kinds, ids, outs[1], pool_ids, lru, full_kv)


def records_layout_required(B, S, K) -> int:
    from offload_passes.custom_ops._records import records_layout

    return records_layout(B, S, K).required


def _check_pool_after_install(c, tk, L, kinds, ids, after, pid0, lru0, full_kv):
    """§8.4 pool consistency, §8.5 content, §8.7 install accounting (per batch row)."""
    B, S, K, PS, IR = c["B"], c["S"], c["K"], c["PS"], c["IR"]
    NS = PS // 16
    pkv_bits, _, pid, i2s, lru = after
    pkv = pkv_bits.view(full_kv.dtype)
    assert bool(((lru >= 0) & (lru <= 15)).all())
    for b in range(B):
        row_ids = pid[b].tolist()
        resident = {x: s for s, x in enumerate(row_ids) if x >= 0}
        assert len(resident) == sum(x >= 0 for x in row_ids), "an id appears twice in pool_ids"
        for x, slot in resident.items():
            assert int(i2s[b, x]) == slot and slot // 16 == (x & (NS - 1))
            if x < c["F"]:
                assert torch.equal(bits(pkv[b, slot]), bits(full_kv[b, x]))  # §8.5
        mapped = (i2s[b] >= 0).nonzero().flatten().tolist()
        assert sorted(mapped) == sorted(resident), "id_to_slot and pool_ids are not inverse"
        # §8.7: installed ids = distinct kind-2 ids (first occurrence); the counter of each set moves by
        # the number of installs into it (mod 16); each is resident unless evicted within the call
        kb = kinds[b * S:(b + 1) * S].reshape(-1)
        xb = ids[b * S:(b + 1) * S].reshape(-1)
        miss = xb[kb == 2]
        miss = miss[G.first_occurrence(miss)] if miss.numel() else miss
        miss = miss[miss < IR]
        per_set = torch.bincount(miss & (NS - 1), minlength=NS) if miss.numel() else torch.zeros(NS, dtype=torch.long)
        assert torch.equal((lru0[b].long() + per_set) % 16, lru[b].long())
        for st_ in range(NS):
            in_set = [int(x) for x in miss if (int(x) & (NS - 1)) == st_]
            for x in in_set[-16:]:  # the last 16 of a set survive the call
                assert x in resident, (b, x)


# --------------------------------------------------------------------------------------------
# gather ledger
# --------------------------------------------------------------------------------------------

@st.composite
def gather_case(draw):
    small = draw(st.booleans())
    K = draw(st.sampled_from([8, 16, 32])) if small else draw(st.sampled_from([64, 128, 256]))
    return dict(
        seed=draw(st.integers(0, 2 ** 31 - 1)), K=K, small=small,
        B=draw(st.integers(1, 3)), S=draw(st.integers(1, 4)),
        bsz=draw(st.sampled_from([1, 2, 4, 8, 16])) if small else 1,
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.int8])),
        # the no-rope mode in both forms: a 1-D empty rope, or a zero-width 3-D one (docs/ops.md §1.2)
        rope=draw(st.sampled_from(["3d", "1d", "zero"])), layout=draw(st.sampled_from(["BSND", "TND"])),
        steps=draw(st.integers(1, 3)),
        hole=draw(st.sampled_from([0.0, 0.5])), dup=draw(st.sampled_from([0.0, 0.5])),
        future=draw(st.sampled_from([0.0, 0.5])), garbage_status=draw(st.booleans()),
    )


@given(c=gather_case())
def test_gather_ledger(c):
    note(str(c))
    case = TG.Case(c["seed"], K=c["K"], B=c["B"], S=c["S"], bsz=c["bsz"], dtype=c["dtype"],
                   no_rope=c["rope"] == "1d", layout=c["layout"], D=4, Dr=0 if c["rope"] == "zero" else 2)
    if c["garbage_status"]:
        case.status = TG.garbage_status(case.B, case.S, case.K, case.bsz, case.L, case.g)
    # §8.9 holds for contract-abiding rows and a truthful previous ledger (a garbage ledger "keeps" ids
    # whose data was never gathered; C++ == reference is still checked for it)
    contract = c["hole"] == 0 and c["dup"] == 0 and c["future"] == 0 and not c["garbage_status"]
    for step in range(c["steps"]):
        topk = case.next_topk(hole=c["hole"], dup=c["dup"], future=c["future"])
        before_kv, before_rope = case.sel_kv.clone(), case.sel_rope.clone()
        act = TG.run_both(case, topk, f"step {step}")  # C++ == reference, bit-exact, whole state
        if contract and not c["small"]:
            TG._check_ledger_large(case, topk, act, before_kv, before_rope)  # §8.9
        case.advance()


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------

def _valid(op: str, g: torch.Generator) -> tuple[dict, dict, tuple]:
    """A small valid call: (tensor args by name, int kwargs, names of the mutated arguments)."""
    i32 = torch.int32
    B, S, K, PS, IR, sbs, F, D, Dr = 2, 2, 64, 32, 100, 16, 40, 4, 2
    L = torch.tensor([30, 50], dtype=i32)
    tk = G.topk(L, S, K, g)
    pid, i2s, lru = G.pool_state(B, PS, IR, g, prefer=tk)
    if op == "dsa_plan":
        return (dict(selection_topk_indices=tk, full_kv_actual_seq=L, pool_ids=pid, id_to_slot=i2s,
                     lru_counter=lru), dict(raw_seq=S), ())
    bf = torch.bfloat16
    if op == "dsa_serve":
        plan, _, _ = plan_op(tk, L, pid, i2s, lru, raw_seq=S)
        return (dict(plan=plan, full_kv_cache=G.payload((B, F, D), bf, g), full_k_rope=G.payload((B, F, Dr), bf, g),
                     pool_kv_cache=G.payload((B, PS, D), bf, g), pool_k_rope=G.payload((B, PS, Dr), bf, g),
                     selection_kv_cache=torch.zeros(B * S * K // sbs, sbs, D, dtype=bf),
                     selection_k_rope=torch.zeros(B * S * K // sbs, sbs, Dr, dtype=bf)),
                dict(raw_seq=S, topk=K, selection_block_size=sbs, compact_layout=1),
                ("selection_kv_cache", "selection_k_rope"))
    if op == "dsa_install":
        _, rec, _ = plan_op(tk, L, pid, i2s, lru, raw_seq=S)
        return (dict(install_records=rec, selection_kv_cache=G.payload((B * S * K // sbs, sbs, D), bf, g),
                     selection_k_rope=G.payload((B * S * K // sbs, sbs, Dr), bf, g),
                     selection_kv_block_table=torch.arange(B * S * K // sbs, dtype=i32).view(B * S, K // sbs),
                     pool_kv_cache=G.payload((B, PS, D), bf, g), pool_k_rope=G.payload((B, PS, Dr), bf, g),
                     pool_ids=pid, id_to_slot=i2s, lru_counter=lru),
                dict(raw_seq=S, topk=K, selection_block_size=sbs, metadata_update=1),
                ("pool_kv_cache", "pool_k_rope", "pool_ids", "id_to_slot", "lru_counter"))
    case = TG.Case(int(torch.randint(0, 2 ** 30, (1,), generator=g)), K=64, B=2, S=2, bsz=1,
                   dtype=bf, no_rope=False, layout="BSND", D=4, Dr=2)
    a = case.args(case.next_topk())
    names = ("selection_k_rope", "selection_kv_cache", "selection_kv_block_table", "selection_kv_block_status",
             "selection_topk_indices", "full_k_rope", "full_kv_cache", "full_kv_block_table",
             "full_kv_actual_seq", "full_q_actual_seq")
    return (dict(zip(names, [t.clone() for t in a])), dict(selection_topk_block_size=1),
            ("selection_k_rope", "selection_kv_cache", "selection_kv_block_table", "selection_kv_block_status"))


_OPS = {"dsa_plan": plan_op, "dsa_serve": serve_op, "dsa_install": install_op,
        "npu_gather_selection_kv_cache": gather_op}
_INT_LIMITS = {  # (argument, values that are out of the documented range)
    "dsa_plan": {"raw_seq": [0, 5, -1, 3]},
    "dsa_serve": {"raw_seq": [0, 5], "topk": [0, -8, 4096, 60], "selection_block_size": [0, 8, 24, 256],
                  "compact_layout": [2, -1]},
    "dsa_install": {"raw_seq": [0, 5], "topk": [0, 4096, 60], "selection_block_size": [0, 8, 24, 256],
                    "metadata_update": [2, -1]},
    "npu_gather_selection_kv_cache": {"selection_topk_block_size": [2, 3, 128]},
}
_INDEX_TABLES = {"npu_gather_selection_kv_cache": ("selection_kv_block_table", "full_kv_block_table")}


@st.composite
def bad_call(draw):
    op = draw(st.sampled_from(sorted(_OPS)))
    kind = draw(st.sampled_from(["dtype", "rank", "size", "int", "empty_batch", "index", "noncontig"]))
    if kind == "index":
        assume(op in _INDEX_TABLES)
    return dict(op=op, kind=kind, seed=draw(st.integers(0, 2 ** 31 - 1)), pick=draw(st.integers(0, 10 ** 6)),
                delta=draw(st.sampled_from([-1, 1, 2])), neg=draw(st.sampled_from([-2, -5, -(2 ** 31)])))


def _mutate(c, tensors: dict, ints: dict):
    """Apply one defect; return (argument name, must_raise)."""
    names = sorted(tensors)
    pick = c["pick"]
    kind = c["kind"]
    if kind == "int":
        arg = sorted(_INT_LIMITS[c["op"]])[pick % len(_INT_LIMITS[c["op"]])]
        vals = _INT_LIMITS[c["op"]][arg]
        ints[arg] = vals[(pick // 7) % len(vals)]
        return arg, True
    if kind == "index":  # an entry the op dereferences (entries it never reads may hold anything)
        bad = c["neg"] if pick % 2 else 10 ** 6
        topk = tensors["selection_topk_indices"].reshape(-1, tensors["selection_topk_indices"].size(-1))
        B = tensors["full_kv_block_table"].size(0)
        S = topk.size(0) // B
        L_ = tensors["full_kv_actual_seq"]
        live = [r for r in range(B * S) if int(L_[r // S]) - (S - 1 - r % S) > 0 and bool((topk[r] >= 0).any())]
        assume(live)
        r = live[(pick // 5) % len(live)]
        if (pick // 3) % 2:
            arg = "selection_kv_block_table"
            sbs = tensors["selection_kv_cache"].size(1)
            need = -(-topk.size(1) // sbs)
            tensors[arg][r, (pick // 7) % need] = bad
        else:
            arg = "full_kv_block_table"
            row = topk[r]
            ms = int(L_[r // S]) - (S - 1 - r % S) - 1
            ids = row[(row >= 0) & (row <= ms)]
            assume(ids.numel() > 0)
            x = int(ids[(pick // 7) % ids.numel()])
            tensors[arg][r // S, x // tensors["full_kv_cache"].size(1)] = bad
        return arg, True
    arg = names[pick % len(names)]
    t = tensors[arg]
    if kind == "dtype":
        new = {torch.int32: torch.int64, torch.int8: torch.int32, torch.bfloat16: torch.float32,
               torch.float16: torch.float32}[t.dtype]
        tensors[arg] = t.to(new)
        return arg, True
    if kind == "rank":
        tensors[arg] = t.unsqueeze(0) if pick % 2 else (t.reshape(-1) if t.dim() > 1 else t.reshape(1, -1))
        return arg, not (t.dim() == 1 and t.numel() == 0)  # an empty 1-D rope stays "no rope" (int8 mode)
    if kind == "size":
        dim = (pick // 11) % t.dim()
        size = list(t.shape)
        size[dim] = max(size[dim] + c["delta"], 0)
        tensors[arg] = torch.zeros(size, dtype=t.dtype) if t.is_floating_point() else torch.full(size, -1, dtype=t.dtype)
        return arg, None  # may stay legal: then it must match the reference
    if kind == "empty_batch":
        for n, x in tensors.items():
            if x.dim() >= 1 and x.numel():
                sz = list(x.shape)
                sz[0] = 0
                tensors[n] = x.new_zeros(sz)
        return None, True
    # noncontig: same values through a transposed / strided view
    if t.dim() >= 2 and t.size(-1) > 1 and t.size(-2) > 1:
        tensors[arg] = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif t.numel() > 1:
        tensors[arg] = torch.stack([t, t], -1).select(-1, 0)
    else:
        assume(False)
    assert not tensors[arg].is_contiguous()
    return arg, None


def _snapshot(tensors: dict) -> dict:
    return {n: t.clone() for n, t in tensors.items()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8) if a.numel() else a, b.contiguous().view(torch.uint8) if b.numel() else b)


@given(c=bad_call())
def test_bad_input_is_refused_by_name(c):
    op, kind = c["op"], c["kind"]
    g = G.gen(c["seed"])
    tensors, ints, mutated = _valid(op, g)
    arg, must_raise = _mutate(c, tensors, ints)
    note(f"{op}: {kind} on {arg} -> {[(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]} {ints}")
    before = _snapshot(tensors)
    # the mutated (in-place) outputs live inside guard buffers: nothing may be written around them
    guards = {}
    for n in mutated:
        t = tensors[n]
        if t.is_contiguous() and t.numel():
            buf = torch.full((t.numel() + 64,), -7, dtype=t.dtype)
            buf[32:-32] = t.reshape(-1)
            tensors[n] = buf[32:-32].view(t.shape)
            guards[n] = buf
    try:
        out = _OPS[op](*tensors.values(), **ints)
    except RuntimeError as e:
        msg = str(e)
        assert msg.startswith(f"custom::{op}"), msg
        if arg is not None:
            assert arg in msg, f"error does not name {arg}: {msg}"
        else:  # empty batch: the first emptied argument the op checks is named
            assert any(n in msg for n in tensors), msg
        for n, t in tensors.items():  # nothing half-updated
            assert _same(t, before[n]), f"{n} changed although the call raised"
    else:
        assert must_raise is not True, f"custom::{op} accepted {kind} on {arg}"
        # legal after all: must be what the reference gives on the same (contiguous) inputs
        ref = {n: t.clone().contiguous() for n, t in before.items()}
        ref_fn = {"dsa_plan": lambda: MP.reference_dsa_plan(*ref.values(), **ints),
                  "dsa_serve": lambda: MS.reference_dsa_serve(*ref.values(), **ints),
                  "dsa_install": lambda: MI.reference_dsa_install(*ref.values(), **ints),
                  "npu_gather_selection_kv_cache":
                      lambda: MG.reference_npu_gather_selection_kv_cache(*ref.values(), **ints)}[op]
        rout = ref_fn()
        outs = out if isinstance(out, tuple) else (out,)
        routs = rout if isinstance(rout, tuple) else (rout,)
        for a, b in zip(outs, routs):
            if a is not None and not (op == "npu_gather_selection_kv_cache"):
                assert _same(a, b)
        for n in tensors:
            if n in mutated or op == "npu_gather_selection_kv_cache" and n == "selection_kv_block_status":
                assert _same(tensors[n], ref[n]), n
            else:
                assert _same(tensors[n], before[n]), f"read-only {n} was modified"
    for n, buf in guards.items():
        assert bool((buf[:32] == -7).all() and (buf[-32:] == -7).all()), f"{op} wrote outside {n}"


# Regressions found by the bad-input strategy: a cross-argument check named only the tensor it
# compared, not the one the limit came from (e.g. a wrong full_kv_cache batch reported as "plan rows").
def _regression_cases():
    def serve_b(t, i):
        t["full_kv_cache"] = t["full_kv_cache"][:1].clone()
    def serve_dkv(t, i):
        t["full_kv_cache"] = torch.zeros(2, 40, 5, dtype=torch.bfloat16)
    def plan_b(t, i):
        t["selection_topk_indices"] = torch.cat([t["selection_topk_indices"]] * 2)
    def install_b(t, i):
        t["pool_kv_cache"] = torch.cat([t["pool_kv_cache"]] * 2)
    def gather_k(t, i):
        t["selection_topk_indices"] = t["selection_topk_indices"][..., :-1].clone()
    def gather_blocks(t, i):
        t["selection_kv_block_table"] = torch.cat([t["selection_kv_block_table"]] * 2, 1)
    return [("dsa_serve", serve_b, "full_kv_cache"), ("dsa_serve", serve_dkv, "full_kv_cache"),
            ("dsa_plan", plan_b, "selection_topk_indices"), ("dsa_install", install_b, "pool_kv_cache"),
            ("npu_gather_selection_kv_cache", gather_k, "selection_topk_indices"),
            ("npu_gather_selection_kv_cache", gather_blocks, "selection_kv_block_table")]


@pytest.mark.parametrize("op,mutate,name", _regression_cases(), ids=lambda v: getattr(v, "__name__", None))
def test_cross_argument_errors_name_the_source(op, mutate, name):
    tensors, ints, _ = _valid(op, G.gen(7))
    mutate(tensors, ints)
    with pytest.raises(RuntimeError) as e:
        _OPS[op](*tensors.values(), **ints)
    assert str(e.value).startswith(f"custom::{op}: ") and name in str(e.value), str(e.value)

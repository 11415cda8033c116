"""custom::dsa_plan: schema, fake, opcheck, exact semantics (docs/ops.md §2), C++ == reference, limits."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, os.path.dirname(__file__))
import _gen as G  # noqa: E402

from offload_passes.custom_ops import _library as Lib  # noqa: E402
from offload_passes.custom_ops import dsa_plan as M  # noqa: E402
from offload_passes.custom_ops._records import decode_records, record_counts, records_layout  # noqa: E402
from offload_passes.custom_ops.plan_kind import NUM_PLAN_KINDS  # noqa: E402

plan_op = torch.ops.custom.dsa_plan


@pytest.fixture(scope="module", autouse=True)
def cpp_kernel():
    """Build/load the C++ kernel once for the module (cached on disk across sessions)."""
    return Lib.cpu_op("dsa_plan")


# ------------------------------------------------------------------------------------------------
# Independent oracle: a literal scalar transcription of the docs/ops.md §2.4 pseudo-code (no vectorisation),
# used to check the vectorised reference, which in turn is the oracle of the C++ kernel.
# ------------------------------------------------------------------------------------------------

def literal_plan(topk, L, id_to_slot, PS, S):
    B, K = topk.size(0), topk.size(-1)
    P, NS, IR = K // 8, PS // 16, id_to_slot.size(1)
    rows = topk.reshape(B * S, K).tolist()
    lens, i2s = L.tolist(), id_to_slot.tolist()
    plan = [[0, 0] for _ in range(B * S * K)]
    act = [0] * (B * S)
    recs = {}

    def slot_of(b, x):
        if x < 0 or x >= IR:
            return -1
        v = i2s[b][x]
        return v if 0 <= v < PS else -1

    for b in range(B):
        for s in range(S):
            r, Lb, row = b * S + s, lens[b], rows[b * S + s]
            mv, ms = max(Lb - S - 1, 0), Lb - (S - 1 - s) - 1
            empty = Lb <= 0 or ms < 0
            if not empty:
                n = 0
                for x in row:
                    if x < 0:
                        break
                    n += x <= ms
                act[r] = n
            for m in range(8):
                stopped = m > 0 and row[m * P - 1] < 0
                for k in range(m * P, m * P + P):
                    x, q = row[k], r * K + k
                    if stopped:
                        plan[q] = [0, -1]
                    elif x < 0:
                        plan[q] = [5, x]
                        stopped = True
                    elif empty or x > ms:
                        plan[q] = [4, x]
                    else:
                        sl = slot_of(b, x)
                        if sl >= 0 and x <= mv:
                            plan[q] = [1, sl]
                        elif x > mv:
                            plan[q] = [3, x]
                        else:
                            plan[q] = [2, x]
                            recs.setdefault(r * 8 + m, []).append([x & (NS - 1), x, s, k])
    return torch.tensor(plan, dtype=torch.int32), torch.tensor(act, dtype=torch.int32), recs


def records_as_dict(records, B, S, K):
    rows, counts = decode_records(records, B, S, K)
    out = {}
    for mt, st, x, sq, pos in rows.tolist():
        out.setdefault(mt, []).append([st, x, sq, pos])
    return out, counts


# ------------------------------------------------------------------------------------------------
# Random cases
# ------------------------------------------------------------------------------------------------

@G._single_threaded
def random_case(seed: int, max_elems: int = 32768):
    """A random plan input spanning the test matrix (B 1-8, S 1-4, K in {64,512,2048}, PS in {256,8192,16384})."""
    g = G.gen(seed)
    K = [64, 512, 2048][seed % 3]
    S = G._randint(1, 4, g)
    B = G._randint(1, max(1, min(8, max_elems // (S * K))), g)
    PS = [256, 8192, 16384][(seed // 3) % 3]
    IR = G._randint(max(16, K // 2), 3 * K, g)  # modest; sometimes below L so ids >= IR occur
    L = G.lengths(B, S, K, g, lo=-2 if seed % 7 == 0 else 1, hi=3 * K)
    prev = G.topk(L.clamp(min=0) - S, S, K, g, reuse=0.0) if seed % 5 else None
    tk = G.topk(
        L, S, K, g, prev=prev, reuse=0.8,
        fill=1.0 if seed % 4 else 0.5,
        hole=0.3, future=0.2, dup=0.3, beyond=IR if seed % 2 else 0,
    )
    if seed % 3 == 2:
        pid, i2s, lru = G.garbage_state(B, PS, IR, g)
    else:
        pid, i2s, lru = G.pool_state(B, PS, IR, g, fill=0.7, prefer=prev)
    return tk, L, pid, i2s, lru, S


@pytest.mark.parametrize("chunk", range(4))
def test_cpp_matches_reference_bit_exact(chunk, cpp_kernel):
    """>= 200 random cases (4 chunks x 55): plan, records (all bytes) and actual_seq bit-identical."""
    kinds = torch.zeros(NUM_PLAN_KINDS, dtype=torch.int64)
    nthreads = torch.get_num_threads()
    with G.single_thread():  # much faster on a loaded 2-core box
        for seed in range(chunk * 55, chunk * 55 + 55):
            tk, L, pid, i2s, lru, S = random_case(seed)
            ref = M.reference_dsa_plan(tk, L, pid, i2s, lru, raw_seq=S)
            outs = [plan_op(tk, L, pid, i2s, lru, raw_seq=S)]
            if seed % 4 == 0:  # one work item per task with the default thread count: a real split
                with G.threads(nthreads):
                    outs.append(cpp_kernel(tk, L, pid, i2s, lru, S, 0, 0, 0, 1))  # grain 1
            for out in outs:
                for name, a, b in zip(("plan", "install_records", "actual_seq"), ref, out):
                    assert a.dtype == b.dtype and a.shape == b.shape, (seed, name)
                    assert torch.equal(a, b), f"seed {seed}: {name} differs"
            kinds += torch.bincount(ref[0][:, 0].long(), minlength=NUM_PLAN_KINDS)
    # the random matrix must exercise every source kind
    assert bool((kinds > 0).all()), kinds


@pytest.mark.parametrize("seed", range(0, 18))
def test_reference_matches_literal_spec(seed):
    """The vectorised reference equals a literal transcription of docs/ops.md §2.4 (plan, act, records, counts)."""
    tk, L, pid, i2s, lru, S = random_case(seed, max_elems=4096)
    B, K, PS = tk.size(0), tk.size(-1), pid.size(1)
    with G.single_thread():
        plan, records, act = M.reference_dsa_plan(tk, L, pid, i2s, lru, raw_seq=S)
        lplan, lact, lrecs = literal_plan(tk, L, i2s, PS, S)
    assert torch.equal(plan, lplan)
    assert torch.equal(act, lact)
    recs, counts = records_as_dict(records, B, S, K)
    assert recs == lrecs
    expect_counts = torch.tensor([len(lrecs.get(mt, [])) for mt in range(B * S * 8)])
    assert torch.equal(counts, expect_counts)
    lay = records_layout(B, S, K)
    assert records.numel() == lay.alloc
    # nothing outside [0, required) is written, and inside every slab only the first `count` records
    assert int(records[lay.required :].abs().sum()) == 0
    words = records[: lay.required].view(torch.int32)
    slabs = words[: lay.rec_bytes // 4].view(B * S * 8, lay.stride // 16, 4)
    used = torch.arange(lay.stride // 16).unsqueeze(0) < counts.unsqueeze(1)
    assert int(slabs[~used].abs().sum()) == 0
    cells = words[lay.rec_bytes // 4 :].view(-1, 8)
    assert int(cells[:, 1:].abs().sum()) == 0 and int(cells[B * S * 8 :].abs().sum()) == 0


# ------------------------------------------------------------------------------------------------
# Hand-checked semantics
# ------------------------------------------------------------------------------------------------

def _state(B, PS, IR, resident=()):
    """Empty pool metadata with ``resident`` = [(b, id, slot)] entries."""
    pid = torch.full((B, PS), -1, dtype=torch.int32)
    i2s = torch.full((B, IR), -1, dtype=torch.int32)
    for b, x, sl in resident:
        pid[b, sl] = x
        i2s[b, x] = sl
    lru = torch.zeros(B, PS // 16, dtype=torch.int32)
    return pid, i2s, lru


def test_kinds_hand_example():
    """B=1, S=2, K=64 (P=8), L=20: max_valid=17, max_sel = 18 (s=0) / 19 (s=1)."""
    K, PS, IR = 64, 256, 100
    pid, i2s, lru = _state(1, PS, IR, [(0, 5, 81), (0, 18, 33), (0, 7, 300 % PS)])
    i2s[0, 9] = PS  # out-of-range slot -> not a hit
    tk = torch.full((1, 2, 1, K), -1, dtype=torch.int32)
    tk[0, 0, 0, :7] = torch.tensor([5, 17, 18, 19, 9, 7, 5])
    tk[0, 1, 0, :5] = torch.tensor([19, 3, 5, 20, 18])
    L = torch.tensor([20], dtype=torch.int32)
    plan, records, act = plan_op(tk, L, pid, i2s, lru, raw_seq=2)
    p = plan.view(2, K, 2)
    assert p[0, :8].tolist() == [[1, 81], [2, 17], [3, 18], [4, 19], [2, 9], [1, 300 % PS], [1, 81], [5, -1]]
    # microtasks 1..7: the previous microtask ends with -1 (one-element look-back) -> INVALID
    assert p[0, 8:].tolist() == [[0, -1]] * 56
    assert p[1, :6].tolist() == [[3, 19], [2, 3], [1, 81], [4, 20], [3, 18], [5, -1]]
    # FUTURE_SKIP (19 for s=0, 20 for s=1) is not counted; duplicates (5 twice) are
    assert act.tolist() == [6, 4]
    rows, counts = decode_records(records, 1, 2, K)
    assert rows.tolist() == [[0, 17 & 15, 17, 0, 1], [0, 9, 9, 0, 4], [8, 3, 3, 1, 1]]
    assert counts.tolist() == [2] + [0] * 7 + [1] + [0] * 7


def test_every_microtask_of_a_padded_row_stops():
    """Suffix padding: the first -1 of every microtask is a NEGATIVE_STOP unless the previous ends negative."""
    K = 64
    pid, i2s, lru = _state(1, 256, 64)
    tk = torch.full((1, 1, 1, K), -1, dtype=torch.int32)
    tk[0, 0, 0, :3] = torch.tensor([0, 1, 2])
    plan, _, act = plan_op(tk, torch.tensor([10], dtype=torch.int32), pid, i2s, lru)
    kinds = plan[:, 0].view(8, 8)
    assert kinds[0].tolist() == [2, 2, 2, 5, 0, 0, 0, 0]
    # microtasks 1..7: previous microtask ends with -1 -> INVALID from the first entry (look-back)
    assert kinds[1:].eq(0).all()
    assert act.tolist() == [3]


def test_non_suffix_negative_resumes_in_next_microtask():
    """A -1 in the middle: classification resumes at the next microtask unless its look-back is negative."""
    K, P = 64, 8
    pid, i2s, lru = _state(1, 256, 64)
    row = torch.arange(K, dtype=torch.int32)
    row[3] = -1  # inside microtask 0 -> rest of mt 0 INVALID, mt 1 resumes
    row[2 * P - 1] = -2  # last entry of mt 1 -> mt 2 fully INVALID (one-element look-back)
    row[3 * P + 1] = -3  # inside mt 3; mt 4 resumes (look-back = row[4P-1] >= 0)
    tk = row.view(1, 1, 1, K)
    L = torch.tensor([100], dtype=torch.int32)
    plan, records, act = plan_op(tk, L, pid, i2s, lru)
    kinds = plan[:, 0].view(8, P)
    assert kinds[0].tolist() == [2, 2, 2, 5, 0, 0, 0, 0]
    assert kinds[1].tolist() == [2] * 7 + [5]
    assert kinds[2].tolist() == [0] * 8
    assert kinds[3].tolist() == [2, 5] + [0] * 6
    assert kinds[4:].eq(2).all()
    assert plan[2 * P : 3 * P, 1].eq(-1).all() and plan[2 * P - 1].tolist() == [5, -2]
    assert act.tolist() == [3]  # actual_seq stops at the first negative
    _, counts = decode_records(records, 1, 1, K)
    assert counts.tolist() == [3, 7, 0, 1, 8, 8, 8, 8]


def test_empty_rows_and_reuse_clamp():
    """L <= 0 or max_sel < 0: everything FUTURE_SKIP (then stop), act 0. L <= S: id 0 still reusable."""
    K, S = 64, 3
    pid, i2s, lru = _state(3, 256, 64, [(2, 0, 16)])
    tk = torch.full((3, S, 1, K), -1, dtype=torch.int32)
    tk[:, :, 0, 0] = 0
    tk[:, :, 0, 1] = 1
    L = torch.tensor([0, 2, 2], dtype=torch.int32)  # b=1,2: max_sel = -1, 0, 1 for s = 0, 1, 2
    plan, _, act = plan_op(tk, L, pid, i2s, lru, raw_seq=S)
    p = plan.view(3, S, K, 2)
    assert p[0, :, :2, 0].eq(4).all() and act[:3].tolist() == [0, 0, 0]
    assert p[1, 0, :3].tolist() == [[4, 0], [4, 1], [5, -1]]  # max_sel < 0: empty row
    assert p[1, 1, :3].tolist() == [[2, 0], [4, 1], [5, -1]]  # id 0 <= max_valid (clamped to 0): miss
    assert p[1, 2, :3].tolist() == [[2, 0], [3, 1], [5, -1]]  # id 1 = this step's token: window
    assert p[2, 1, :2].tolist() == [[1, 16], [4, 1]]  # resident id 0 is a hit
    assert act.tolist() == [0, 0, 0, 0, 1, 2, 0, 1, 2]


def test_ids_beyond_id_range_and_stale_slots():
    """ids >= IR are never hits (always FULL_OLD_MISS with a record); slot values outside [0, PS) are misses."""
    K, PS, IR = 64, 256, 10
    pid, i2s, lru = _state(1, PS, IR)
    i2s[0, 1] = -5
    i2s[0, 2] = PS
    i2s[0, 3] = PS - 1
    tk = torch.full((1, 1, 1, K), -1, dtype=torch.int32)
    tk[0, 0, 0, :4] = torch.tensor([10, 1, 2, 3])
    plan, records, _ = plan_op(tk, torch.tensor([50], dtype=torch.int32), pid, i2s, lru)
    assert plan[:4].tolist() == [[2, 10], [2, 1], [2, 2], [1, PS - 1]]
    rows, _ = decode_records(records, 1, 1, K)
    assert rows[:, 2].tolist() == [10, 1, 2]


def test_suffix_padded_invariants_random():
    """docs/ops.md §8.2/§8.3 on contract-respecting rows: kinds 1/2/3 fill exactly [0, act), one stop, then INVALID."""
    for seed in range(6):
        g = G.gen(1000 + seed)
        B, S, K, PS, IR = 3, 2, 512, 256, 4096
        L = G.lengths(B, S, K, g, lo=1, hi=3 * K)
        prev = G.topk(L - S, S, K, g)
        tk = G.topk(L, S, K, g, prev=prev, fill=0.7)
        pid, i2s, lru = G.pool_state(B, PS, IR, g, fill=0.9, prefer=prev)
        plan, records, act = plan_op(tk, L, pid, i2s, lru, raw_seq=S)
        kinds = plan[:, 0].view(B * S, K)
        rows = tk.view(B * S, K)
        valid = (rows >= 0).sum(1)
        assert torch.equal(act, valid.to(torch.int32))
        col = torch.arange(K).unsqueeze(0)
        served = (kinds >= 1) & (kinds <= 3)
        assert torch.equal(served, col < act.unsqueeze(1).long())
        stops = kinds == 5
        assert torch.equal(stops, (col == act.unsqueeze(1).long()) & (act.unsqueeze(1) < K))
        assert kinds[col > act.unsqueeze(1).long()].eq(0).all()
        # hits point at the slot holding that very id (consistent pool)
        hit = kinds.view(-1) == 1
        b_of = torch.arange(B * S * K) // (S * K)
        assert torch.equal(pid[b_of[hit], plan[hit, 1].long()], tk.reshape(-1)[hit])
        assert int(hit.sum()) > 0
        # records: exactly the kind-2 rows per microtask, in order, set = id & (NS-1)
        recs, counts = decode_records(records, B, S, K)
        miss = (kinds.view(-1) == 2).nonzero().squeeze(1)
        r, k = miss // K, miss % K
        expect = torch.stack([r * 8 + k // (K // 8), rows[r, k] & (PS // 16 - 1), rows[r, k], r % S, k], 1)
        assert torch.equal(recs, expect)
        assert torch.equal(record_counts(records, B, S, K).long(), counts)
        assert int(counts.sum()) == miss.numel()


def test_3d_topk_and_reference_mode(monkeypatch):
    """3-D top-k [B, 1, K] with raw_seq=1 equals the 4-D form; OFFLOAD_PASSES_CPU_KERNELS=reference agrees."""
    tk, L, pid, i2s, lru, S = random_case(4)  # K=512
    tk = tk[:, :1]
    out4 = plan_op(tk, L, pid, i2s, lru, raw_seq=1)
    out3 = plan_op(tk.view(tk.size(0), 1, -1), L, pid, i2s, lru, raw_seq=1)
    monkeypatch.setenv("OFFLOAD_PASSES_CPU_KERNELS", "reference")
    outr = plan_op(tk, L, pid, i2s, lru, raw_seq=1)
    for a, b, c in zip(out4, out3, outr):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_fake_shapes():
    with FakeTensorMode():
        tk = torch.empty(4, 4, 1, 2048, dtype=torch.int32)
        L = torch.empty(4, dtype=torch.int32)
        pid = torch.empty(4, 8192, dtype=torch.int32)
        i2s = torch.empty(4, 131072, dtype=torch.int32)
        lru = torch.empty(4, 512, dtype=torch.int32)
        plan, records, act = plan_op(tk, L, pid, i2s, lru, raw_seq=4)
        assert tuple(plan.shape) == (32768, 2) and plan.dtype == torch.int32
        assert tuple(records.shape) == (532479,) and records.dtype == torch.int8
        assert tuple(act.shape) == (16,) and act.dtype == torch.int32
        with pytest.raises(RuntimeError, match="multiple of 64"):
            plan_op(tk[..., :100], L, pid, i2s, lru, raw_seq=4)


def test_records_layout_examples():
    lay = records_layout(4, 4, 2048)
    assert (lay.stride, lay.rec_bytes, lay.cnt_bytes, lay.required, lay.alloc) == (
        4096, 524288, 4096, 528384, 532479)
    lay = records_layout(1, 1, 64)
    assert (lay.stride, lay.rec_bytes, lay.cnt_bytes, lay.alloc, lay.cap) == (4096, 32768, 4096, 40959, 64)


def test_schema_string():
    assert str(plan_op.default._schema) == "custom::" + M.SPEC.schema


OPCHECK_CASES = [  # (B, S, K, PS, IR, seed, 3-D)
    (2, 4, 128, 256, 1024, 0, False),
    (1, 1, 64, 256, 64, 1, True),
    (3, 2, 512, 8192, 2048, 2, False),
    (1, 3, 2048, 256, 8192, 3, False),
]


@pytest.mark.parametrize("B,S,K,PS,IR,seed,three_d", OPCHECK_CASES)
def test_opcheck(B, S, K, PS, IR, seed, three_d):
    g = G.gen(seed)
    L = G.lengths(B, S, K, g, lo=1, hi=min(IR, 2 * K))
    prev = G.topk(L - S, S, K, g)
    tk = G.topk(L, S, K, g, prev=prev, hole=0.3)
    pid, i2s, lru = G.pool_state(B, PS, IR, g, prefer=prev)
    if three_d:
        tk = tk.view(B, 1, K)
    torch.library.opcheck(plan_op.default, (tk, L, pid, i2s, lru), {"raw_seq": S, "group_id": 3})


# ------------------------------------------------------------------------------------------------
# Validation: every limit of docs/ops.md §2.1 once
# ------------------------------------------------------------------------------------------------

def _valid_args():
    B, S, K, PS, IR = 2, 2, 128, 256, 512
    return dict(
        tk=torch.full((B, S, 1, K), -1, dtype=torch.int32),
        L=torch.full((B,), 10, dtype=torch.int32),
        pid=torch.full((B, PS), -1, dtype=torch.int32),
        i2s=torch.full((B, IR), -1, dtype=torch.int32),
        lru=torch.zeros(B, PS // 16, dtype=torch.int32),
        raw_seq=S,
    )


def _i32(*shape):
    return torch.zeros(*shape, dtype=torch.int32)


BAD_PLAN = [
    ("tk", lambda a: a["tk"].to(torch.int64), r"selection_topk_indices must be int32"),
    ("L", lambda a: a["L"].float(), r"full_kv_actual_seq must be int32"),
    ("pid", lambda a: a["pid"].to(torch.int16), r"pool_ids must be int32"),
    ("i2s", lambda a: a["i2s"].to(torch.int64), r"id_to_slot must be int32"),
    ("lru", lambda a: a["lru"].to(torch.uint8), r"lru_counter must be int32"),
    ("tk", lambda a: _i32(2, 256), r"selection_topk_indices must be 3-D or 4-D, got 2-D"),
    ("raw_seq", lambda a: 5, r"raw_seq must be in \[1, 4\], got 5"),
    ("raw_seq", lambda a: 0, r"raw_seq must be in \[1, 4\], got 0"),
    ("tk", lambda a: _i32(0, 2, 1, 128), r"batch dim \(B\) must be > 0, got 0"),
    ("tk", lambda a: _i32(2, 3, 1, 128), r"dim 1 must equal raw_seq=2, got 3"),
    ("tk", lambda a: _i32(2, 2, 2, 128), r"dim 2 \(heads\) must be 1, got 2"),
    ("tk", lambda a: _i32(2, 1, 128), r"raw_seq must be 1 for a 3-D selection_topk_indices, got 2"),
    ("tk", lambda a: _i32(2, 2, 1, 0), r"last dim \(K\) must be > 0, got 0"),
    ("tk", lambda a: _i32(2, 2, 1, 96), r"last dim \(K\) must be a multiple of 64, got 96"),
    ("tk", lambda a: _i32(2, 2, 1, 4096), r"last dim \(K\) must be <= 2048, got 4096"),
    ("L", lambda a: _i32(3), r"full_kv_actual_seq must be 1-D of length B=2, got shape \(3,\)"),
    ("L", lambda a: _i32(2, 1), r"full_kv_actual_seq must be 1-D of length B=2"),
    ("pid", lambda a: _i32(3, 256), r"pool_ids must be \[B=2, PS\], got shape \(3, 256\)"),
    ("pid", lambda a: _i32(2, 32768), r"pool_ids dim 1 \(PS\) must be in \(0, 16384\], got 32768"),
    ("pid", lambda a: _i32(2, 0), r"pool_ids dim 1 \(PS\) must be in \(0, 16384\], got 0"),
    ("pid", lambda a: _i32(2, 40), r"pool_ids dim 1 \(PS\) must be a multiple of 16, got 40"),
    ("pid", lambda a: _i32(2, 48), r"\(sets\) must be a power of two, got 3"),
    ("i2s", lambda a: _i32(1, 512), r"id_to_slot must be \[B=2, IR\], got shape \(1, 512\)"),
    ("i2s", lambda a: _i32(2, 0), r"id_to_slot dim 1 \(id_range\) must be > 0, got 0"),
    ("lru", lambda a: _i32(2, 8), r"lru_counter must be \[B=2, NS=16\], got shape \(2, 8\)"),
]


@pytest.mark.parametrize("arg,make,msg", BAD_PLAN, ids=[m for _, _, m in BAD_PLAN])
@pytest.mark.parametrize("mode", ["cpu", "fake"])
def test_validation(arg, make, msg, mode):
    a = _valid_args()
    a[arg] = make(a)
    call = lambda: plan_op(a["tk"], a["L"], a["pid"], a["i2s"], a["lru"], raw_seq=a["raw_seq"])  # noqa: E731
    if mode == "fake":
        with FakeTensorMode(allow_non_fake_inputs=True):
            with pytest.raises(RuntimeError, match="custom::dsa_plan: .*" + msg):
                call()
    else:
        with pytest.raises(RuntimeError, match="custom::dsa_plan: .*" + msg):
            call()


def test_valid_args_pass():
    a = _valid_args()
    plan, _, act = plan_op(a["tk"], a["L"], a["pid"], a["i2s"], a["lru"], raw_seq=a["raw_seq"])
    assert plan.shape == (2 * 2 * 128, 2) and act.tolist() == [0, 0, 0, 0]

"""custom::npu_gather_selection_kv_cache (+ _functional): C++ kernel vs reference (bit-exact), ledger
invariants (docs/ops.md §8.9), hand-checked §1.4 / §1.5 examples, validation, opcheck, functionalization."""
from __future__ import annotations

import os
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from offload_passes.custom_ops import _library as Lib
from offload_passes.custom_ops import npu_gather_selection_kv_cache as M

gather = torch.ops.custom.npu_gather_selection_kv_cache.default
gather_f = torch.ops.custom.npu_gather_selection_kv_cache_functional.default


@pytest.fixture(scope="module", autouse=True)
def cpp_kernel(force_cpp_kernels):
    """Build (or load from the ninja cache) the C++ kernel once; this module tests the C++ path."""
    return Lib.cpu_op("npu_gather_selection_kv_cache")


@pytest.fixture
def one_thread():
    """The per-row reference issues many tiny torch ops; on a shared 2-core box every intra-op
    thread hand-off can cost a scheduler slice, so the bulk comparisons run single-threaded
    (test_parallel_rows_match_serial covers the multi-threaded kernel)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------------------------
# input generation
# --------------------------------------------------------------------------------------------

def _rint(lo: int, hi: int, g: torch.Generator) -> int:
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def _rand(g: torch.Generator) -> float:
    return float(torch.rand((), generator=g))


def payload(shape, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random bit patterns: the kernel moves bytes, so NaNs etc. must survive untouched."""
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    return torch.randint(-(2 ** 15), 2 ** 15, shape, generator=g, dtype=torch.int16).view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int8) if t.dtype == torch.int8 else t.view(torch.int16)


def max_sel_of(L: torch.Tensor, b: int, s: int, S: int, bsz: int) -> int:
    Lr = int(L[b]) - (S - 1 - s)
    if int(L[b]) <= 0 or Lr <= 0:
        return -1
    return (Lr + bsz - 1) // bsz - 1


def gen_topk(L, S, K, bsz, g, prev=None, reuse=0.6, hole=0.0, future=0.0, dup=0.0, fill=1.0) -> torch.Tensor:
    """Indexer-like rows [B, S, 1, K]: distinct valid ids in random order, then -1. ``prev`` (the
    previous step's top-k) gives temporal locality; rows s > 0 also reuse row (b, 0) (duplicates
    across S). ``hole`` puts a -1 inside the prefix, ``future`` an id > max_sel, ``dup`` a repeat."""
    B = L.numel()
    out = torch.full((B, S, 1, K), -1, dtype=torch.int32)
    for b in range(B):
        hot = prev[b].flatten().long() if prev is not None else torch.empty(0, dtype=torch.long)
        for s in range(S):
            ms = max_sel_of(L, b, s, S, bsz)
            c = min(K, int(min(K, ms + 1) * fill)) if ms >= 0 else 0
            if c <= 0:
                continue
            cand = torch.cat([hot, out[b, 0, 0].long()]) if s > 0 else hot
            cand = torch.unique(cand[(cand >= 0) & (cand <= ms)])
            n_re = min(int(round(reuse * c)), cand.numel())
            reused = cand[torch.randperm(cand.numel(), generator=g)[:n_re]]
            perm = torch.randperm(ms + 1, generator=g)
            fresh = perm[~torch.isin(perm, reused)][: c - n_re]
            row = torch.cat([reused, fresh])
            row = row[torch.randperm(row.numel(), generator=g)]
            n = row.numel()
            if n >= 2 and _rand(g) < dup:
                row[_rint(1, n - 1, g)] = row[_rint(0, n - 1, g)]
            if n >= 1 and _rand(g) < future:
                row[_rint(0, n - 1, g)] = ms + 1 + _rint(0, 50, g)
            if n >= 2 and _rand(g) < hole:
                row[_rint(0, n - 2, g)] = -_rint(1, 3, g)
            out[b, s, 0, :n] = row.to(torch.int32)
    return out


def garbage_status(B, S, K, bsz, L, g) -> torch.Tensor:
    """An arbitrary previous ledger: ids at random positions (also past this step's valid count, to
    force §1.4 moves), -1 holes, some ids beyond max_reuse, random old actual length."""
    st = torch.full((B, S, 1, K + 1), -1, dtype=torch.int32)
    for b in range(B):
        for s in range(S):
            ms = max_sel_of(L, b, s, S, bsz)
            hi = max(ms + 3, 1)
            row = torch.randint(0, hi + 1, (K,), generator=g, dtype=torch.int32)
            row[torch.rand(K, generator=g) < _rand(g)] = -1
            st[b, s, 0, :K] = row
            st[b, s, 0, K] = _rint(-2, K * bsz, g)
    return st


class Case:
    """One gather problem with its mutable state (selection payload + ledger)."""

    def __init__(self, seed: int, *, K=None, B=None, S=None, bsz=None, dtype=None, no_rope=None,
                 layout=None, D=None, Dr=None):
        g = self.g = torch.Generator().manual_seed(seed)
        small = _rand(g) < 0.3 if K is None else K <= 32
        self.K = K if K is not None else ([8, 16, 24, 32][_rint(0, 3, g)] if small else [64, 512, 2048][_rint(0, 2, g)])
        self.bsz = bsz if bsz is not None else ([1, 2, 4, 8, 16][_rint(0, 4, g)] if small else 1)
        self.S = S if S is not None else _rint(1, 4, g)
        self.B = B if B is not None else _rint(1, 8, g)
        while self.B * self.S * self.K > 8192 and B is None:  # keep the reference fast
            self.B = max(1, self.B // 2)
            if self.B == 1:
                self.S = max(1, self.S // 2)
        self.dtype = dtype if dtype is not None else [torch.bfloat16, torch.float16, torch.int8][_rint(0, 2, g)]
        if no_rope is None:
            no_rope = _rand(g) < (0.8 if self.dtype == torch.int8 else 0.15)
        self.no_rope = no_rope
        self.layout = layout if layout is not None else ("BSND" if _rand(g) < 0.5 else "TND")
        self.D = D if D is not None else _rint(1, 16, g)
        self.Dr = Dr if Dr is not None else _rint(1, 8, g)
        bsz = self.bsz
        self.FBS = bsz * [1, 2, 4, 8][_rint(0, 3, g)] if bsz >= 16 else [16, 32, 64, 128][_rint(0, 3, g)]
        self.SBS = bsz * [1, 2, 4][_rint(0, 2, g)] if bsz >= 16 else [16, 32, 64, 128][_rint(0, 3, g)]
        B, S, K = self.B, self.S, self.K
        max_tok = 3 * K * bsz
        self.L = torch.randint(-1, max_tok + 1, (B,), generator=g, dtype=torch.int32)
        self.L[torch.rand(B, generator=g) < 0.1] = _rint(-1, S, g)  # empty rows, Lr <= 0 rows
        self.capacity = max_tok + 2 * bsz * 8  # room to grow over a few steps
        f_maxblk = (self.capacity + self.FBS - 1) // self.FBS
        n_full = B * f_maxblk + 2
        self.fbt = torch.randperm(n_full, generator=g)[: B * f_maxblk].view(B, f_maxblk).to(torch.int32)
        self.full_kv = payload((n_full, self.FBS, self.D), self.dtype, g)
        self.full_rope = (torch.empty(0, dtype=self.dtype) if self.no_rope
                          else payload((n_full, self.FBS, self.Dr), self.dtype, g))
        s_maxblk = (K * bsz + self.SBS - 1) // self.SBS + _rint(0, 1, g)
        n_sel = B * S * s_maxblk + _rint(0, 3, g)
        # Spare rows past B*S are never read (actual_seq still has sbt.size(0) entries): fill them
        # with garbage; the used rows map every position to its own block.
        rows_tbl = B * S + _rint(0, 2, g)
        self.sbt = torch.randint(-3, n_sel + 3, (rows_tbl, s_maxblk), generator=g, dtype=torch.int32)
        self.sbt[: B * S] = torch.randperm(n_sel, generator=g)[: B * S * s_maxblk].view(B * S, s_maxblk).to(torch.int32)
        self.sel_kv = payload((n_sel, self.SBS, self.D), self.dtype, g)
        self.sel_rope = (torch.empty(0, dtype=self.dtype) if self.no_rope
                         else payload((n_sel, self.SBS, self.Dr), self.dtype, g))
        self.status = torch.full((B, S, 1, K + 1), -1, dtype=torch.int32)
        self.q = torch.arange(1, B + 1, dtype=torch.int32) * S  # cumulative (ignored by the op)
        self.prev = None

    def shaped(self, t: torch.Tensor) -> torch.Tensor:
        """BSND [B,S,1,X] or TND [B*S,1,X]."""
        return t if self.layout == "BSND" else t.view(self.B * self.S, 1, t.size(-1))

    def args(self, topk, state=None) -> tuple:
        rope, kv, status = state if state is not None else (self.sel_rope, self.sel_kv, self.status)
        return (rope, kv, self.sbt, self.shaped(status), self.shaped(topk), self.full_rope, self.full_kv,
                self.fbt, self.L, self.q)

    def clone_state(self):
        return self.sel_rope.clone(), self.sel_kv.clone(), self.status.clone()

    def next_topk(self, **kw) -> torch.Tensor:
        tk = gen_topk(self.L, self.S, self.K, self.bsz, self.g, prev=self.prev, **kw)
        self.prev = tk
        return tk

    def advance(self):
        """Next decode step: every non-empty batch row grows by S tokens (within the table)."""
        grow = self.L + self.S
        self.L = torch.where((self.L > 0) & (grow <= self.capacity), grow, self.L).to(torch.int32)

    def full_tokens(self, b: int, x: int, n_tok: int, which: str = "kv") -> torch.Tensor:
        src = self.full_kv if which == "kv" else self.full_rope
        tok = x * self.bsz
        return src[int(self.fbt[b, tok // self.FBS]), tok % self.FBS: tok % self.FBS + n_tok]

    def sel_tokens(self, sel: torch.Tensor, r: int, p: int, n_tok: int) -> torch.Tensor:
        tok = p * self.bsz
        return sel[int(self.sbt[r, tok // self.SBS]), tok % self.SBS: tok % self.SBS + n_tok]


def run_both(case: Case, topk: torch.Tensor, what: str):
    """Run C++ and reference from the same state; assert bit-exact equality; keep the C++ state."""
    st_c, st_r = case.clone_state(), case.clone_state()
    act_c = gather(*case.args(topk, st_c), selection_topk_block_size=case.bsz)
    act_r = M.reference_npu_gather_selection_kv_cache(*case.args(topk, st_r), case.bsz)
    info = f"{what}: K={case.K} B={case.B} S={case.S} bsz={case.bsz} {case.dtype} {case.layout} no_rope={case.no_rope}"
    assert torch.equal(act_c, act_r), info
    assert act_c.shape == (case.sbt.size(0),) and act_c.dtype == torch.int32, info
    assert torch.equal(st_c[2], st_r[2]), f"status differs, {info}"
    assert torch.equal(bits(st_c[1]), bits(st_r[1])), f"selection_kv_cache differs, {info}"
    assert torch.equal(bits(st_c[0]), bits(st_r[0])), f"selection_k_rope differs, {info}"
    case.sel_rope, case.sel_kv, case.status = st_c
    return act_c


# --------------------------------------------------------------------------------------------
# C++ vs reference
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", range(4))
def test_cpp_matches_reference_bit_exact(chunk, one_thread):
    """4 x 25 cases x 2 steps = 200 comparisons: fresh and garbage ledgers, locality with the
    previous step, suffix -1, -1 in the middle, ids > max_sel, duplicates, int8 no-rope."""
    for i in range(25):
        seed = 7000 + 25 * chunk + i
        case = Case(seed)
        g = case.g
        if _rand(g) < 0.5:
            case.status = garbage_status(case.B, case.S, case.K, case.bsz, case.L, g)
        tk = case.next_topk(reuse=_rand(g), hole=0.3, future=0.3, dup=0.2, fill=_rand(g) * 1.2)
        run_both(case, tk, f"seed {seed} step 0")
        case.advance()
        tk = case.next_topk(reuse=0.6, hole=0.1 * (i % 3), future=0.1 * (i % 2), dup=0.1, fill=0.5 + _rand(g) / 2)
        run_both(case, tk, f"seed {seed} step 1")


def test_parallel_rows_match_serial():
    """The multi-threaded kernel (rows split across two threads) equals the reference."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for seed in range(3):
            case = Case(9000 + seed, K=512, B=4, S=2, bsz=1, dtype=torch.bfloat16, no_rope=False)
            case.status = garbage_status(case.B, case.S, case.K, 1, case.L, case.g)
            run_both(case, case.next_topk(reuse=0.5, hole=0.2, future=0.2, dup=0.2), f"seed {seed}")
    finally:
        torch.set_num_threads(n)


# --------------------------------------------------------------------------------------------
# ledger invariants (docs/ops.md §8.9) over decode sequences
# --------------------------------------------------------------------------------------------

def _check_ledger_large(case: Case, topk: torch.Tensor, act: torch.Tensor, before_kv, before_rope):
    K, S = case.K, case.S
    status = case.status.view(case.B * S, K + 1)
    rows = topk.view(case.B * S, K)
    for r in range(case.B * S):
        b, s = divmod(r, S)
        ms = max_sel_of(case.L, b, s, S, 1)
        if ms < 0:
            assert int(act[r]) == 0
            continue
        row = rows[r]
        ids = row[(row >= 0) & (row <= ms)]
        n = ids.numel()
        assert torch.equal(torch.sort(status[r, :n]).values, torch.sort(ids).values), r
        assert bool((status[r, n:K] == -1).all()), r
        assert int(status[r, K]) == int(act[r]) == n, r
        for p in range(K):
            now_kv = case.sel_tokens(case.sel_kv, r, p, 1)
            if p < n:
                x = int(status[r, p])
                assert torch.equal(bits(now_kv), bits(case.full_tokens(b, x, 1))), (r, p)
                if not case.no_rope:
                    assert torch.equal(bits(case.sel_tokens(case.sel_rope, r, p, 1)),
                                       bits(case.full_tokens(b, x, 1, "rope"))), (r, p)
            else:  # positions >= n are not rewritten
                assert torch.equal(bits(now_kv), bits(case.sel_tokens(before_kv, r, p, 1))), (r, p)
                if not case.no_rope:
                    assert torch.equal(bits(case.sel_tokens(case.sel_rope, r, p, 1)),
                                       bits(case.sel_tokens(before_rope, r, p, 1))), (r, p)


@pytest.mark.parametrize("S,dtype,no_rope", [(1, torch.bfloat16, False), (4, torch.float16, False), (2, torch.int8, True)])
def test_ledger_invariants_over_steps(S, dtype, no_rope, one_thread):
    case = Case(123 + S, K=64, B=3, S=S, bsz=1, dtype=dtype, no_rope=no_rope, layout="BSND", D=4, Dr=2)
    case.L = torch.tensor([70, 5, 130], dtype=torch.int32)
    hits = 0
    for step in range(6):
        tk = case.next_topk(reuse=0.7, hole=0.2 if step % 2 else 0.0, future=0.0)
        before_kv, before_rope = case.sel_kv.clone(), case.sel_rope.clone()
        old_status = case.status.clone()
        act = gather(*case.args(tk), selection_topk_block_size=1)
        _check_ledger_large(case, tk, act, before_kv, before_rope)
        hits += int(torch.isin(case.status[..., :-1], old_status[..., :-1]).logical_and(case.status[..., :-1] >= 0).sum())
        case.advance()
    assert hits > 0  # the sequence exercised reuse


def test_ledger_invariants_small_k_blocks(one_thread):
    """K <= 32 (§1.5), S = 1: status is a permutation of the scanned ids, the largest id sits at
    n-1 and every block holds its full-cache tokens (the largest one its true length)."""
    case = Case(55, K=16, B=2, S=1, bsz=4, dtype=torch.float16, no_rope=False, layout="TND", D=3, Dr=2)
    case.L = torch.tensor([37, 50], dtype=torch.int32)
    for step in range(6):
        tk = case.next_topk(reuse=0.7)
        act = gather(*case.args(tk), selection_topk_block_size=4)
        for b in range(2):
            Lr = int(case.L[b])
            ms = (Lr + 3) // 4 - 1
            ids = tk[b, 0, 0][tk[b, 0, 0] >= 0].tolist()
            n = len(ids)
            st = case.status[b, 0, 0]
            assert sorted(st[:n].tolist()) == sorted(ids)
            assert bool((st[n:16] == -1).all())
            expect_len = sum((Lr - ms * 4) if x == ms else 4 for x in ids)
            assert int(st[16]) == int(act[b]) == expect_len
            assert int(st[n - 1]) == max(ids)
            for p in range(n):
                x = int(st[p])
                ln = (Lr - ms * 4) if x == ms else 4
                assert torch.equal(bits(case.sel_tokens(case.sel_kv, b, p, ln)), bits(case.full_tokens(b, x, ln))), (step, b, p)
                assert torch.equal(bits(case.sel_tokens(case.sel_rope, b, p, ln)),
                                   bits(case.full_tokens(b, x, ln, "rope"))), (step, b, p)
        case.L = case.L + 3


# --------------------------------------------------------------------------------------------
# hand-checked examples
# --------------------------------------------------------------------------------------------

def _marked_setup(K, bsz, SBS, FBS, L, n_full_tok):
    """B = S = 1, D = 1, fp16. Full token t holds t; selection token u holds 1000 + u (a marker that
    shows whether a position was moved/kept rather than refetched from the full cache)."""
    n_full_blk = (n_full_tok + FBS - 1) // FBS
    full_kv = torch.arange(n_full_blk * FBS, dtype=torch.float16).view(n_full_blk, FBS, 1)
    full_rope = -full_kv
    s_blk = (K * bsz + SBS - 1) // SBS
    sel_kv = (1000 + torch.arange(s_blk * SBS, dtype=torch.float16)).view(s_blk, SBS, 1)
    sel_rope = -sel_kv
    sbt = torch.arange(s_blk, dtype=torch.int32).view(1, s_blk)
    fbt = torch.arange(n_full_blk, dtype=torch.int32).view(1, n_full_blk)
    return full_kv, full_rope, sel_kv, sel_rope, sbt, fbt, torch.tensor([L], dtype=torch.int32)


@pytest.mark.parametrize("impl", ["cpp", "reference"])
def test_large_k_keep_move_and_refetch(impl):
    """§1.4 by hand: K=64, L=100 (max_sel 99, max_reuse 98)."""
    K = 64
    full_kv, full_rope, sel_kv, sel_rope, sbt, fbt, L = _marked_setup(K, 1, 64, 128, 100, 128)
    status = torch.full((1, 1, 1, K + 1), -1, dtype=torch.int32)
    status[0, 0, 0, [0, 1, 2, 40, 50]] = torch.tensor([10, 11, 12, 20, 99], dtype=torch.int32)
    status[0, 0, 0, K] = 5
    topk = torch.full((1, 1, 1, K), -1, dtype=torch.int32)
    topk[0, 0, 0, :6] = torch.tensor([20, 12, -1, 5, 99, 150], dtype=torch.int32)  # -1 inside, 150 > max_sel
    args = (sel_rope, sel_kv, sbt, status, topk, full_rope, full_kv, fbt, L, torch.tensor([1], dtype=torch.int32))
    if impl == "cpp":
        act = gather(*args, selection_topk_block_size=1)
    else:
        act = M.reference_npu_gather_selection_kv_cache(*args, 1)
    # ids = [20, 12, 5, 99]; 12 kept at 2; 20 (old position 40 >= n) moved to 0; 5 -> 1 from full;
    # 99 > max_reuse is not reused although present at 50 -> 3 from full.
    assert act.tolist() == [4]
    assert status[0, 0, 0, :5].tolist() == [20, 5, 12, 99, -1]
    assert bool((status[0, 0, 0, 4:K] == -1).all()) and int(status[0, 0, 0, K]) == 4
    kv = sel_kv.flatten().tolist()
    assert kv[:4] == [1040.0, 5.0, 1002.0, 99.0]
    assert kv[4:] == [1000.0 + u for u in range(4, 64)]  # incl. old position 40 (moved, not cleared)
    assert sel_rope.flatten().tolist()[:4] == [-1040.0, -5.0, -1002.0, -99.0]


@pytest.mark.parametrize("impl", ["cpp", "reference"])
def test_small_k_partial_tail_and_swap(impl):
    """§1.5 by hand: K=8, bsz=4, L=22 -> max_sel 5 with a 2-token tail; old actual 10 makes only
    old positions 0, 1 reusable (position 2 was the old partial tail)."""
    K, bsz = 8, 4
    full_kv, full_rope, sel_kv, sel_rope, sbt, fbt, L = _marked_setup(K, bsz, 16, 16, 22, 32)
    status = torch.full((1, K + 1), -1, dtype=torch.int32).view(1, 1, K + 1)  # TND
    status[0, 0, :3] = torch.tensor([3, 5, 1], dtype=torch.int32)
    status[0, 0, K] = 10
    topk = torch.full((1, 1, K), -1, dtype=torch.int32)
    topk[0, 0, :6] = torch.tensor([5, 1, 3, 9, 0, -1], dtype=torch.int32)  # 9 > max_sel is skipped
    args = (sel_rope, sel_kv, sbt, status, topk, full_rope, full_kv, fbt, L, torch.tensor([1], dtype=torch.int32))
    if impl == "cpp":
        act = gather(*args, selection_topk_block_size=bsz)
    else:
        act = M.reference_npu_gather_selection_kv_cache(*args, bsz)
    # ids [5, 1, 3, 0]: 5 kept at 1, 3 kept at 0, 1 -> 2 (full tokens 4..7), 0 -> 3 (tokens 0..3);
    # then the max id 5 (at 1) swaps with position 3: its 2 true tokens go to 3, the full block back.
    assert act.tolist() == [2 + 4 + 4 + 4]
    assert status[0, 0].tolist() == [3, 0, 1, 5, -1, -1, -1, -1, 14]
    kv = sel_kv.flatten().tolist()
    assert kv[0:4] == [1000.0, 1001.0, 1002.0, 1003.0]  # kept id 3 (old block 0)
    assert kv[4:8] == [0.0, 1.0, 2.0, 3.0]  # id 0's block, swapped in from position 3
    assert kv[8:12] == [4.0, 5.0, 6.0, 7.0]  # id 1 from full
    assert kv[12:16] == [1004.0, 1005.0, 2.0, 3.0]  # id 5's 2 true tokens (kept data), then stale
    assert kv[16:] == [1000.0 + u for u in range(16, 32)]


def test_empty_rows_write_nothing():
    """L <= 0 and Lr <= 0 rows: nothing written, actual_seq 0 (reference choice); spare table rows 0."""
    case = Case(77, K=64, B=2, S=2, bsz=1, dtype=torch.bfloat16, no_rope=False, layout="BSND")
    case.L = torch.tensor([0, 1], dtype=torch.int32)  # b0 empty; b1: s=0 has Lr = 0, s=1 has Lr = 1
    case.status = garbage_status(2, 2, 64, 1, torch.tensor([50, 50]), case.g)
    tk = torch.zeros(2, 2, 1, 64, dtype=torch.int32)
    before = case.clone_state()
    act = run_both(case, tk, "empty rows")
    assert act[:4].tolist() == [0, 0, 0, 64] and bool((act[4:] == 0).all())
    for r in range(3):
        assert torch.equal(case.status.view(4, 65)[r], before[2].view(4, 65)[r])
        for p in range(64):
            assert torch.equal(bits(case.sel_tokens(case.sel_kv, r, p, 1)), bits(case.sel_tokens(before[1], r, p, 1)))


def test_layouts_agree_and_block_table_untouched():
    a = Case(31, K=512, B=2, S=3, bsz=1, dtype=torch.bfloat16, no_rope=False, layout="BSND")
    b = Case(31, K=512, B=2, S=3, bsz=1, dtype=torch.bfloat16, no_rope=False, layout="TND")
    tk = gen_topk(a.L, 3, 512, 1, torch.Generator().manual_seed(0))
    sbt0 = a.sbt.clone()
    act_a = gather(*a.args(tk), selection_topk_block_size=1)
    act_b = gather(*b.args(tk), selection_topk_block_size=1)
    assert torch.equal(act_a, act_b) and torch.equal(a.status, b.status) and torch.equal(bits(a.sel_kv), bits(b.sel_kv))
    assert torch.equal(a.sbt, sbt0)


def test_block_size_zero_means_64():
    """selection_topk_block_size <= 0 is replaced by 64 (K <= 32 keeps the block path)."""
    res = []
    for bsz in (0, -5, 64):
        case = Case(41, K=16, B=1, S=1, bsz=64, dtype=torch.float16, no_rope=False, layout="BSND")
        tk = gen_topk(case.L, 1, 16, 64, torch.Generator().manual_seed(1))
        act = gather(*case.args(tk), selection_topk_block_size=bsz)
        res.append((act, case.status, case.sel_kv))
    for act, st, kv in res[:2]:
        assert torch.equal(act, res[2][0]) and torch.equal(st, res[2][1]) and torch.equal(bits(kv), bits(res[2][2]))


def test_functional_returns_updated_clones():
    case = Case(61, K=64, B=2, S=2, bsz=1, dtype=torch.float16, no_rope=False, layout="TND")
    tk = case.next_topk(reuse=0.0)
    state0 = case.clone_state()
    act, rope, kv, table, status = gather_f(*case.args(tk), selection_topk_block_size=1)
    # inputs untouched
    assert torch.equal(bits(case.sel_kv), bits(state0[1])) and torch.equal(case.status, state0[2])
    act2 = gather(*case.args(tk), selection_topk_block_size=1)
    assert torch.equal(act, act2) and torch.equal(table, case.sbt) and table.data_ptr() != case.sbt.data_ptr()
    assert torch.equal(bits(kv), bits(case.sel_kv)) and torch.equal(bits(rope), bits(case.sel_rope))
    assert torch.equal(status, case.shaped(case.status))


def test_non_contiguous_status_and_selection():
    case = Case(63, K=64, B=2, S=1, bsz=1, dtype=torch.bfloat16, no_rope=False, layout="BSND", D=4, Dr=2)
    tk = case.next_topk(reuse=0.0)
    ref_state = case.clone_state()
    ref_act = M.reference_npu_gather_selection_kv_cache(*case.args(tk, ref_state), 1)
    st = torch.full((65, 1, 1, 2), 7, dtype=torch.int32).permute(3, 2, 1, 0)
    st.copy_(case.status)
    kv = torch.empty(case.sel_kv.shape[::-1], dtype=case.sel_kv.dtype).permute(2, 1, 0)
    kv.copy_(case.sel_kv)
    assert not st.is_contiguous() and not kv.is_contiguous()
    act = gather(*case.args(tk, (case.sel_rope.clone(), kv, st)), selection_topk_block_size=1)
    assert torch.equal(act, ref_act) and torch.equal(st, ref_state[2]) and torch.equal(bits(kv), bits(ref_state[1]))


# --------------------------------------------------------------------------------------------
# validation: every limit of docs/ops.md §1.2 violated once, plus the data-dependent table checks
# --------------------------------------------------------------------------------------------

def _base() -> dict:
    """B=2, S=2, K=64, bsz=1, block sizes 16, D=8, Dr=4 (BSND)."""
    g = torch.Generator().manual_seed(0)
    B, S, K = 2, 2, 64
    return dict(
        sel_rope=payload((16, 16, 4), torch.bfloat16, g), sel_kv=payload((16, 16, 8), torch.bfloat16, g),
        sbt=torch.arange(16, dtype=torch.int32).view(4, 4), status=torch.full((B, S, 1, K + 1), -1, dtype=torch.int32),
        topk=torch.arange(B * S * K, dtype=torch.int32).view(B, S, 1, K) % 50,
        full_rope=payload((8, 16, 4), torch.bfloat16, g), full_kv=payload((8, 16, 8), torch.bfloat16, g),
        fbt=torch.arange(8, dtype=torch.int32).view(2, 4), L=torch.tensor([60, 64], dtype=torch.int32),
        q=torch.tensor([2, 4], dtype=torch.int32), bsz=1,
    )


def _order(d: dict) -> tuple:
    return (d["sel_rope"], d["sel_kv"], d["sbt"], d["status"], d["topk"], d["full_rope"], d["full_kv"], d["fbt"], d["L"], d["q"])


def _w(**over) -> dict:
    d = _base()
    d.update(over)
    return d


def _tnd(d: dict) -> dict:
    d["topk"] = d["topk"].view(4, 1, 64)
    d["status"] = d["status"].view(4, 1, 65)
    return d


def _bad_cases():
    bf = torch.bfloat16
    z = lambda *s, dt=bf: torch.zeros(s, dtype=dt)  # noqa: E731
    i32 = lambda *s: torch.zeros(s, dtype=torch.int32)  # noqa: E731
    small_k = lambda **o: _w(topk=i32(2, 2, 1, 16), status=i32(2, 2, 1, 17), **o)  # noqa: E731
    return [
        ("kv dtype", _w(sel_kv=z(16, 16, 8, dt=torch.float32)), "selection_kv_cache dtype must be float16, bfloat16 or int8, got torch.float32"),
        ("rope dtype", _w(sel_rope=z(16, 16, 4, dt=torch.float16)), "selection_k_rope dtype must equal selection_kv_cache dtype torch.bfloat16, got torch.float16"),
        ("full dtype", _w(full_kv=z(8, 16, 8, dt=torch.int8)), "full_kv_cache dtype must equal selection_kv_cache dtype"),
        ("index dtype", _w(fbt=torch.arange(8).view(2, 4)), "full_kv_block_table must be int32, got torch.int64"),
        ("status dtype", _w(status=z(2, 2, 1, 65, dt=torch.int64)), "selection_kv_block_status must be int32"),
        ("q dtype", _w(q=torch.tensor([2.0, 4.0])), "full_q_actual_seq must be int32"),
        ("sel kv 2-D", _w(sel_kv=z(16, 128)), "selection_kv_cache must be 3-D, got shape [16, 128]"),
        ("sel rope 2-D", _w(sel_rope=z(16, 64)), "selection_k_rope must be 3-D or 1-D empty, got shape [16, 64]"),
        ("sel rope 1-D non-empty", _w(sel_rope=z(3)), "selection_k_rope must be empty when 1-D (no-rope mode), got shape [3]"),
        ("sel rope dims", _w(sel_rope=z(16, 8, 4)), "selection_k_rope dims 0,1 must equal selection_kv_cache's [16, 16], got [16, 8, 4]"),
        ("sel block % bsz", small_k(sel_kv=z(16, 16, 8), bsz=32), "selection_kv_cache.size(1) (16) must be a multiple of selection_topk_block_size 32"),
        ("bsz 0 -> 64", small_k(bsz=0), "selection_kv_cache.size(1) (16) must be a multiple of selection_topk_block_size 64"),
        ("full block % bsz", small_k(sel_kv=z(16, 32, 8), sel_rope=z(16, 32, 4), bsz=32), "full_kv_cache.size(1) (16) must be a multiple of selection_topk_block_size 32"),
        ("full kv 2-D", _w(full_kv=z(8, 128)), "full_kv_cache must be 3-D, got shape [8, 128]"),
        ("full rope 1-D non-empty", _w(full_rope=z(2)), "full_k_rope must be empty when 1-D (no-rope mode), got shape [2]"),
        ("full rope dims", _w(full_rope=z(7, 16, 4)), "full_k_rope dims 0,1 must equal full_kv_cache's [8, 16], got [7, 16, 4]"),
        ("rope modes differ", _w(full_rope=z(0)), "full_k_rope and selection_k_rope must both be 3-D or both 1-D empty"),
        ("kv dims differ", _w(full_kv=z(8, 16, 9)), "full_kv_cache.size(2) must equal selection_kv_cache.size(2) 8, got 9"),
        ("rope dims differ", _w(full_rope=z(8, 16, 5)), "full_k_rope.size(2) must equal selection_k_rope.size(2) 4, got 5"),
        ("topk/status rank", _w(status=i32(4, 1, 65)), "selection_topk_indices and selection_kv_block_status must both be 3-D (TND) or both 4-D (BSND)"),
        ("topk 2-D", _w(topk=i32(4, 64), status=i32(4, 65)), "must both be 3-D (TND) or both 4-D (BSND)"),
        ("status last dim", _w(status=i32(2, 2, 1, 64)), "selection_kv_block_status must have shape [2, 2, 1, 65] (last dim K+1), got [2, 2, 1, 64]"),
        ("H != 1", _w(topk=i32(2, 2, 2, 64), status=i32(2, 2, 2, 65)), "selection_topk_indices head dim (H) must be 1, got 2"),
        ("K > 2048", _w(topk=i32(2, 2, 1, 2056), status=i32(2, 2, 1, 2057)), "selection_topk_indices last dim (K) must be in [1, 2048], got 2056"),
        ("K = 0", _w(topk=i32(2, 2, 1, 0), status=i32(2, 2, 1, 1)), "selection_topk_indices last dim (K) must be in [1, 2048], got 0"),
        ("K > 32 needs bsz 1", _w(bsz=2), "selection_topk_block_size must be 1 when K > 32, got 2 (K = 64)"),
        ("K > 32 bsz 0 -> 64", _w(bsz=0), "selection_kv_cache.size(1) (16) must be a multiple of selection_topk_block_size 64"),
        ("fbt 1-D", _w(fbt=i32(8)), "full_kv_block_table must be 2-D [B, maxblk], got shape [8]"),
        ("BSND fbt rows", _w(fbt=i32(3, 4)), "full_kv_block_table.size(0) must equal B 2 (BSND), got 3"),
        ("TND T % B", _tnd(_w(fbt=i32(3, 4), L=i32(3), q=i32(3))), "selection_topk_indices.size(0) (T = 4) must be a multiple of B 3 (TND)"),
        ("TND B 0", _tnd(_w(fbt=i32(0, 4))), "full_kv_block_table.size(0) (B) must be > 0 (TND), got 0"),
        ("BSND B 0", _w(topk=i32(0, 2, 1, 64), status=i32(0, 2, 1, 65), fbt=i32(0, 4), L=i32(0), q=i32(0)), "batch B must be > 0, got 0"),
        ("S >= 8", _w(topk=i32(2, 8, 1, 64), status=i32(2, 8, 1, 65), sbt=i32(16, 4), sel_kv=z(64, 16, 8), sel_rope=z(64, 16, 4)), "S (query tokens per batch row) must be in [1, 7], got 8"),
        ("sbt 1-D", _w(sbt=i32(16)), "selection_kv_block_table must be 2-D, got shape [16]"),
        ("sbt rows", _w(sbt=i32(3, 4)), "selection_kv_block_table.size(0) must be >= B*S*H = 4, got 3"),
        ("sbt cols", _w(sbt=i32(4, 3)), "selection_kv_block_table.size(1) must be >= ceil(K*bsz/block_size) = 4, got 3"),
        ("sel blocks", _w(sel_kv=z(15, 16, 8), sel_rope=z(15, 16, 4)), "selection_kv_cache.size(0) (blocks) must be >= B*S*H*maxblk = 16, got 15"),
        ("Dkv > 656", _w(sel_kv=z(16, 16, 657), full_kv=z(8, 16, 657)), "selection_kv_cache.size(2) (kv dim) must be <= 656, got 657"),
        ("kv len shape", _w(L=i32(3)), "full_kv_actual_seq must be 1-D of length B 2, got shape [3]"),
        ("q len shape", _w(q=i32(2, 1)), "full_q_actual_seq must be 1-D of length B 2, got shape [2, 1]"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0] if isinstance(c, tuple) else None)
def test_validation_limits(case):
    _, d, msg = case
    for op, name in ((gather, "npu_gather_selection_kv_cache"), (gather_f, "npu_gather_selection_kv_cache_functional")):
        with pytest.raises(RuntimeError) as e:
            op(*_order(d), selection_topk_block_size=d["bsz"])
        assert str(e.value).startswith(f"custom::{name}: "), str(e.value)
        assert msg in str(e.value), str(e.value)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in _order(d)]
        with pytest.raises(RuntimeError, match="custom::npu_gather_selection_kv_cache: "):
            gather(*fake, selection_topk_block_size=d["bsz"])


def test_base_case_and_limits_are_valid():
    d = _base()
    assert gather(*_order(d), selection_topk_block_size=1).shape == (4,)
    d = _w(sel_kv=torch.zeros(16, 16, 656, dtype=torch.bfloat16), full_kv=torch.zeros(8, 16, 656, dtype=torch.bfloat16))
    gather(*_order(d), selection_topk_block_size=1)  # Dkv = 656 is legal
    d = _w(topk=torch.zeros(2, 2, 1, 32, dtype=torch.int32), status=torch.full((2, 2, 1, 33), -1, dtype=torch.int32))
    gather(*_order(d), selection_topk_block_size=2)  # K = 32 allows bsz > 1


@pytest.mark.parametrize("impl", ["cpp", "reference"])
@pytest.mark.parametrize(
    "what,over,msg",
    [
        ("sbt entry", {"sbt": torch.tensor([[0, 1, 2, 3], [4, 5, 6, 99], [8, 9, 10, 11], [12, 13, 14, 15]], dtype=torch.int32)},
         "selection_kv_block_table[1] has an entry outside [0, 16) in its first 4 columns"),
        ("fbt entry", {"fbt": torch.tensor([[0, 1, 2, 3], [4, -1, 6, 7]], dtype=torch.int32)},
         "full_kv_block_table[1] has an entry outside [0, 8) for a valid id"),
        ("fbt columns", {"L": torch.tensor([60, 70], dtype=torch.int32), "topk": torch.full((2, 2, 1, 64), 66, dtype=torch.int32)},
         "full_kv_block_table[1] has 4 columns, too few for id 66 (full_kv_actual_seq[1] = 70)"),
    ],
)
def test_block_table_contents_checked_before_writing(impl, what, over, msg):
    d = _w(**over)
    state = (d["sel_rope"].clone(), d["sel_kv"].clone(), d["status"].clone())
    with pytest.raises(RuntimeError) as e:
        if impl == "cpp":
            gather(*_order(d), selection_topk_block_size=1)
        else:
            M.reference_npu_gather_selection_kv_cache(*_order(d), 1)
    assert str(e.value).startswith("custom::npu_gather_selection_kv_cache: ") and msg in str(e.value), str(e.value)
    assert torch.equal(bits(d["sel_kv"]), bits(state[1])) and torch.equal(d["status"], state[2])


# --------------------------------------------------------------------------------------------
# fake kernels, opcheck, functionalization
# --------------------------------------------------------------------------------------------

def test_fake_kernels_shapes():
    d = _base()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in _order(d)]
        act = gather(*fake, selection_topk_block_size=1)
        assert act.shape == (4,) and act.dtype == torch.int32
        outs = gather_f(*fake, selection_topk_block_size=1)
        assert [o.shape for o in outs[1:]] == [t.shape for t in _order(d)[:4]]


def _finite(case: Case) -> Case:
    """opcheck compares eager and traced outputs with allclose (NaN != NaN): finite payloads."""
    g = torch.Generator().manual_seed(2)
    for name in ("sel_kv", "sel_rope", "full_kv", "full_rope"):
        t = getattr(case, name)
        if t.numel() and t.dtype != torch.int8:
            setattr(case, name, torch.randn(t.shape, generator=g).to(t.dtype))
    return case


def _opcheck_cases():
    out = []
    for seed, kw in [
        (1, dict(K=64, B=2, S=2, bsz=1, dtype=torch.bfloat16, no_rope=False, layout="BSND")),
        (2, dict(K=128, B=1, S=3, bsz=1, dtype=torch.float16, no_rope=False, layout="TND")),
        (3, dict(K=64, B=2, S=1, bsz=1, dtype=torch.int8, no_rope=True, layout="BSND")),
        (4, dict(K=16, B=2, S=1, bsz=4, dtype=torch.bfloat16, no_rope=False, layout="TND")),
    ]:
        case = _finite(Case(500 + seed, D=4, Dr=2, **kw))
        case.L = case.L.clamp(min=1)
        tk = case.next_topk(reuse=0.0)
        case.status = garbage_status(case.B, case.S, case.K, case.bsz, case.L, case.g)
        out.append((case, tk))
    return out


@pytest.mark.parametrize("idx", range(4))
def test_opcheck(idx):
    case, tk = _opcheck_cases()[idx]
    kw = {"selection_topk_block_size": case.bsz}
    torch.library.opcheck(gather, case.args(tk), kw)
    torch.library.opcheck(gather_f, case.args(tk), kw)


def test_functionalize_maps_to_functional_twin():
    from torch.fx.experimental.proxy_tensor import make_fx

    case, tk = _opcheck_cases()[0]

    def fn(*args):
        act = gather(*args, selection_topk_block_size=1)
        return act, args[3].sum()

    gm = make_fx(torch.func.functionalize(fn, remove="mutations_and_views"))(*case.args(tk, case.clone_state()))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert gather_f in targets and gather not in targets
    s1, s2 = case.clone_state(), case.clone_state()
    out1, out2 = gm(*case.args(tk, s1)), fn(*case.args(tk, s2))
    assert torch.equal(out1[0], out2[0]) and torch.equal(out1[1], out2[1])
    assert torch.equal(s1[2], s2[2]) and torch.equal(bits(s1[1]), bits(s2[1])) and torch.equal(bits(s1[0]), bits(s2[0]))


GATHER_COMPILE_CHECK = textwrap.dedent(
    """
    import os, torch, offload_passes
    from offload_passes.custom_ops import _library as Lib
    functionalize = os.environ.get("OFFLOAD_PASSES_FUNCTIONALIZE", "1") != "0"
    assert Lib.has_kernel("npu_gather_selection_kv_cache", "Functionalize") == functionalize
    g = torch.Generator().manual_seed(0)
    B, S, K, BS, D, Dr = 2, 2, 64, 16, 8, 4
    mk = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)
    full_kv, full_rope = mk(B * 8, BS, D), mk(B * 8, BS, Dr)
    fbt = torch.arange(B * 8, dtype=torch.int32).view(B, 8)
    sbt = torch.arange(B * S * 4, dtype=torch.int32).view(B * S, 4)
    sel_kv0, sel_rope0 = mk(B * S * 4, BS, D), mk(B * S * 4, BS, Dr)
    L = torch.tensor([100, 77], dtype=torch.int32)
    q = torch.tensor([2, 4], dtype=torch.int32)

    def topk(step):
        t = torch.stack([torch.randperm(70, generator=g)[:K] for _ in range(B * S)]).view(B, S, 1, K)
        t[..., 50 + step:] = -1
        return t.to(torch.int32)

    def fn(rope, kv, sbt, status, tk, frope, fkv, fbt, L, q):
        act = torch.ops.custom.npu_gather_selection_kv_cache(rope, kv, sbt, status, tk, frope, fkv, fbt, L, q,
                                                             selection_topk_block_size=1)
        idx = torch.where(torch.arange(K) < act[:, None], torch.arange(K), -1)
        return idx, kv.float().sum()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    e_state = [sel_rope0.clone(), sel_kv0.clone(), torch.full((B, S, 1, K + 1), -1, dtype=torch.int32)]
    c_state = [t.clone() for t in e_state]
    for step in range(2):
        tk = topk(step)
        expect = fn(e_state[0], e_state[1], sbt, e_state[2], tk, full_rope, full_kv, fbt, L, q)
        got = compiled(c_state[0], c_state[1], sbt, c_state[2], tk, full_rope, full_kv, fbt, L, q)
        assert all(torch.equal(a, b) for a, b in zip(got, expect))
        assert all(torch.equal(a, b) for a, b in zip(c_state, e_state))
    print("OK", functionalize)
    """
)


def test_torch_compile_aot_eager_with_our_functionalization():
    """(The same check under PyTorch's auto-functionalization, OFFLOAD_PASSES_FUNCTIONALIZE=0, runs in
    the single subprocess of test_dsa_serve.py, which executes GATHER_COMPILE_CHECK too.)"""
    ns: dict = {}
    exec(compile(GATHER_COMPILE_CHECK.replace('print("OK", functionalize)', "RESULT = functionalize"), "<gather_compile>", "exec"), ns)
    assert ns["RESULT"] is True

"""Randomised multi-step simulation of one 4-layer IndexShare group (docs/ops.md §5), checking the
invariants of docs/ops.md §8 items 1-9 after every op of every step, and reporting hit rates (§8.8).

Per step (owner O = layer 0, last layer Z = 3), exactly the GLM order of §5:
    plan = dsa_plan(topk, L, pool_ids, id_to_slot, lru)                      # owner, once
    for l in 0..3: dsa_serve(plan, full[l], pool[l], sel[l])
                   l != O: dsa_install(rec, sel[l], pool[l], ..., metadata_update=0)
                   l == Z: dsa_install(rec, sel[O], pool[O], ..., metadata_update=1)
and, alongside, the baseline gather (npu_gather_selection_kv_cache) on the same top-k for one layer. One
configuration runs the no-rope mode (Dr = 0) on the state the backend allocates for it.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import _gen as G  # noqa: E402

from offload_passes.custom_ops import _library as Lib  # noqa: E402
from offload_passes.custom_ops._records import decode_records  # noqa: E402
from offload_passes.state import GroupLayout, OffloadState  # noqa: E402

log = logging.getLogger("offload_passes.tests.group_simulation")

ops = torch.ops.custom
from offload_passes.custom_ops.plan_kind import PlanKind  # noqa: E402

INVALID, POOL_HIT, FULL_OLD_MISS, DECODE_WINDOW, FUTURE_SKIP, NEGATIVE_STOP = PlanKind


@pytest.fixture(scope="module", autouse=True)
def cpp_kernels():
    """Build/load all four C++ kernels once (cached on disk across sessions)."""
    return [Lib.cpu_op(n) for n in ("dsa_plan", "dsa_serve", "dsa_install", "npu_gather_selection_kv_cache")]


@dataclass
class Cfg:
    B: int
    S: int
    K: int
    PS: int
    BS: int  # selection / PA block size
    F: int  # full-cache positions per batch row (= id_range here)
    steps: int
    seed: int
    layers: int = 4
    gather_layer: int = 2
    Dkv: int = 32
    Dr: int = 16
    dtype: torch.dtype = torch.bfloat16
    reuse: float = 0.85


class Group:
    """State of one group: per-layer caches/pools/selection buffers, per-group metadata, gather ledger."""

    def __init__(self, c: Cfg, g: torch.Generator):
        self.c = c
        B, S, K, PS, F = c.B, c.S, c.K, c.PS, c.F
        nb = B * S * K // c.BS
        self.full_kv = [G.payload((B, F, c.Dkv), c.dtype, g) for _ in range(c.layers)]
        self.full_rope = [G.payload((B, F, c.Dr), c.dtype, g) for _ in range(c.layers)]
        # pools and metadata as the backend allocates them (offload_passes/state.py): [B, PS, 0] rope pools
        # in the no-rope mode (Dr = 0)
        layout = GroupLayout(0, 0, list(range(c.layers)), B, PS, F, [(c.Dkv, c.Dr, c.dtype)] * c.layers)
        state = OffloadState.allocate("group_simulation", [layout]).groups[0]
        self.pool_kv, self.pool_rope = (list(t) for t in zip(*state.pools()))
        assert all(p.shape == (B, PS, c.Dr) and not bool(p.any()) for p in self.pool_rope)
        self.sel_kv = [torch.zeros(nb, c.BS, c.Dkv, dtype=c.dtype) for _ in range(c.layers)]
        self.sel_rope = [torch.zeros(nb, c.BS, c.Dr, dtype=c.dtype) for _ in range(c.layers)]
        self.sel_table = torch.arange(nb, dtype=torch.int32).view(B * S, K // c.BS)
        self.pool_ids, self.id_to_slot, self.lru = state.pool_ids, state.id_to_slot, state.lru_counter
        # baseline gather of one layer (identity PA tables, block size BS); no rope: its 1-D empty form, as
        # the recipe calls it
        self.g_sel_kv = torch.zeros(nb, c.BS, c.Dkv, dtype=c.dtype)
        self.g_sel_rope = torch.zeros(nb, c.BS, c.Dr, dtype=c.dtype) if c.Dr else torch.empty(0, dtype=c.dtype)
        self.g_status = torch.full((B, S, 1, K + 1), -1, dtype=torch.int32)
        self.full_table = torch.arange(B * F // c.BS, dtype=torch.int32).view(B, F // c.BS)

    def reset_row(self, b: int, g: torch.Generator) -> None:
        """A batch row starts a new request: new KV, metadata and gather ledger reset (docs/ops.md §5 item 5)."""
        for lay in range(self.c.layers):
            self.full_kv[lay][b] = G.payload(self.full_kv[lay][b].shape, self.c.dtype, g)
            self.full_rope[lay][b] = G.payload(self.full_rope[lay][b].shape, self.c.dtype, g)
        self.pool_ids[b] = -1
        self.id_to_slot[b] = -1
        self.lru[b] = 0
        self.g_status[b] = -1


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(0, -2)  # [rows, D]; D may be 0 (no rope), where a [-1, 0] view is undefined


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def check_plan(c: Cfg, tk, L, plan, records, act, i2s0):
    """§8.2 actual length, §8.3 classification + records (against the metadata at plan time)."""
    B, S, K, PS, NS = c.B, c.S, c.K, c.PS, c.PS // 16
    R = B * S
    rows = tk.view(R, K).long()
    kinds, vals = plan[:, 0].view(R, K).long(), plan[:, 1].view(R, K).long()
    s_of = torch.arange(R) % S
    b_of = torch.arange(R) // S
    Lb = L.long()[b_of]
    mv = (Lb - S - 1).clamp(min=0).unsqueeze(1)
    ms = (Lb - (S - 1 - s_of) - 1).unsqueeze(1)
    valid = (rows >= 0) & (rows <= ms)
    # §8.2: suffix-padded rows -> act = #valid = index of the first -1; kinds 1/2/3 fill [0, act)
    assert torch.equal(act.long(), valid.sum(1))
    col = torch.arange(K).unsqueeze(0)
    served = (kinds >= 1) & (kinds <= 3)
    assert torch.equal(served, col < act.long().unsqueeze(1))
    assert bool(torch.isin(kinds[~served], torch.tensor([INVALID, NEGATIVE_STOP])).all())
    # §8.3 classification
    slot = i2s0[b_of.unsqueeze(1), rows.clamp(min=0)].long()
    resident = (slot >= 0) & (slot < PS)
    assert torch.equal(served & (kinds == POOL_HIT), valid & resident & (rows <= mv))
    assert torch.equal(kinds == DECODE_WINDOW, valid & (rows > mv))
    assert torch.equal(kinds == FULL_OLD_MISS, valid & ~resident & (rows <= mv))
    assert torch.equal(vals[kinds == POOL_HIT], slot[kinds == POOL_HIT])
    # records = kind-2 rows per microtask in order, set = x & (NS-1), seq = s, dst_pos = k
    recs, counts = decode_records(records, B, S, K)
    miss = (kinds.view(-1) == FULL_OLD_MISS).nonzero().squeeze(1)
    r, k = miss // K, miss % K
    x = rows[r, k]
    expect = torch.stack([r * 8 + k // (K // 8), x & (NS - 1), x, r % S, k], 1)
    assert torch.equal(recs, expect)
    assert int(counts.sum()) == miss.numel()


def check_serve(c: Cfg, grp: Group, layer: int, tk, plan):
    """§8.1: served rows equal the direct gather from the full cache (bitwise), others are zero."""
    B, S, K = c.B, c.S, c.K
    kinds = plan[:, 0].long()
    served = (kinds >= 1) & (kinds <= 3)
    ids = tk.reshape(-1).long()
    b_of = torch.arange(B * S * K) // (S * K)
    for sel, full in ((grp.sel_kv[layer], grp.full_kv[layer]), (grp.sel_rope[layer], grp.full_rope[layer])):
        got = _bits(_flat(sel))
        want = _bits(full[b_of[served], ids[served]])
        assert torch.equal(got[served], want), f"layer {layer}: served rows differ from the full cache"
        assert int(got[~served].abs().sum()) == 0, f"layer {layer}: non-served rows not zero"


def check_pool(c: Cfg, grp: Group):
    """§8.4 metadata consistency and §8.5 pool content for every layer."""
    NS = c.PS // 16
    assert int(grp.lru.min()) >= 0 and int(grp.lru.max()) <= 15
    for b in range(c.B):
        pid, i2s = grp.pool_ids[b], grp.id_to_slot[b]
        occ = (pid >= 0).nonzero().squeeze(1)
        ids = pid[occ].long()
        assert torch.equal(i2s[ids].long(), occ)  # pool_ids -> id_to_slot
        mapped = (i2s >= 0).nonzero().squeeze(1)
        assert torch.equal(pid[i2s[mapped].long()].long(), mapped)  # id_to_slot -> pool_ids
        assert torch.equal(occ // 16, ids & (NS - 1))
        assert ids.unique().numel() == ids.numel()
        for lay in range(c.layers):
            assert torch.equal(_bits(grp.pool_kv[lay][b, occ]), _bits(grp.full_kv[lay][b, ids])), (b, lay)
            assert torch.equal(_bits(grp.pool_rope[lay][b, occ]), _bits(grp.full_rope[lay][b, ids])), (b, lay)


def check_install_accounting(c: Cfg, tk, L, plan, pid0, lru0, grp: Group):
    """§8.7: installed ids = distinct kind-2 ids (first occurrence); counters advance mod 16; residency."""
    S, K, NS = c.S, c.K, c.PS // 16
    kinds = plan[:, 0].view(c.B, S * K)
    ids = tk.reshape(c.B, S * K)
    installed_total = 0
    for b in range(c.B):
        miss = ids[b][kinds[b] == FULL_OLD_MISS].long()
        want = miss[G.first_occurrence(miss)]
        per_set = torch.bincount(want & (NS - 1), minlength=NS)
        assert torch.equal(grp.lru[b].long(), (lru0[b].long() + per_set) % 16)
        res = grp.id_to_slot[b, want]
        overfull = per_set[want & (NS - 1)] > 16
        assert bool((res[~overfull] >= 0).all())
        # every newly resident id was installed now and satisfied x <= max_valid
        new = grp.pool_ids[b][(grp.pool_ids[b] >= 0) & (grp.pool_ids[b] != pid0[b])].long()
        assert bool(torch.isin(new, want).all())
        assert bool((new <= max(int(L[b]) - S - 1, 0)).all())
        installed_total += want.numel()
    return installed_total


def check_gather(c: Cfg, grp: Group, tk, L, act_plan, act_gather):
    """§8.9 gather ledger + §8.3 last clause (plan and gather agree on actual_seq)."""
    B, S, K = c.B, c.S, c.K
    R = B * S
    assert torch.equal(act_gather[:R], act_plan)
    status = grp.g_status.view(R, K + 1)
    rows = tk.view(R, K)
    n = act_plan.long().unsqueeze(1)
    assert torch.equal((rows >= 0).sum(1, keepdim=True), n)  # contract rows: every id valid
    # status[r, :n] is a permutation of the valid ids, then -1 (rows are suffix-padded with -1)
    assert torch.equal(torch.sort(status[:, :K], dim=1).values, torch.sort(rows, dim=1).values)
    col = torch.arange(K).unsqueeze(0)
    assert bool((status[:, :K][col >= n] == -1).all())
    assert torch.equal(status[:, K], act_plan)
    # selection position p < n holds the full-cache row of status[r, p]
    inside = (col < n).reshape(-1)
    b_of = (torch.arange(R * K) // (S * K))[inside]
    src = status[:, :K].reshape(-1)[inside].long()
    lay = c.gather_layer
    assert torch.equal(_bits(_flat(grp.g_sel_kv)[inside]), _bits(grp.full_kv[lay][b_of, src]))
    if c.Dr:
        assert torch.equal(_bits(_flat(grp.g_sel_rope)[inside]), _bits(grp.full_rope[lay][b_of, src]))


def run_simulation(c: Cfg, restart_every: int = 0) -> dict:
    g = G.gen(c.seed)
    grp = Group(c, g)
    B, S, K, BS = c.B, c.S, c.K, c.BS
    O, Z = 0, c.layers - 1
    growth = (c.steps + 1) * S
    L = torch.randint(K // 2, c.F - growth, (B,), generator=g, dtype=torch.int32)
    prev = None
    totals = {"hits": 0, "misses": 0, "window": 0, "act": 0, "installed": 0}
    steady = {"hits": 0, "misses": 0}
    serve_kw = dict(raw_seq=S, topk=K, selection_block_size=BS, compact_layout=1)
    inst_kw = dict(raw_seq=S, topk=K, selection_block_size=BS)
    for step in range(c.steps):
        L = L + S
        if restart_every and step and step % restart_every == 0:  # one batch row starts a new request
            b = (step // restart_every) % B
            L[b] = K // 2 + S
            grp.reset_row(b, g)
        tk = G.topk(L, S, K, g, prev=prev, reuse=c.reuse)
        prev = tk
        pid0, i2s0, lru0 = grp.pool_ids.clone(), grp.id_to_slot.clone(), grp.lru.clone()

        plan, rec, act = ops.dsa_plan(tk, L, grp.pool_ids, grp.id_to_slot, grp.lru, raw_seq=S, group_id=0)
        check_plan(c, tk, L, plan, rec, act, i2s0)
        for lay in range(c.layers):
            ops.dsa_serve(plan, grp.full_kv[lay], grp.full_rope[lay], grp.pool_kv[lay], grp.pool_rope[lay],
                          grp.sel_kv[lay], grp.sel_rope[lay], **serve_kw)
            check_serve(c, grp, lay, tk, plan)
            if lay != O:
                # §8.6: what a metadata_update=1 call would write, from the same starting state
                expect_kv, expect_rope, *_ = ops.dsa_install_functional(
                    rec, grp.sel_kv[lay], grp.sel_rope[lay], grp.sel_table, grp.pool_kv[lay],
                    grp.pool_rope[lay], grp.pool_ids, grp.id_to_slot, grp.lru, metadata_update=1, **inst_kw)
                ops.dsa_install(rec, grp.sel_kv[lay], grp.sel_rope[lay], grp.sel_table, grp.pool_kv[lay],
                                grp.pool_rope[lay], grp.pool_ids, grp.id_to_slot, grp.lru,
                                metadata_update=0, **inst_kw)
                assert torch.equal(grp.pool_ids, pid0) and torch.equal(grp.id_to_slot, i2s0)
                assert torch.equal(grp.lru, lru0)
                assert torch.equal(_bits(grp.pool_kv[lay]), _bits(expect_kv))
                assert torch.equal(_bits(grp.pool_rope[lay]), _bits(expect_rope))
            if lay == Z:
                ops.dsa_install(rec, grp.sel_kv[O], grp.sel_rope[O], grp.sel_table, grp.pool_kv[O],
                                grp.pool_rope[O], grp.pool_ids, grp.id_to_slot, grp.lru,
                                metadata_update=1, **inst_kw)
        # baseline gather on the same top-k, one layer (identity PA tables)
        lay = c.gather_layer
        act_g = ops.npu_gather_selection_kv_cache(
            grp.g_sel_rope, grp.g_sel_kv, grp.sel_table, grp.g_status, tk,
            grp.full_rope[lay].view(B * c.F // BS, BS, c.Dr) if c.Dr else torch.empty(0, dtype=c.dtype),
            grp.full_kv[lay].view(-1, BS, c.Dkv), grp.full_table,
            L, torch.full((B,), S, dtype=torch.int32), selection_topk_block_size=1)
        check_gather(c, grp, tk, L, act, act_g)
        check_pool(c, grp)
        totals["installed"] += check_install_accounting(c, tk, L, plan, pid0, lru0, grp)

        kinds = plan[:, 0]
        h, m, w = (int((kinds == k).sum()) for k in (POOL_HIT, FULL_OLD_MISS, DECODE_WINDOW))
        assert h + m + w == int(act.sum())  # §8.8
        totals["hits"] += h
        totals["misses"] += m
        totals["window"] += w
        totals["act"] += int(act.sum())
        if step >= c.steps // 4:
            steady["hits"] += h
            steady["misses"] += m
    totals["hit_rate"] = totals["hits"] / max(1, totals["hits"] + totals["misses"])
    totals["steady_hit_rate"] = steady["hits"] / max(1, steady["hits"] + steady["misses"])
    return totals


CONFIGS = [  # the first one is the >= 200-step run; the others add S=4 + row restarts, and S=1
    pytest.param(Cfg(B=2, S=2, K=128, PS=256, BS=64, F=1024, steps=210, seed=1), 0, id="B2-S2-K128-PS256"),
    pytest.param(Cfg(B=3, S=4, K=64, PS=512, BS=32, F=1024, steps=100, seed=2, dtype=torch.float16), 23,
                 id="B3-S4-K64-PS512-restarts"),
    pytest.param(Cfg(B=1, S=1, K=256, PS=256, BS=128, F=2048, steps=60, seed=3, reuse=0.9), 0,
                 id="B1-S1-K256-PS256"),
    # the no-rope mode (Dr = 0): rope tensors [..., 0], [B, PS, 0] pools from the backend's state, the
    # baseline gather in its 1-D empty form (what a no-rope group of the rewrite emits: docs/ops.md §3.3)
    pytest.param(Cfg(B=2, S=2, K=128, PS=256, BS=64, F=1024, steps=60, seed=4, Dr=0), 17, id="B2-S2-K128-no-rope"),
]


@pytest.mark.parametrize("cfg,restart_every", CONFIGS)
def test_group_simulation(cfg, restart_every, caplog):
    caplog.set_level(logging.INFO, logger=log.name)
    with G.single_thread():  # many small ops: faster single-threaded on a loaded box
        t = run_simulation(cfg, restart_every)
    log.info(
        "group simulation %s: steps=%d hits=%d misses=%d window=%d hit_rate=%.3f steady_hit_rate=%.3f",
        cfg, cfg.steps, t["hits"], t["misses"], t["window"], t["hit_rate"], t["steady_hit_rate"],
    )
    print(f"\n[{cfg.B}x{cfg.S}x{cfg.K} PS={cfg.PS}] hit rate {t['hit_rate']:.3f}, "
          f"steady {t['steady_hit_rate']:.3f}, hits {t['hits']}, misses {t['misses']}, window {t['window']}")
    assert t["hits"] + t["misses"] + t["window"] == t["act"]
    assert t["installed"] > 0
    assert t["steady_hit_rate"] > 0.0

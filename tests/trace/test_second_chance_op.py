"""offload_ref::dsa_install_sc (opt-in 16-way second chance): exact against offload-sim's sa_clock step by
step (C++ kernel and pure-Python reference), metadata_update=0 picks the same ways, bad input."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from offload_passes.custom_ops import dsa_install_sc as SC
from offload_passes.trace import sim, synth
from offload_passes.trace.kernel_replay import replay_kernels

CASES = [
    (1, 2, 64, 32, 0.5, 700, 10),    # 2 sets, heavy eviction pressure: second chances and overwrites
    (2, 2, 128, 256, 0.9, 2000, 12),  # S=2: hits repeated across query rows, install dedupe
    (1, 1, 64, 64, 0.95, 400, 14),    # high reuse: many reference bits set
]


def _trace(S, B, K, drift, context, steps):
    return synth.generate(synth.SynthParams(context=context, steps=steps, B=B, S=S, K=K, P=K, drift=drift,
                                            skew=0.8, tau=8.0, seed=5 + S + B))


@pytest.mark.parametrize("S,B,K,PS,drift,context,steps", CASES)
def test_cpp_kernel_matches_simulator_sa_clock(S, B, K, PS, drift, context, steps):
    tr = _trace(S, B, K, drift, context, steps)
    ref = replay_kernels(tr, PS, install_op="offload_ref::dsa_install_sc")
    got = sim.per_step(tr, "sa_clock", PS)
    np.testing.assert_array_equal(got[:, sim.HIT_E], ref[:, 1])
    np.testing.assert_array_equal(got[:, sim.MISS_E], ref[:, 2])
    fifo = replay_kernels(tr, PS)
    assert not np.array_equal(fifo[:, 1], ref[:, 1])  # the policy really differs from FIFO here


def test_reference_matches_simulator(monkeypatch):
    monkeypatch.setenv("OFFLOAD_PASSES_CPU_KERNELS", "reference")
    S, B, K, PS, drift, context, steps = CASES[0]
    tr = _trace(S, B, K, drift, context, steps)
    ref = replay_kernels(tr, PS, install_op="offload_ref::dsa_install_sc")
    got = sim.per_step(tr, "sa_clock", PS)
    np.testing.assert_array_equal(got[:, sim.HIT_E], ref[:, 1])


def _one_step_inputs(B=2, S=1, K=64, PS=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    IR = 400
    pool_ids = torch.full((B, PS), -1, dtype=torch.int32)
    id_to_slot = torch.full((B, IR), -1, dtype=torch.int32)
    # a warm pool: ids 0..PS-1 resident in order, some reference bits and pointers set
    for b in range(B):
        pool_ids[b] = torch.arange(PS, dtype=torch.int32)
        id_to_slot[b, :PS] = torch.arange(PS, dtype=torch.int32)
    lru = torch.randint(0, 1 << 20, (B, PS // 16), generator=g, dtype=torch.int32)
    topk = torch.stack([torch.randperm(300, generator=g)[:K] for _ in range(B * S)]).to(torch.int32)
    topk = topk.view(B, S, 1, K)
    L = torch.full((B,), 350, dtype=torch.int32)
    plan, rec, _ = torch.ops.custom.dsa_plan(topk, L, pool_ids, id_to_slot, lru, raw_seq=S)
    sbs = 16
    nb = B * S * K // sbs
    sel_kv = torch.randn(nb, sbs, 8, generator=g).to(torch.bfloat16)
    sel_rope = torch.randn(nb, sbs, 4, generator=g).to(torch.bfloat16)
    table = torch.arange(nb, dtype=torch.int32).view(B * S, K // sbs)
    pools = (torch.zeros(B, PS, 8, dtype=torch.bfloat16), torch.zeros(B, PS, 4, dtype=torch.bfloat16))
    return plan, rec, sel_kv, sel_rope, table, pools, pool_ids, id_to_slot, lru, dict(raw_seq=S, topk=K,
                                                                                      selection_block_size=sbs)


def test_cpp_equals_reference_and_metadata_update_0_picks_the_same_ways():
    plan, rec, sel_kv, sel_rope, table, pools, pid, i2s, lru, kw = _one_step_inputs()
    states = []
    for mode in ("cpp", "reference"):
        st = [t.clone() for t in (*pools, pid, i2s, lru)]
        if mode == "cpp":
            torch.ops.offload_ref.dsa_install_sc(plan, rec, sel_kv, sel_rope, table, *st, **kw)
        else:
            SC.reference_dsa_install_sc(plan, rec, sel_kv, sel_rope, table, *st, **kw)
        states.append(st)
    for a, b in zip(*states):
        assert torch.equal(a, b)
    # metadata_update=0: payload identical to the update=1 call, metadata untouched
    st0 = [t.clone() for t in (*pools, pid, i2s, lru)]
    torch.ops.offload_ref.dsa_install_sc(plan, rec, sel_kv, sel_rope, table, *st0, metadata_update=0, **kw)
    assert torch.equal(st0[0], states[0][0]) and torch.equal(st0[1], states[0][1])
    assert torch.equal(st0[2], pid) and torch.equal(st0[3], i2s) and torch.equal(st0[4], lru)
    # pointer bits stay in 0..3, reference bits in 4..19
    assert int((states[0][4] >> 20).abs().max()) == 0


def test_bad_plan_is_rejected_before_any_write():
    plan, rec, sel_kv, sel_rope, table, pools, pid, i2s, lru, kw = _one_step_inputs()
    before = [t.clone() for t in (*pools, pid, i2s, lru)]
    st = [t.clone() for t in before]
    with pytest.raises(RuntimeError, match=r"offload_ref::dsa_install_sc: plan must be int32 \[B\*raw_seq\*topk=128, 2\]"):
        torch.ops.offload_ref.dsa_install_sc(plan[:-1], rec, sel_kv, sel_rope, table, *st, **kw)
    with pytest.raises(RuntimeError, match="offload_ref::dsa_install_sc: metadata_update must be"):
        torch.ops.offload_ref.dsa_install_sc(plan, rec, sel_kv, sel_rope, table, *st, metadata_update=2,
                                             **kw)
    for a, b in zip(st, before):
        assert torch.equal(a, b)


def test_fifo_default_is_unchanged_by_the_option():
    """custom::dsa_install stays FIFO: same counts as the simulator's sa_fifo on the same trace."""
    tr = _trace(*[CASES[0][i] for i in (0, 1, 2, 4, 5, 6)])
    fifo = replay_kernels(tr, 32)
    np.testing.assert_array_equal(sim.per_step(tr, "sa_fifo", 32)[:, sim.HIT_E], fifo[:, 1])

"""The serving loop (models/glm/serve.py) with a KV store: a returning conversation's prefix is reloaded into
the request's KV and only the rest is prefilled; every step equals the unmodified model that recomputes the
same prefix with the same boundary (reference lanes), and the compiled offload equals the unmodified model."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_passes import make_offload_backend, models
from offload_passes.models.glm.reuse import prefill_from
from offload_passes.models.glm.serve import Lane, Server, ServeConfig
from offload_passes.state import module_state
from offload_passes.store import DiskTier, KVStore, RamTier
from offload_passes.store.paged import (PagedStore, RecomputeReference, extract_paged, insert_paged, paged_caches,
                                        paged_fingerprint)

KW = dict(enable_offload=True, batch_size=2, next_n=1, pa_max_length=256, prefill_len=64, decode_steps=8)
C = 16  # chunk tokens (= the tiny preset's block size)
MT = ServeConfig(seed=1, output_len=(2, 4), workload="multiturn", shared_prefix=40, branches=3, turns=3,
                 user_len=(4, 20))


def _models(n: int = 3):
    torch._dynamo.reset()
    return [models.build("tiny", **KW).model for _ in range(n)], models.build("tiny", **dict(KW, batch_size=1)).model


def _store(pm, tiers=None) -> PagedStore:
    return PagedStore(KVStore(paged_fingerprint(pm, C, weights_id="tiny-seed0"), C, tiers or [RamTier(1 << 26)],
                              block_size=C))


def _run(srv: Server, max_steps: int = 60) -> tuple[list, int]:
    diffs, n = [], 0
    while not srv.done and n < max_steps:
        outs = srv.step()
        n += 1
        if outs[0].numel():
            diffs.append(max((outs[0].float() - o.float()).abs().max().item() for o in outs[1:]))
    return diffs, n


def test_multi_turn_reuse_is_exact_and_computes_less():
    """Restored lane, compiled offload lane, reference lane (same boundaries recomputed): 0 every step; the
    offload keeps pool hits; the prefill computes only what is new."""
    (rl, cm, ref), pm = _models()
    ps = _store(pm)
    be = make_offload_backend(pool_size=256)
    srv = Server([Lane(rl), Lane(cm, torch.compile(cm, backend=be), lambda s: module_state(cm).move_rows(s)),
                  Lane(ref, reference=True)], pm, MT, store=ps, reference=RecomputeReference(ps))
    diffs, n = _run(srv)
    assert srv.done and srv.finished == 9, (n, srv.finished)  # 3 branches x 3 turns
    assert max(diffs) == 0.0, diffs
    st = srv.reuse_stats()
    assert st["prefill_tokens_computed"] < st["prefill_tokens_total"] * 0.6, st
    assert st["admitted_with_hit"] >= 6 and st["chunks_loaded"]["ram"] > 0 and st["chunks_rejected"] == 0, st
    assert module_state(cm).totals()["hits"] > 0


def test_the_reference_lane_sees_a_wrong_reload():
    """The comparison can fail: a store whose reload writes one token's latent off by one ulp-scale step
    shows up as a nonzero difference against the reference lane."""
    (rl, ref), pm = _models(2)
    ps = _store(pm)
    real = ps.reload

    def skewed(model, tokens, limit):
        n = real(model, tokens, limit)
        if n:
            model.model.layers[0].self_attn.kv_cache.view(-1, 64)[0] += 0.5
        return n

    ps.reload = skewed
    srv = Server([Lane(rl), Lane(ref, reference=True)], pm, MT, store=ps, reference=RecomputeReference(ps))
    diffs, _ = _run(srv, 30)
    assert max(diffs) > 0.0


def test_rejected_chunk_is_recomputed_and_the_answer_is_unchanged(tmp_path):
    """A stored chunk corrupted on disk is rejected when it is read (counted, deleted), the prefix ends before
    it and the rest is recomputed: the reloaded lane still equals the recompute lane every step, and the loop
    computes more prefill tokens than the same loop with an intact store. (A byte tier's chunk is verified at
    every read; the RAM tier keeps chunks verified when they entered the process, so this store has no RAM.)"""
    stats = []
    for corrupt in (False, True):
        (rl, ref), pm = _models(2)
        disk = DiskTier(tmp_path / f"kv{int(corrupt)}", 1 << 26, fsync=False)
        ps = _store(pm, [disk])
        srv = Server([Lane(rl), Lane(ref, reference=True)], pm, MT, store=ps, reference=RecomputeReference(ps))
        diffs, done = [], False
        while not srv.done and len(diffs) < 60:
            if corrupt and not done and srv.finished >= 3:
                key = ps.store.chunk_keys(srv.workload.prefix)[0]  # every later prompt starts with it
                path = disk.path / key[:2] / f"{key}.safetensors"
                blob = bytearray(path.read_bytes())
                blob[-1] ^= 0xFF  # a flipped byte of tensor data: its checksum fails
                path.write_bytes(bytes(blob))
                done = True
            a, b = srv.step()
            diffs.append((a.float() - b.float()).abs().max().item() if a.numel() else 0.0)
        assert max(diffs) == 0.0, diffs
        stats.append(srv.reuse_stats())
    clean, bad = stats
    assert bad["chunks_rejected"] == 1 and clean["chunks_rejected"] == 0, (clean, bad)
    assert bad["prefill_tokens_total"] == clean["prefill_tokens_total"], (clean, bad)
    assert bad["prefill_tokens_computed"] > clean["prefill_tokens_computed"], (clean, bad)


def test_prefill_from_equals_a_split_prefill_and_refuses_bad_input():
    """``prefill_from`` on a reloaded prefix equals it on the same prefix prefilled; extract / insert round-trip
    the paged caches by block table (every cache: latent, rope, indexer keys)."""
    _, pm = _models(0)
    ids = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(0))
    pm.prefill(ids[:40].view(1, 40), torch.tensor([40]))
    a = prefill_from(pm, ids, 40)
    chunks = extract_paged(pm, pm.block_table[0].tolist(), 40, C)
    assert [int(c["0.kv"].shape[0]) for c in chunks] == [16, 16, 8]
    assert set(chunks[0]) == set(paged_caches(pm)) and "0.index_k" in chunks[0] and "1.index_k" not in chunks[0]
    pm.reset_caches()
    assert insert_paged(pm, pm.block_table[0].tolist(), chunks) == 40
    assert torch.equal(prefill_from(pm, ids, 40), a)
    with pytest.raises(ValueError, match=r"prefill_from: start must be an int with 1 <= start < len\(input_ids\)=70"):
        prefill_from(pm, ids, 70)
    with pytest.raises(TypeError, match="prefill_from: input_ids must be a 1-D int64 tensor"):
        prefill_from(pm, ids.view(1, -1), 4)


def test_server_and_config_refuse_bad_reuse_input():
    (rl,), pm = _models(1)
    with pytest.raises(ValueError, match="ServeConfig.workload must be 'random' or 'multiturn', got 'chat'"):
        ServeConfig(workload="chat")
    with pytest.raises(ValueError, match=r"ServeConfig.turns must be an int >= 1, got 0"):
        ServeConfig(turns=0)
    with pytest.raises(ValueError, match="reference lanes need a store and a reference"):
        Server([Lane(rl), Lane(rl, reference=True)], pm, MT)
    with pytest.raises(TypeError, match=r"Server: store must have a reload\(\) method"):
        Server([Lane(rl)], pm, MT, store=object())


def _property_case(seed: int, branches: int, turns: int, budget_chunks: int, retract: float) -> None:
    (rl, ref), pm = _models(2)
    per_chunk = paged_fingerprint(pm, C, weights_id="tiny-seed0").bytes_per_token() * C + 8192
    ps = _store(pm, [RamTier(per_chunk * budget_chunks)])  # a small budget: LRU evictions
    reference = RecomputeReference(ps)
    cfg = ServeConfig(seed=seed, output_len=(1, 3), workload="multiturn", shared_prefix=24, branches=branches,
                      turns=turns, user_len=(1, 20), retract=retract)
    hits = []
    for phase in range(2):  # a restart: a new loop (no request, empty decode caches) over the same store
        srv = Server([Lane(rl), Lane(ref, reference=True)], pm, cfg, store=ps, reference=reference)
        diffs, _ = _run(srv, 40)
        assert not diffs or max(diffs) == 0.0, (phase, diffs)
        hits.append(srv.reuse_stats()["admitted_with_hit"])
    assert ps.stats.chunks_rejected == 0
    if budget_chunks >= 10:  # the same conversations after the restart: their first turns come back stored
        assert hits[1] > 0, hits


def test_random_multi_turn_workloads_equal_the_recompute_lane_every_step():
    """Hypothesis: random conversations (branches, turns, retractions), a RAM tier small enough to evict and a
    restart over the same store: every step of the reloaded lane equals the recompute lane."""
    @settings(max_examples=4, deadline=None, derandomize=True)
    @given(st.integers(0, 1000), st.integers(1, 3), st.integers(1, 3), st.integers(2, 40), st.sampled_from([0.0, 0.3]))
    def prop(seed, branches, turns, budget_chunks, retract):
        _property_case(seed, branches, turns, budget_chunks, retract)

    prop()

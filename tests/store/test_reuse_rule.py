"""The reload-or-recompute rule applied by the KV store: a found prefix is reloaded only when its predicted
reload (priced at the slowest tier among its chunks) beats recomputing it; each decision is counted. The
serving loop with a rule that always recomputes computes every prompt token and stays exact; ``--store
...,rule=measured`` is parsed and bad values are refused."""
from __future__ import annotations

import pytest
import torch

from offload_passes.apps import demo
from offload_passes._cli import UsageError
from offload_passes.apps.serve_store import parse_store
from offload_passes.store import DiskTier, KVStore, RamTier, ReuseRule, TierCost
from offload_passes.store.rule import fit_prefill_cost
from offload_passes.store.stats import Decision

from store_helpers import chunks_for, make_fp, same

C = 16
BPT = 28  # make_fp's caches: 8 bf16 + 4 bf16 + 4 int8 per token
# recompute 1 ms per token; disk: 50 ms fixed + 1 us per token; RAM: free. Disk breaks even at 50.05 tokens.
DISK = TierCost(fixed_s=0.05, bytes_per_s=BPT * 1e6)
RULE = ReuseRule(lambda n: 1e-3 * n, {"ram": TierCost(0.0, 1e12), "disk": DISK})


def _ids(n: int) -> list[int]:
    return [(7 * i + 3) % 1000 for i in range(n)]


def _disk_store(tmp_path, ids: list, rule=RULE) -> KVStore:
    fp = make_fp()
    KVStore(fp, C, [DiskTier(tmp_path / "kv", budget_bytes=1 << 24)]).put(ids, chunks_for(fp, ids, C))
    return KVStore(fp, C, [RamTier(1 << 24), DiskTier(tmp_path / "kv", budget_bytes=1 << 24)], rule=rule)


def test_short_prefix_from_a_slow_tier_is_recomputed_and_a_long_one_reloaded(tmp_path):
    ids = _ids(128)
    kv = _disk_store(tmp_path, ids)
    assert kv.fp.bytes_per_token() == BPT
    n, chunks = kv.load(ids[:32] + [1, 2])  # 32 stored tokens: 50.03 ms reload vs 32 ms recompute
    assert (n, chunks) == (0, [])
    st = kv.stats
    assert (st.decisions_reload, st.decisions_recompute, st.tokens_loaded, st.chunks_loaded) == (0, 1, 0, {})
    assert st.last_decision == Decision(32, "disk", pytest.approx(0.05 + 32e-6), pytest.approx(0.032), False)
    n, chunks = kv.load(ids, limit=48)  # the cap counts: 48 tokens still lose
    assert n == 0 and kv.stats.decisions_recompute == 2 and kv.stats.last_decision.tokens == 48
    n, chunks = kv.load(ids)  # 128 tokens: 50.13 ms reload vs 128 ms recompute
    assert n == 128 and same(chunks, chunks_for(kv.fp, ids, C))
    st = kv.stats
    assert (st.decisions_reload, st.decisions_recompute, st.chunks_loaded) == (1, 2, {"disk": 8})
    assert st.last_decision == Decision(128, "disk", pytest.approx(0.05 + 128e-6), pytest.approx(0.128), True)
    # the reload promoted every chunk into RAM: now the same short prefix is reloaded (RAM costs nothing)
    assert kv.load(ids[:32] + [1, 2])[0] == 32 and kv.stats.last_decision.tier == "ram"


def test_a_mix_of_tiers_is_priced_at_the_slowest(tmp_path):
    ids = _ids(64)
    kv = _disk_store(tmp_path, ids)
    kv.put(ids[:16], chunks_for(kv.fp, ids[:16], C))  # chunk 0 also in RAM: the load finds ram, disk, disk, disk
    assert [c[1] for c in kv.lookup(ids).chunks] == ["ram", "disk", "disk", "disk"]
    assert kv.load(ids[:40] + [5])[0] == 0  # 40 tokens, priced at disk: recomputed
    assert kv.stats.last_decision.tier == "disk" and kv.stats.decisions_recompute == 1
    assert kv.load(ids)[0] == 64 and kv.stats.decisions_reload == 1  # 64 tokens beat disk's 50 ms


def test_no_rule_decides_nothing_and_a_miss_decides_nothing(tmp_path):
    ids = _ids(32)
    kv = _disk_store(tmp_path, ids, rule=None)
    assert kv.load(ids)[0] == 32
    kv2 = _disk_store(tmp_path, ids)
    assert kv2.load(_ids(40)[::-1])[0] == 0  # nothing stored for these tokens
    for st in (kv.stats, kv2.stats):
        assert (st.decisions_reload, st.decisions_recompute, st.last_decision) == (0, 0, None)


def test_bad_rule_is_refused(tmp_path):
    fp = make_fp()
    with pytest.raises(TypeError, match=r"^KVStore: rule must be None or a ReuseRule, got str$"):
        KVStore(fp, C, [RamTier(1 << 20)], rule="measured")
    with pytest.raises(ValueError, match=r"^KVStore: rule has no TierCost for tier\(s\) \['disk'\]; it prices \['ram'\]"):
        KVStore(fp, C, [RamTier(1 << 20), DiskTier(tmp_path / "d", budget_bytes=1 << 20)],
                rule=ReuseRule(lambda n: 0.0, {"ram": TierCost(0.0, 1e9)}))


def test_fit_prefill_cost():
    f = fit_prefill_cost([(10, 0.011), (100, 0.2)])  # a = 1e-3, b = 1e-5
    assert f.coefficients == (pytest.approx(1e-3), pytest.approx(1e-5))
    assert f(50) == pytest.approx(0.075) and f(0) == 0.0
    g = fit_prefill_cost([(10, 0.02), (20, 0.02)])  # b < 0 from noise: linear through the longer point
    assert g.coefficients == (pytest.approx(1e-3), 0.0)
    for bad in ([(10, 0.1)], [(20, 0.1), (10, 0.2)], [(10, -1.0), (20, 0.1)], [(1.5, 0.1), (20, 0.1)]):
        with pytest.raises(ValueError, match="^fit_prefill_cost: points must be"):
            fit_prefill_cost(bad)


def test_store_rule_is_parsed():
    assert parse_store("rule=measured,ram=64MiB") == {"ram": (64 << 20,), "rule": ("measured",)}
    assert "rule" not in parse_store("ram=64MiB")
    for text, msg in [("ram=64MiB,rule=fast", "--store: 'rule=fast': the only rule is rule=measured"),
                      ("ram=64MiB,rule=measured,rule=measured", "--store names the rule twice"),
                      ("rule=measured", "--store must name at least one tier")]:
        with pytest.raises(UsageError, match="^" + msg.replace("(", r"\(").replace("[", r"\[")):
            parse_store(text)


def test_bad_rule_value_is_one_line_and_exit_2(capsys):
    assert demo.main(["--serve", "--store", "ram=64MiB,rule=cheap", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "offload-demo: error: --store: 'rule=cheap': the only rule is rule=measured"


def test_serving_loop_with_a_rule_that_always_recomputes_is_exact():
    """prefill cost 0: no reload ever wins, every found prefix is recomputed (counted), and the reference lane
    (which recomputes the same boundary, here the whole prompt) matches bit for bit."""
    from offload_passes import models
    from offload_passes.models.glm.serve import Lane, Server, ServeConfig
    from offload_passes.store.paged import PagedStore, RecomputeReference, paged_fingerprint

    kw = dict(enable_offload=True, batch_size=2, next_n=1, pa_max_length=256, prefill_len=64, decode_steps=8)
    torch._dynamo.reset()
    rl, ref = (models.build("tiny", **kw).model for _ in range(2))
    pm = models.build("tiny", **dict(kw, batch_size=1)).model
    rule = ReuseRule(lambda n: 0.0, {"ram": TierCost(0.0, 1e12)})
    ps = PagedStore(KVStore(paged_fingerprint(pm, C, weights_id="tiny-seed0"), C, [RamTier(1 << 26)],
                            block_size=C, rule=rule))
    cfg = ServeConfig(seed=1, output_len=(2, 4), workload="multiturn", shared_prefix=40, branches=3, turns=2,
                      user_len=(4, 20))
    srv = Server([Lane(rl), Lane(ref, reference=True)], pm, cfg, store=ps, reference=RecomputeReference(ps))
    diffs, steps = [], 0
    while not srv.done and steps < 60:
        outs = srv.step()
        steps += 1
        if outs[0].numel():
            diffs.append((outs[0].float() - outs[1].float()).abs().max().item())
    assert srv.done and diffs and max(diffs) == 0.0, (steps, diffs)
    st = srv.reuse_stats()
    assert st["prefill_tokens_computed"] == st["prefill_tokens_total"] > 0 and st["admitted_with_hit"] == 0, st
    kst = ps.stats
    assert kst.decisions_recompute >= 4 and kst.decisions_reload == 0 and kst.tokens_loaded == 0, kst
    assert kst.chunks_stored["ram"] > 0 and kst.last_decision.reload is False

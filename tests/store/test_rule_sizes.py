"""The reuse decision (transfer + fixed < recompute), tier measurement, and per-token KV bytes of the
models/glm presets."""
from __future__ import annotations

import sys

import pytest
import torch

from offload_passes.models.glm.config import load_config
from offload_passes.store import DiskTier, Fingerprint, RamTier, ReuseRule, TierCost
from offload_passes.store.rule import measure_tier
from offload_passes.store.sizes import glm_cache_layout, kv_bytes_per_token


def test_rule_reloads_when_transfer_plus_fixed_beats_recompute():
    # recompute: 1 ms fixed + 10 us a token; disk: 5 ms fixed, 1 GB/s; 1000 bytes a token -> 1 us a token
    rule = ReuseRule(lambda n: 1e-3 + 1e-5 * n, {"disk": TierCost(5e-3, 1e9), "slow": TierCost(2e-3, 1e7)})
    # reload wins when 5e-3 + 1e-6 n < 1e-3 + 1e-5 n  <=>  n > 4e-3 / 9e-6 = 444.4
    assert not rule.reload(444, "disk", 1000) and rule.reload(445, "disk", 1000)
    assert rule.break_even("disk", 1000) == 445
    assert not rule.reload(0, "disk", 1000)
    # 2 ms + 1e-4 s a token of transfer against 1 ms + 1e-5 s a token of compute: never
    assert rule.break_even("slow", 1000) == sys.maxsize and not rule.reload(10**6, "slow", 1000)
    with pytest.raises(KeyError, match="ReuseRule.reload: tier 'ram' has no cost; known: \\['disk', 'slow'\\]"):
        rule.reload(10, "ram", 1000)
    with pytest.raises(ValueError, match="bytes_per_token must be a positive int, got 0"):
        rule.break_even("disk", 0)
    with pytest.raises(ValueError, match="TierCost: bytes_per_s must be > 0, got 0"):
        TierCost(0.0, 0)
    with pytest.raises(ValueError, match="TierCost: fixed_s must be >= 0, got -1"):
        TierCost(-1, 1.0)


def test_measure_tier_fits_a_cost(tmp_path):
    for tier in (RamTier(1 << 24), DiskTier(tmp_path / "m", 1 << 24, fsync=False)):
        t = measure_tier(tier, sizes=(1 << 16, 1 << 20), repeats=2)
        assert t.tier == tier.name and set(t.get_s) == {1 << 16, 1 << 20}
        assert t.cost.bytes_per_s > 0 and t.cost.fixed_s >= 0 and tier.used_bytes == 0
    with pytest.raises(ValueError, match="tier 'ram' did not keep a blob of 1048576 bytes"):
        measure_tier(RamTier(1000), sizes=(100, 1 << 20))


@pytest.mark.parametrize("preset,total,attention,indexer", [
    ("tiny", 1408, 8 * (64 + 16) * 2, 2 * 32 * 2),  # FSSSFSSS: 2 layers keep indexer keys
    ("small", 5888, 16 * (128 + 32) * 2, 6 * 64 * 2),  # groups {0},{1},{2..5},{6..9},{10..13},{14,15}
    ("glm-5.2-78l", 95232, 78 * (512 + 64) * 2, 21 * 128 * 2),
])
def test_kv_bytes_per_token_of_the_presets(preset, total, attention, indexer):
    b = kv_bytes_per_token(load_config(preset))
    assert (b.total, b.attention, b.indexer_keys, b.indexer_scales) == (total, attention, indexer, 0)
    if preset == "glm-5.2-78l":
        assert round(b.indexer_share * 100, 1) == 5.6


def test_w8a8_indexer_keys_are_int8_with_fp16_scales():
    cfg = load_config("tiny-w8a8")
    layout = glm_cache_layout(cfg)
    assert layout["layers.0.self_attn.indexer.key_cache"] == ((1, 32), torch.int8)
    assert layout["layers.0.self_attn.indexer.key_scale_cache"] == ((1,), torch.float16)
    assert "layers.1.self_attn.indexer.key_cache" not in layout  # a shared layer
    b = kv_bytes_per_token(cfg)
    assert (b.attention, b.indexer_keys, b.indexer_scales, b.total) == (1280, 2 * 32, 2 * 2, 1348)
    fp = Fingerprint.of({"model": "tiny-w8a8", "caches": layout})
    assert fp.bytes_per_token() == b.total

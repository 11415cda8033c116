"""offload-capacity's store section: bytes per token by cache, and the break-even prefix length per tier."""
from __future__ import annotations

import json
import re

import pytest

from offload_passes import models
from offload_passes.store.rule import ReuseRule, TierCost
from offload_passes.store.sizes import kv_bytes_per_token
from offload_passes.tools.capacity_plan import main
from offload_passes.tools.capacity_plan_model import load_model_shape
from offload_passes.tools.capacity_plan_reuse import DEVICES, TIERS, prefill_cost


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("config,total,share", [("tiny", 1408, "9.1"), ("small", 5888, "13.0"),
                                                ("glm-5.2-78l", 95232, "5.6")])
def test_bytes_per_token_are_the_stores(capsys, config, total, share):
    kv = kv_bytes_per_token(models.load_config(config))
    assert kv.total == total
    rc, out, _ = _run(capsys, "--config", config)
    assert rc == 0
    assert re.search(rf"^  total +=\s+{total:,} B$", out, re.M)
    assert re.search(rf"^  indexer keys share +=\s+{share} %$", out, re.M)
    rc, out, _ = _run(capsys, "--config", config, "--json")
    b = json.loads(out)["store"]["bytes_per_token"]
    assert b["latent"] + b["rope"] == kv.attention
    assert (b["indexer_keys"], b["indexer_scales"], b["total"]) == (kv.indexer_keys, kv.indexer_scales, total)


def test_w8a8_scales_have_their_line(capsys):
    kv = kv_bytes_per_token(models.load_config("tiny-w8a8"))
    rc, out, _ = _run(capsys, "--config", "tiny-w8a8", "--json")
    b = json.loads(out)["store"]["bytes_per_token"]
    assert rc == 0 and b["indexer_scales"] == kv.indexer_scales == 4 and b["indexer_keys"] == 64


def test_break_even_is_the_rules(capsys):
    tiers = {"ram": (1e-3, 2.0), "disk": TIERS["disk"][:2], "shared": (0.05, 1.0)}
    rc, out, _ = _run(capsys, "--config", "tiny", "--json", "--tier", "ram=1e-3:2", "--tier", "shared=0.05:1")
    assert rc == 0
    got = json.loads(out)["store"]
    rule = ReuseRule(prefill_cost(load_model_shape("tiny"), DEVICES["a3"]),
                     {"ram": TierCost(1e-3, 2e9), "disk": TierCost(*TIERS["disk"][:2]), "shared": TierCost(0.05, 1e9)})
    want = {n: rule.break_even(n, 1408) for n in tiers}
    assert got["break_even"] == want
    assert 1 < want["ram"] < want["shared"]  # a fixed cost 50x larger needs a longer prefix
    assert not rule.reload(want["ram"] - 1, "ram", 1408) and rule.reload(want["ram"], "ram", 1408)
    rc, text, _ = _run(capsys, "--config", "tiny", "--tier", "ram=1e-3:2", "--tier", "shared=0.05:1")
    for n, v in want.items():
        assert re.search(rf"^  break-even {n} +=\s+{v:,} tokens", text, re.M)


def test_glm52_full_size_break_even_uses_the_full_model(capsys):
    rc, out, _ = _run(capsys, "--config", "glm-5.2-78l", "--weights-like", "glm-5.2", "--json")
    s = json.loads(out)["store"]
    rule = ReuseRule(prefill_cost(load_model_shape("glm-5.2"), DEVICES["a3"]),
                     {n: TierCost(f, b) for n, (f, b, _) in TIERS.items()})
    assert rc == 0 and s["prefill"]["from"] == "glm-5.2"
    assert s["break_even"] == {n: rule.break_even(n, 95232) for n in TIERS}


@pytest.mark.parametrize("value,msg", [
    ("ram=-1:5", "--tier ram: FIXED_S must be a finite number in [0, 10] (seconds per reload), got '-1'"),
    ("ram=11:5", "--tier ram: FIXED_S must be a finite number in [0, 10] (seconds per reload), got '11'"),
    ("disk=nan:5", "--tier disk: FIXED_S must be a finite number in [0, 10] (seconds per reload), got 'nan'"),
    ("disk=0:0", "--tier disk: GBPS must be a finite number in (0, 10000] (GB/s), got '0'"),
    ("shared=0:inf", "--tier shared: GBPS must be a finite number in (0, 10000] (GB/s), got 'inf'"),
    ("shared=0:x", "--tier shared: GBPS must be a finite number in (0, 10000] (GB/s), got 'x'"),
    ("nvme=0:1", "--tier must be NAME=FIXED_S:GBPS with NAME one of ram, disk, shared, got 'nvme=0:1'"),
    ("ram=0.1", "--tier must be NAME=FIXED_S:GBPS with NAME one of ram, disk, shared, got 'ram=0.1'"),
])
def test_bad_tier_is_one_line_exit_2(capsys, value, msg):
    rc, out, err = _run(capsys, "--config", "tiny", "--tier", value)
    assert rc == 2 and out == ""
    assert err.splitlines() == [f"offload-capacity: error: {msg}"]

"""Short version of ``benchmarks/soak.py`` (the long run's figures: docs/performance.md, "Soak"): random per-row
new requests, announced and unannounced, every step compared with the unmodified model."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend_helpers import load_file

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def _soak():
    return load_file("offload_soak", SOAK)


@pytest.mark.parametrize("bookkeeping", [True, False], ids=["ledger", "no-ledger"])
def test_short_soak_is_exact_and_keeps_invariants(bookkeeping):
    soak = _soak()
    # p_new 0.15 over 40 steps and 2 rows: both kinds of new request happen (seeded), by several re-fill paths
    out = soak.run(steps=40, pool_size=64, p_new=0.15, seed=3, max_prompt=200, rss_after=10, bookkeeping=bookkeeping)
    n = out["new_requests"]
    assert sum(1 for v in n["by_path"].values() if v) >= 2, n
    assert out["steps"] == 40 and out["rewritten"] and out["graphs_compiled"] == 1
    assert n["announced"] >= 1 and n["unannounced"] >= 1, n
    assert out["max_abs_diff_logits"] == 0  # bit-exact rewrite (fp64 SFA reference)
    assert out["invariant_violations"] == 0, out["violation_examples"]
    assert out["hits"] > 0 and out["misses"] > 0


def test_invariant_checker_detects_a_stale_pool():
    soak = _soak()

    class G:
        group_id, layers = 0, [0]
        pool_ids = torch.full((1, 16), -1, dtype=torch.int32)
        id_to_slot = torch.full((1, 32), -1, dtype=torch.int32)
        lru_counter = torch.zeros(1, 1, dtype=torch.int32)

    class St:
        groups = [G]
        pools = {0: (torch.zeros(1, 16, 4), torch.zeros(1, 16, 2))}

    full = (torch.arange(32 * 4, dtype=torch.float).view(1, 32, 4), torch.zeros(1, 32, 2))
    assert soak.pool_violations(St, lambda l: full) == []
    G.pool_ids[0, 3], G.id_to_slot[0, 5] = 5, 3  # id 5 in slot 3 (one set: any slot), content stale
    assert soak.pool_violations(St, lambda l: full) == ["group 0 row 0: pool of layer 0 differs from the full cache"]
    St.pools[0][0][0, 3] = full[0][0, 5]
    assert soak.pool_violations(St, lambda l: full) == []
    G.id_to_slot[0, 7] = 3
    assert "id_to_slot -> pool_ids not inverse" in soak.pool_violations(St, lambda l: full)[0]

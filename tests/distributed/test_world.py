"""Two gloo ranks on the loopback (spawned, bounded time): the recipe's W = 2 layout of ``tiny``
(attention data parallel, one row per rank; expert-parallel MoE; vocab-parallel embedding / lm_head)
through the offload backend, every rank against its own unmodified model.

One spawn runs both modes on both ranks (eager, then inductor; the reference in inductor mode is the
unmodified model through plain Inductor, as tests/lowering/test_cpu_inductor.py does). Inductor runs ``tiny``
cut to 4 layers (``FSFS``: two groups, 3 MoE layers) to halve its two compiles per rank. A hang
(collectives out of order) is a failure after the timeout, never a blocked run.
"""
from __future__ import annotations

import pytest
import torch

from offload_passes import models
from offload_passes.apps.demo import ATTN_TOL, LOGITS_TOL
from offload_passes.apps.world import comparable_report, spawn, spawn_world
from world_helpers import mc2_rank

STEPS = 3
TIMEOUT_S = 600.0
INDUCTOR_CUT = {"num_hidden_layers": 4, "index_topk_pattern": "FSFS"}
GROUPS = {"eager": [[0, 1, 2, 3], [4, 5, 6, 7]], "inductor": [[0, 1], [2, 3]]}


def expected_kinds(moe_layers: int) -> list[str]:
    """Per decode graph at W = 2, in order (layer 0 is dense, every other layer MoE)."""
    return (["all_gather_into_tensor", "reduce_scatter_tensor"]       # vocab-parallel embedding
            + ["all_to_all_single"] * 3 * moe_layers                   # dispatch (rows, ids), combine
            + ["all_gather_into_tensor", "all_to_all_single"])         # vocab-parallel lm_head


@pytest.fixture(scope="module")
def world():
    res = spawn_world(2, {"modes": ["eager", "inductor"], "steps": STEPS, "pool_size": 64, "keep_logits": True,
                          "mode_overrides": {"inductor": INDUCTOR_CUT}}, timeout_s=TIMEOUT_S)
    for r in res:
        assert r["ok"], f"rank {r['rank']}: {r.get('error')}\n{r.get('traceback', '')}"
    return res


def test_eager_rewrite_is_bit_exact_on_every_rank(world):
    for r in world:
        run = r["runs"]["eager"]
        assert run["B"] == 1 and run["steps"] == STEPS  # the global batch of 2, one row per rank
        assert run["reports"][-1]["rewritten"] and run["reports"][-1]["refusals"] == []
        assert run["max_abs_diff"] == {"logits": 0.0, "attn": 0.0}, (r["rank"], run["max_abs_diff"])
        assert run["totals"]["hits"] + run["totals"]["misses"] > 0


def test_inductor_rewrite_matches_unmodified_inductor_on_every_rank(world):
    for r in world:
        run = r["runs"]["inductor"]
        assert run["reports"][-1]["rewritten"] and run["reports"][-1]["mode"] == "inductor"
        d = run["max_abs_diff"]
        assert d["logits"] <= LOGITS_TOL and d["attn"] <= ATTN_TOL, (r["rank"], d)


def test_collective_sequence_unchanged_by_rewrite_and_lowering_and_equal_across_ranks(world):
    for mode in ("eager", "inductor"):
        per_rank = [r["runs"][mode]["graphs"] for r in world]
        assert per_rank[0] == per_rank[1]
        (g,) = per_rank[0]  # one decode graph (fullgraph=True, no recompile over the steps)
        assert [c[0] for c in g["dynamo"]] == expected_kinds(7 if mode == "eager" else 3)
        assert g["rewrite"] == g["dynamo"]
        if mode == "eager":  # the AOT-functionalized, reinplaced graph that runs
            assert g["final"] == g["dynamo"]
        groups = {c[1][-1] for c in g["dynamo"]}
        assert len(groups) == 1  # every collective on the one (world) group, by name


def test_rewrite_decisions_and_reports_equal_across_ranks(world):
    for mode in ("eager", "inductor"):
        reps = [[comparable_report(x) for x in r["runs"][mode]["reports"]] for r in world]
        assert reps[0] == reps[1]
        rep = reps[0][-1]
        assert [g["layers"] for g in rep["groups"]] == GROUPS[mode]
        n_layers = sum(len(g) for g in GROUPS[mode])
        assert rep["state"] and rep["ops"]["after"]["dsa_plan"] == 2 and rep["ops"]["after"]["dsa_serve"] == n_layers


def test_w2_layout_computes_the_single_process_model(world):
    """Each rank's unmodified W = 2 model gives its rows of the single-process (W = 1, batch 2) model."""
    torch.set_num_threads(1)
    b = models.build("tiny", enable_offload=True, decode_steps=STEPS)
    ref = b.driver.run(steps=STEPS)
    for r in world:
        mine = r["runs"]["eager"]["ref_logits"]
        d = max(float((m.float() - g[r["rank"]:r["rank"] + 1].float()).abs().max()) for m, g in zip(mine, ref.logits))
        assert d <= LOGITS_TOL, (r["rank"], d)  # measured 0 here (K = 2: the combine's fp32 sum commutes)


def test_mc2_references_match_the_traceable_dispatch_combine():
    res = spawn(mc2_rank, 2, (), timeout_s=180.0)
    for r in res:
        assert r["ok"], r.get("error")
        T, K, E, W = 3, 2, 4, 2
        A = T * W * min(E // W, K)
        assert r["ex_shape"] == (A, 16) and r["assist_shape"] == (A * 128,)
        n = int(r["recv_counts"][-1])
        assert int(r["tok"].sum()) == n == int(r["tp"][0]) and r["recv_counts"].shape == (W * (E // W),)
        assert bool((r["scales"][n:] == 0).all())
        assert float((r["a2a"].float() - r["dense"].float()).abs().max()) <= 2e-2
        assert float((r["mc2"].float() - r["a2a"].float()).abs().max()) <= 2e-2
        assert "quant_mode must be 0, got 2" in r["quant_error"]
    # every pair was received exactly once: the ranks' counts add up to all T*K pairs
    assert sum(int(r["recv_counts"][-1]) for r in res) == 2 * 3 * 2

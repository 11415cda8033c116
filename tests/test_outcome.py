"""``outcome.decide`` as a table: every combination of the facts the passes find, and what the graph becomes.

No graph is built: the decision is a pure function of the facts (``offload_passes/outcome.py``), so each row
states the facts and the whole outcome. The end-to-end tests of the same outcomes (warnings, ``strict``,
the report) are ``tests/passes/test_refusal_reasons.py``, ``tests/passes/test_rewrite_eager.py`` and
``tests/hf/test_hf_pipeline.py``.
"""
from __future__ import annotations

import dataclasses

import pytest

from offload_passes.outcome import DISABLED, Facts, Outcome, Verdict, decide, offload_groups
from offload_passes.passes.frontends.protocol import PartialRefusal, Screening
from offload_passes.passes.refusal import Refusal

NOTHING, SPARSE = PartialRefusal.NOTHING, PartialRefusal.SPARSE_WITHOUT_OFFLOAD
SITE = Refusal("site_not_verified", "gather: no attention reads it", 0)
QUIET = Refusal("dense_cheaper", "S*K >= T", 0)
QUIET2 = Refusal("dense_cheaper", "S*K >= T again", 1)
POOL = Refusal("pool_size", "pool_size=100 must be a multiple of 16", 0)
RAW = Refusal("raw_seq", "raw_seq S=9 must be in [1, 4]", 2)
NO_LAYER = Refusal("next_n", "graph has raw_seq S=1, config next_n=2", None)
PREFILL = "the graph allocates the KV caches it writes"
BY_DESIGN = "a prefill of S = 9 query tokens"


def facts(partial=NOTHING, blocking=(), quiet=(), dense_by_design=None, offload=True, groups=(0, 1),
          refusals=(), by_design=None, per=None) -> Facts:
    """Facts of a graph with two groups; ``refusals`` are the offload preconditions' (layers 0, 1 -> group 0,
    layer 2 -> group 1; ``per`` gives the groups' refusals where a refusal names no layer)."""
    if per is None:
        per = {g: tuple(r for r in refusals if (r.layer < 2) == (g == 0)) for g in groups}
    return Facts(partial, Screening(tuple(blocking), tuple(quiet), dense_by_design), offload, tuple(groups),
                 tuple(refusals), per, by_design)


TABLE = [
    # (id, facts, outcome)
    ("clean recipe: every group offloaded", facts(), Outcome(Verdict.REWRITTEN, (0, 1))),
    ("clean hf: every group offloaded", facts(SPARSE), Outcome(Verdict.REWRITTEN, (0, 1))),
    ("recipe, site refused", facts(blocking=[SITE]), Outcome(Verdict.REFUSED, refusals=(SITE,), warn=True)),
    ("hf, site refused", facts(SPARSE, blocking=[SITE]), Outcome(Verdict.REFUSED, refusals=(SITE,), warn=True)),
    ("recipe, site refused, offload off: disabled first",
     facts(blocking=[SITE], offload=False), Outcome(Verdict.REFUSED, refusals=(DISABLED, SITE), warn=True)),
    ("hf, blocking but a prefill on new caches",
     facts(SPARSE, blocking=[SITE], dense_by_design=PREFILL),
     Outcome(Verdict.DENSE, dense=("prefill", PREFILL), note=PREFILL)),
    ("hf, dense attention cheaper",
     facts(SPARSE, quiet=[QUIET, QUIET2]),
     Outcome(Verdict.DENSE, refusals=(QUIET, QUIET2), dense=("dense_cheaper", "S*K >= T"),
             note="S*K >= T; S*K >= T again")),
    ("recipe, offload off", facts(offload=False), Outcome(Verdict.REFUSED, refusals=(DISABLED,), warn=True)),
    ("hf, offload off: sparse attention, nothing to warn about", facts(SPARSE, offload=False),
     Outcome(Verdict.REWRITTEN)),
    ("recipe, a precondition fails in one group: the graph is refused",
     facts(refusals=[POOL]), Outcome(Verdict.REFUSED, refusals=(POOL,), warn=True)),
    ("hf, a precondition fails in group 0: group 1 offloaded, group 0 sparse without offload, warned",
     facts(SPARSE, refusals=[POOL]), Outcome(Verdict.PARTIAL, (1,), offload_refusals=(POOL,), warn=True)),
    ("hf, refusals in both groups: no group offloaded, warned",
     facts(SPARSE, refusals=[POOL, RAW]), Outcome(Verdict.PARTIAL, offload_refusals=(POOL, RAW), warn=True)),
    ("hf, a refusal naming no layer refuses every group",
     facts(SPARSE, refusals=[NO_LAYER], per={0: (NO_LAYER,), 1: (NO_LAYER,)}),
     Outcome(Verdict.PARTIAL, offload_refusals=(NO_LAYER,), warn=True)),
    ("hf, only raw_seq: a prefill by design, no warning; the group without it offloaded",
     facts(SPARSE, refusals=[RAW], by_design=BY_DESIGN),
     Outcome(Verdict.PARTIAL, (0,), offload_refusals=(RAW,), dense=("prefill", BY_DESIGN), note=BY_DESIGN)),
    ("recipe, refusals in both groups, in the preconditions' order",
     facts(refusals=[POOL, RAW]), Outcome(Verdict.REFUSED, refusals=(POOL, RAW), warn=True)),
]


@pytest.mark.parametrize("f, expected", [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_decide(f, expected):
    assert decide(f) == expected


def test_the_table_covers_every_verdict_and_both_partial_policies():
    assert {row[2].verdict for row in TABLE} == set(Verdict)
    assert {row[1].on_offload_refusal for row in TABLE} == set(PartialRefusal)


def test_blocking_refusals_win_over_preconditions_and_notes():
    """Screening decides first: with a blocking refusal neither quiet notes nor precondition facts count."""
    f = facts(blocking=[SITE], quiet=[QUIET], refusals=[POOL])
    assert decide(f) == Outcome(Verdict.REFUSED, refusals=(SITE,), warn=True)
    assert not f.rewritable and not facts(quiet=[QUIET]).rewritable and facts().rewritable


def test_unmodified_verdicts():
    assert {v for v in Verdict if v.unmodified} == {Verdict.DENSE, Verdict.REFUSED}


def test_offload_is_decided_per_group():
    """A group with no refusal of its own is offloaded in a partial graph; refusals not attributed to
    groups (no ``group_refusals``) prove no group passes."""
    f = facts(SPARSE, refusals=[RAW])
    assert f.group_refusals == {0: (), 1: (RAW,)}
    assert offload_groups(f) == (0,) and decide(f).offload_groups == (0,)
    unattributed = dataclasses.replace(f, group_refusals={})
    assert offload_groups(unattributed) == () and decide(unattributed).offload_groups == ()
    # the recipe form is refused as a whole: its rewrite is the offload
    assert decide(facts(refusals=[RAW])) == Outcome(Verdict.REFUSED, refusals=(RAW,), warn=True)


def test_decide_is_pure():
    f = facts(SPARSE, refusals=[POOL])
    before = dataclasses.replace(f)
    assert decide(f) == decide(f) and f == before

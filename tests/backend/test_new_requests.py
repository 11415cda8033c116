"""New requests are never served stale KV (docs/new-requests.md), CPU modes: every re-fill path of
tests/new_request_cases.py, each followed by compiled steps compared with the unmodified model.

CI runs the cells below (the eager cells of every front-end, bookkeeping on and off, next_n 0 and 3);
``OFFLOAD_PASSES_LONG=1`` runs the whole matrix with Inductor (each Inductor cell compiles two models,
minutes each on 2 cores). The NPU cells: tests/converters/test_new_requests_npu.py.
"""
from __future__ import annotations

import os

import pytest

import new_request_cases as N

CI_CELLS = [N.Cell("tiny", "eager", False, 0), N.Cell("tiny-w8a8", "eager", True, 3), N.Cell("hf-tiny", "eager", False, 0)]
CELLS = N.full_matrix(("eager", "inductor")) if os.environ.get("OFFLOAD_PASSES_LONG") == "1" else CI_CELLS


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_every_refill_path_matches_the_unmodified_model(cell):
    out = N.run_matrix_cell(cell)
    assert out["_rewritten"] == [1.0] and out["_resident"][0] > 0, out  # offloaded and warm between re-fills
    tol = N.tolerance(cell)
    bad = {k: v for k, v in out.items() if not k.startswith("_") and max(v) > tol}
    assert not bad, f"{cell.id}: steps off the unmodified model (tolerance {tol}): {bad}"


def test_with_the_detection_patched_out_a_refill_is_served_stale(monkeypatch):
    """The same cell with the new-request detection removed (no outside-write check, no in-graph
    invalidation): re-fills that keep the row's length in the continuation window are served the
    previous request's pool rows, off by far more than any tolerance. So the test above can fail."""
    import dataclasses

    from offload_passes import pipeline
    from offload_passes.passes import rewrite as rw
    from offload_passes.state import writes

    monkeypatch.setattr(writes, "check_outside_writes", lambda *a, **k: None)
    orig = rw.rewrite
    monkeypatch.setattr(pipeline, "rewrite", lambda gm, fe, grp, plans, st, settings:
                        orig(gm, fe, grp, plans, st, dataclasses.replace(settings, detect_new_requests=False)))
    s = N.recipe_session(N.Cell("tiny", "eager", False, 0))
    warm = [s.step() for _ in range(3)]
    s.refill("same_len")
    stale = [s.step() for _ in range(2)]
    assert max(warm) == 0.0
    assert max(stale) > 0.1, stale

"""Single-process checks of the multi-rank layout: argument limits, world size 1 unchanged, sharded
names and shapes (fake process group), per-rank dump folders, the demo's exit-code logic."""
from __future__ import annotations

import pytest
import torch

from offload_passes import models
from offload_passes.apps.demo import main as demo_main
from offload_passes.apps.world import summary
from offload_passes.dump import Dumper


def test_layout_limits_name_the_argument():
    with pytest.raises(ValueError, match=r"world_size must be an integer >= 1, got 0"):
        models.ParallelLayout(0, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        models.ParallelLayout(2, 2)
    with pytest.raises(ValueError, match=r"world size 3 must divide batch_size \(the global batch.*\)=2"):
        models.ParallelLayout(3, 0).check(2, 512, 6)
    with pytest.raises(ValueError, match=r"world size 2 must divide n_routed_experts \(expert parallel\)=5"):
        models.ParallelLayout(2, 1).check(2, 512, 5)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        models.ParallelLayout.current()


def test_world_size_one_builds_the_single_process_model():
    a = models.build("tiny", enable_offload=True, decode_steps=2)
    b = models.build("tiny", enable_offload=True, decode_steps=2, parallel=models.ParallelLayout(1, 0))
    assert b.model.parallel is None and b.runner.batch_size == a.runner.batch_size == 2
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(a.driver.prompt, b.driver.prompt) and torch.equal(a.driver.tokens, b.driver.tokens)


def test_rank_shards_names_and_rows(fake_world):
    fake_world(1)
    full = models.build("tiny", enable_offload=True, decode_steps=2)
    b = models.build("tiny", enable_offload=True, decode_steps=2, parallel=models.ParallelLayout.current())
    sd, fsd = b.model.state_dict(), full.model.state_dict()
    assert b.runner.batch_size == b.model.batch_size == 1
    assert sd["model.embed_tokens.weight"].shape == (256, 64) and sd["lm_head.weight"].shape == (256, 64)
    assert torch.equal(sd["model.embed_tokens.weight"], fsd["model.embed_tokens.weight"][256:])
    experts = sorted({k.split(".")[5] for k in sd if ".mlp.experts." in k and k.startswith("model.layers.1.")})
    assert experts == ["2", "3"]  # rank 1 of 2 holds experts 2 and 3 of 4, under their global names
    for k in sd:  # everything else is the single-process model's tensor (seeded init replayed)
        if k in fsd and sd[k].shape == fsd[k].shape:
            assert torch.equal(sd[k], fsd[k]), k
    assert torch.equal(b.driver.prompt, full.driver.prompt[1:]) and torch.equal(b.driver.tokens, full.driver.tokens[:, 1:])
    assert b.model.model.layers[0].self_attn.sel_status.shape[0] == 1  # this rank's rows only
    with pytest.raises(ValueError, match="weights=<dir> with a parallel layout is not supported"):
        models.build("tiny", weights="/nonexistent", parallel=models.ParallelLayout.current())


def test_dumps_go_to_a_folder_named_by_the_rank(fake_world, tmp_path):
    assert Dumper(tmp_path / "d").root == tmp_path / "d"
    fake_world(1)
    d = Dumper(tmp_path / "d")
    assert d.root == tmp_path / "d" / "rank1"
    d.report({"graph_id": "graph_000"})
    assert (tmp_path / "d" / "rank1" / "report.json").exists() and not (tmp_path / "d" / "report.json").exists()


def _rank(rank, logits, attn, ok=True):
    return {"rank": rank, "ok": ok, "error": None if ok else "timed out after 5 s (killed)", "mode": "eager",
            "max_abs_diff": {"logits": logits, "attn": attn}, "within_tolerance": logits <= 5e-2 and attn <= 2e-2,
            "totals": {"hits": 1, "misses": 2}, "graphs": [{"dynamo": [("x", [])], "rewrite": [("x", [])], "final": None}],
            "reports": [{"rewritten": True, "groups": [{"layers": [0, 1]}], "timings": {"total_s": rank}}]}


def test_world_summary_and_its_verdict():
    text, ok = summary([_rank(0, 0.0, 0.0), _rank(1, 0.0, 0.0)])
    assert ok and text.splitlines()[0].startswith("rank 0: rewritten True  groups [[0, 1]]  hits 1  misses 2")
    assert text.splitlines()[-1] == ("world 2 (eager): 2/2 ranks ran; 1 collectives per decode graph, same order "
                                     "on every rank and before/after the rewrite: True; reports equal across "
                                     "ranks: True; all within tolerance")
    assert not summary([_rank(0, 0.0, 0.0), _rank(1, 0.0, 0.5)])[1]
    text, ok = summary([_rank(0, 0.0, 0.0), _rank(1, 0.0, 0.0, ok=False)])
    assert not ok and "rank 1: FAILED: timed out after 5 s (killed)" in text


@pytest.mark.parametrize("argv, msg", [
    (["--world", "3"], "world size 3 must divide batch_size"),
    (["--world", "9"], "--world must be in [1, 8], got 9"),
    (["--world", "2", "--model", "hf"], "--world applies to --model glm"),
])
def test_demo_world_bad_input_is_one_line_and_exit_2(argv, msg, capsys):
    assert demo_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("offload-demo: error: ") and msg in err[0]

"""Public surface: options / yaml, named backend, decorator, dumps, demo JSON on the real tiny model."""
from __future__ import annotations

import json

import pytest
import torch

import dsa_synth as synth
from backend_helpers import check_pool_invariants, run_pair
from offload_passes import OffloadOptions, make_offload_backend, offload
from offload_passes.backend import backend_for_options, dsa_offload_backend

PS = 64


def test_options_defaults_and_limits(tmp_path):
    assert OffloadOptions().resolved_pool_size == 8192
    assert OffloadOptions(enlarge_pool_size=True).resolved_pool_size == 16384
    assert OffloadOptions().exe_mode == "eager" and OffloadOptions().strict is False
    for bad, msg in ((100, "multiple of 16"), (48, "power of two"), (32768, "16384")):
        with pytest.raises(ValueError, match=msg) as ei:
            OffloadOptions(pool_size=bad)
        assert "pool_size" in str(ei.value)
    with pytest.raises(ValueError, match="exe_mode"):
        OffloadOptions(exe_mode="fast")
    with pytest.raises(ValueError, match="unknown offload option"):
        make_offload_backend(poolsize=64)
    y = tmp_path / "recipe.yaml"
    y.write_text("model_config:\n  hidden: 1\nrunner_config:\n  enable_offload: true\n  enlarge_pool_size: true\n"
                 "  pa_block_size: 16\n  next_n: 3\n  exe_mode: eager\n  batch_size: 4\n")
    be = make_offload_backend(str(y))
    o = be.options
    assert (o.resolved_pool_size, o.pa_block_size, o.next_n, o.enable_offload) == (16384, 16, 3, True)
    assert make_offload_backend(str(y), pool_size=64).options.resolved_pool_size == 64


def test_named_backend_entry_point():
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("dsa_offload") is dsa_offload_backend
    cfg = synth.SynthConfig(pattern="FS", S=1, router=False)
    base, m = synth.make_pair(cfg, [300, 280])
    c = torch.compile(m, backend="dsa_offload", options={"pool_size": PS})
    res = run_pair(cfg, 4, backend_for_options({"pool_size": PS}), pair=(base, m), compiled=c)
    assert res["max_a"] == 0 and res["max_h"] == 0  # the rewrite is exact in eager mode
    be = backend_for_options({"pool_size": PS})
    assert be.reports[-1]["rewritten"] and be.options.resolved_pool_size == PS
    check_pool_invariants(be.state, m)


def test_decorator_instance_and_class():
    cfg = synth.SynthConfig(pattern="FSF", S=1, router=False)
    base, m = synth.make_pair(cfg, [300, 280])
    wrapped = offload(m, pool_size=PS)
    assert wrapped.offload_state.groups == []  # nothing compiled yet: an empty state
    res = run_pair(cfg, 4, wrapped.offload_backend, pair=(base, m), compiled=wrapped)
    assert res["max_a"] == 0 and res["max_h"] == 0
    st = wrapped.offload_state
    assert st is not None and [g.layers for g in st.groups] == [[0, 1], [2]]
    assert st.counters()[0]["total"]["steps"] == 4

    @offload(pool_size=PS)
    class Decorated(synth.SynthDSA):
        pass

    torch._dynamo.reset()
    d = Decorated(cfg).eval()
    d.prefill([300, 280])
    assert isinstance(d, synth.SynthDSA) and d.offload_state.groups == []
    base2 = synth.SynthDSA(cfg).eval()
    base2.prefill([300, 280])
    res = run_pair(cfg, 3, d.offload_backend, pair=(base2, d), compiled=d)
    assert res["max_a"] == 0 and res["max_h"] == 0 and d.offload_state.groups != []
    assert d.offload_reports[-1]["rewritten"] is True
    with pytest.raises(TypeError, match="nn.Module"):
        offload(42)


def test_dump_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_PASSES_DUMP", str(tmp_path))
    cfg = synth.SynthConfig(pattern="FSF", S=2, router=False)
    res = run_pair(cfg, 2, make_offload_backend(pool_size=PS))
    gid = res["backend"].reports[-1]["graph_id"]
    files = sorted(p.name for p in (tmp_path / gid).iterdir())
    assert files == ["00_dynamo.py", "01_rewrite.py", "02_functional.py", "03_reinplace.py"]
    assert "dsa_serve_functional" in (tmp_path / gid / "02_functional.py").read_text()
    final = (tmp_path / gid / "03_reinplace.py").read_text()
    assert "_functional" not in final and final.count("custom.dsa_serve.default(") == 3
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["format"] == "offload_passes.report" and data["version"] == 1
    g = next(x for x in data["graphs"] if x["graph_id"] == gid)
    for key in ("rewritten", "mode", "options", "groups", "sites", "layer_nodes", "ops", "state", "refusals",
                "timings", "passes"):
        assert key in g
    assert [x["layers"] for x in g["groups"]] == [[0, 1], [2]]
    grp = g["groups"][0]
    assert (grp["K"], grp["S"], grp["B"], grp["pool_size"], grp["num_sets"], grp["id_range"]) == (64, 2, 2, PS, 4, 131072)
    assert [s["layer"] for s in g["sites"]] == [0, 1, 2]
    assert len(g["sites"][0]["install_nodes"]) == 1 and g["sites"][0]["serve_node"]
    assert set(g["layer_nodes"]["before"]) == {"0", "1", "2"}
    assert g["ops"]["after"]["dsa_plan"] == 2
    assert {r["kind"] for r in g["state"]} == {"pool", "group", "stats"}
    assert sum(r["bytes"] for r in g["state"]) == res["state"].total_bytes
    for k in ("detect_s", "group_s", "plan_s", "rewrite_s", "aot_s", "reinplace_s", "lower_s", "total_s"):
        assert g["timings"][k] >= 0


def test_demo_json_on_tiny_model(capsys):
    """The real GLM-5.2 tiny preset (FSSS FSSS), small pool so that evictions happen."""
    from offload_passes.apps import demo

    rc = demo.main(["--config", "tiny", "--steps", "16", "--pool-size", "64", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["within_tolerance"] and out["rewritten"]
    assert out["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert out["ops"] == {"dsa_plan": 2, "dsa_serve": 8, "dsa_install": 8}
    assert out["refusals"] == []
    B, S, K = out["B"], out["S"], out["K"]
    assert out["hits"] + out["misses"] + out["window"] == 16 * 2 * B * S * K  # two groups, all rows valid
    assert out["host_rows_read"] == 4 * (out["misses"] + out["window"])
    assert out["unmodified_host_rows_read"] > 0 and out["pass_s"] < out["compile_s"]
    assert out["baseline_host_rows_read"] == out["unmodified_host_rows_read"]  # the alias (apps.common.KEY_ALIASES)


def test_demo_json_has_one_schema_for_the_recipe_and_the_hf_model(capsys):
    """``offload-demo --json`` of the recipe model and of ``--model hf``: the same keys, nested ones
    included, both difference measures named the same way (HF printed ``max_rel_diff_logits`` alone)."""
    from offload_passes.apps import demo

    outs = {}
    for model, argv in (("glm", ["--config", "tiny"]), ("hf", ["--model", "hf", "--config", "hf-tiny"])):
        rc = demo.main(argv + ["--steps", "2", "--json"])
        outs[model] = json.loads(capsys.readouterr().out)
        assert rc == 0 and outs[model]["within_tolerance"], (model, outs[model])
    glm, hf = outs["glm"], outs["hf"]
    assert list(glm) == list(hf) == list(demo.RESULT_KEYS)
    for k in ("max_abs_diff", "max_rel_diff"):
        assert set(glm[k]) == set(hf[k]) == {"logits", "attn"}
        assert set(glm["tolerance"]) == set(hf["tolerance"]) == {"max_abs_diff", "max_rel_diff"}
    assert glm["max_abs_diff"] == {"logits": 0.0, "attn": 0.0} == glm["max_rel_diff"]  # exact in eager
    assert hf["max_abs_diff"]["attn"] is None and hf["max_rel_diff"]["attn"] is None  # not exposed by HF
    assert 0 <= hf["max_rel_diff"]["logits"] <= hf["tolerance"]["max_rel_diff"]["logits"]
    assert isinstance(hf["max_abs_diff"]["logits"], float)  # reported beside the relative one
    assert (glm["model"], hf["model"]) == ("glm", "hf")
    assert glm["tolerance"]["max_rel_diff"] is None and hf["tolerance"]["max_abs_diff"] is None
    assert hf["unmodified_host_rows_read"] is None and glm["unmodified_host_rows_read"] > 0
    assert hf["ops"].keys() == glm["ops"].keys() == {"dsa_plan", "dsa_serve", "dsa_install"}
    assert hf["offload"] is True and hf["ops"]["dsa_plan"] == 2 and glm["ops"]["dsa_plan"] == 2
    assert hf["hits"] + hf["misses"] + hf["window"] > 0 and hf["host_rows_read"] > 0
    from offload_passes.apps.hf import summary_hf  # the summaries read the new keys

    assert "max |diff| vs unmodified model, eager: logits 0, attention 0  (within tolerance)" in demo._summary(glm)
    assert f"logits vs unmodified model, eager: {hf['max_rel_diff']['logits']:.3g}  (within tolerance 0.02)" \
        in summary_hf(hf)


def test_demo_hf_passes_the_replacement_policy_to_the_backend(monkeypatch):
    """``--model hf --replacement-policy second_chance`` reached no backend (the demo dropped it)."""
    from offload_passes import backend as backend_mod
    from offload_passes.apps import demo, hf as demo_hf

    seen = {}

    def spy(**kw):
        seen.update(kw)
        raise RuntimeError("stop after the backend is made")

    monkeypatch.setattr(backend_mod, "make_offload_backend", spy)
    with pytest.raises(RuntimeError, match="stop after"):
        demo.main(["--model", "hf", "--config", "hf-tiny", "--steps", "1", "--replacement-policy", "second_chance"])
    assert seen["replacement_policy"] == "second_chance"
    seen.clear()
    with pytest.raises(RuntimeError, match="stop after"):
        demo_hf.run_hf("hf-tiny", steps=1)
    assert seen["replacement_policy"] == "fifo"


def test_torch_logs_switch_controls_offload_passes_loggers():
    import os
    import subprocess
    import sys

    code = ("import logging, offload_passes\n"
            "log = logging.getLogger('offload_passes.backend')\n"
            "log.debug('dbg-line'); log.info('info-line')\n")
    runs = {}
    for setting in ("+offload_passes", "offload_passes", ""):
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
        env.pop("TORCH_LOGS", None)
        if setting:  # torch 2.13 itself fails at import on TORCH_LOGS=""
            env["TORCH_LOGS"] = setting
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        runs[setting] = out.stderr
    assert "dbg-line" in runs["+offload_passes"] and "info-line" in runs["+offload_passes"]
    assert "dbg-line" not in runs["offload_passes"] and "info-line" in runs["offload_passes"]
    assert "info-line" not in runs[""]

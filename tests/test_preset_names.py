"""Every preset ``models.list_presets()`` lists is taken by name by every console script with ``--config``
(``offload-demo`` in each of its forms, ``offload-capacity``, ``python -m offload_passes.trace.record``):
never as a path, even a name with a dot (``glm-5.2-78l``) or one that a folder in the working directory
also has (``--dump-dir tiny`` leaves one). The model a name builds is the model its yaml's path builds;
the recipe presets are built on the meta device (the 78-layer ones would take minutes to run).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from offload_passes import models
from offload_passes.apps import demo, hf as demo_hf, world as demo_world
from offload_passes.models import hf
from offload_passes.models.glm.config import CONFIG_DIR
from offload_passes.tools import capacity_plan, capacity_plan_model
from offload_passes.trace import format as trace_format, record

PRESETS = models.list_presets()
HF_PRESETS = hf.list_presets()
RECIPE_PRESETS = [p for p in PRESETS if p not in HF_PRESETS]


def _yaml(preset: str) -> Path:
    return CONFIG_DIR / f"{preset}.yaml"


@pytest.fixture
def same_named_folder(tmp_path, monkeypatch, request):
    """Run in a folder that holds a directory named like the preset (a path would be that directory)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / request.node.callspec.params["preset"]).mkdir()


def test_the_presets_include_the_dotted_flagship():
    assert {"glm-5.2-78l", "glm-5.2-78l-w8a8", "tiny", "small", "tiny-w8a8", "hf-tiny"} <= set(PRESETS)
    assert RECIPE_PRESETS and HF_PRESETS and all(_yaml(p).is_file() for p in PRESETS)


def _recipe_on_meta(config: str, built: list) -> None:
    b = models.build(config, device="meta")
    assert b.config == models.load_config(str(_yaml(config))).model  # the name's model is the yaml's
    built.append((config, b.config.num_hidden_layers))


@pytest.mark.parametrize("form", ["decode", "serve", "world"])
@pytest.mark.parametrize("preset", RECIPE_PRESETS)
def test_demo_takes_every_recipe_preset_by_name(preset, form, same_named_folder, monkeypatch, capsys):
    built: list = []

    def fake(config, *a, **k):
        _recipe_on_meta(config, built)
        return {"within_tolerance": True}

    def fake_world(world, mode, steps, config, *a):
        _recipe_on_meta(config, built)
        return 0

    monkeypatch.setattr(demo, "run", fake)
    monkeypatch.setattr(demo, "run_serve", fake)
    monkeypatch.setattr(demo_world, "main_world", fake_world)
    monkeypatch.setattr(demo, "_summary", lambda o: "summary")
    monkeypatch.setattr(demo, "summary_serve", lambda o: "summary")
    extra = {"decode": [], "serve": ["--serve"], "world": ["--world", "2"]}[form]
    assert demo.main(["--config", preset, "--steps", "1"] + extra) == 0, capsys.readouterr().err
    layers = models.load_config(str(_yaml(preset))).model.num_hidden_layers
    assert built == [(preset, layers)]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("preset", HF_PRESETS)
def test_demo_takes_every_hf_preset_by_name(preset, same_named_folder, monkeypatch, capsys):
    seen: list = []

    def fake_run_hf(config, *a, **k):
        cfg, runner = hf.load_config(config)
        by_path = hf.load_config(str(_yaml(preset)))
        assert (cfg.to_dict(), runner) == (by_path[0].to_dict(), by_path[1])
        seen.append((config, type(cfg).__name__))
        return {"within_tolerance": True}

    monkeypatch.setattr(demo_hf, "run_hf", fake_run_hf)
    monkeypatch.setattr(demo_hf, "summary_hf", lambda o: "summary")
    assert demo.main(["--model", "hf", "--config", preset, "--steps", "1"]) == 0, capsys.readouterr().err
    assert seen == [(preset, type(hf.load_config(str(_yaml(preset)))[0]).__name__)]


@pytest.mark.parametrize("preset", PRESETS)
def test_capacity_reads_every_preset_by_name(preset, same_named_folder):
    """The preset's own file is read: its shape, or (an HF family without the MLA keys the planner needs)
    an error that names that file's content, never 'not a preset'."""
    try:
        shape = capacity_plan_model.load_model_shape(preset)
    except ValueError as e:
        assert preset in HF_PRESETS and str(e).startswith(f"config {_yaml(preset)}: "), e
    else:
        assert (shape.name, shape.source) == (preset, str(_yaml(preset)))


@pytest.mark.parametrize("preset", RECIPE_PRESETS)
def test_capacity_plans_every_recipe_preset_by_name(preset, same_named_folder, capsys):
    assert capacity_plan.main(["--config", preset]) == 0
    layers = models.load_config(str(_yaml(preset))).model.num_hidden_layers
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"offload-capacity: {preset} ({_yaml(preset)})"
    assert out[1].startswith(f"  {layers} layers: ")


@pytest.mark.parametrize("preset", RECIPE_PRESETS)
def test_trace_record_takes_every_recipe_preset_by_name(preset, same_named_folder, monkeypatch, tmp_path):
    built: list = []

    def fake_record(config, steps, top_p, **over):
        _recipe_on_meta(config, built)
        return "trace"

    monkeypatch.setattr(record, "record_model", fake_record)
    monkeypatch.setattr(trace_format, "save_trace", lambda tr, path: path)
    assert record.main(["--config", preset, "--steps", "1", "-o", str(tmp_path / "t.npz")]) == 0
    assert built == [(preset, models.load_config(str(_yaml(preset))).model.num_hidden_layers)]


def test_a_yaml_path_is_still_a_path(tmp_path, monkeypatch):
    """A file named like a preset but given as a path with its suffix is that file, not the preset."""
    monkeypatch.chdir(tmp_path)
    four = models.load_config("tiny", num_hidden_layers=4, index_topk_pattern="FSSS").to_dict()
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(four))
    assert models.load_config("tiny.yaml").model.num_hidden_layers == 4
    assert models.load_config("tiny").model.num_hidden_layers == 8
    assert demo.config_is_path("tiny.yaml") and not demo.config_is_path("tiny")

"""Options are validated when they are built (keyword, dict, yaml, ``options=``): types, ranges and
unknown names, each error naming the option."""
from __future__ import annotations

import pytest
import torch

from offload_passes.options import OffloadOptions

# (keyword, value, the message the error must contain): each of these was silently accepted or failed late
BAD_OPTIONS = [
    ("pool_sise", 1024, "unknown offload option(s): 'pool_sise' (did you mean 'pool_size'?)"),
    ("enable_offload", "false", "option enable_offload must be bool, got str 'false'"),
    ("strict", "no", "option strict must be bool, got str 'no'"),
    ("id_range", 1.5, "option id_range must be int or None, got float 1.5"),
    ("next_n", "1", "option next_n must be int or None, got str '1'"),
    ("dump_dir", 123, "option dump_dir must be str or None, got int 123"),
    ("pool_size", True, "option pool_size must be int or None, got bool True"),
    ("pool_size", 1000, "option pool_size must be a multiple of 16"),
    ("pool_size", 16 * 3, "option pool_size / 16 (sets) must be a power of two, got 3"),
    ("pool_size", 32768, "option pool_size must be in (0, 16384]"),
    ("next_n", 4, "option next_n must be in [0, 3]"),
    ("pa_block_size", 48, "option pa_block_size must be a power of two in [16, 128]"),
    ("exe_mode", "graph", "option exe_mode must be one of"),
    ("id_range", 0, "option id_range must be > 0"),
    # 2**40 was accepted and failed at the first call, allocating id_to_slot [B, 2**40] int32 (8 TB a row)
    ("id_range", 2**40, "option id_range must be <= 1409024 (custom::dsa_install's MAX_ID_RANGE: id_to_slot is "
                        "[B, id_range] int32 per group), got 1099511627776"),
    ("id_range", 1409024 + 1, "option id_range must be <= 1409024"),
]


@pytest.mark.parametrize("key,value,msg", BAD_OPTIONS, ids=[f"{k}={v!r}" for k, v, _ in BAD_OPTIONS])
@pytest.mark.parametrize("how", ["keyword", "dict", "yaml"])
def test_bad_option_is_rejected_when_built(key, value, msg, how, tmp_path):
    with pytest.raises(ValueError) as ei:
        if how == "keyword":
            OffloadOptions.from_any(**{key: value})
        elif how == "dict":
            OffloadOptions.from_any({key: value})
        else:
            import yaml

            p = tmp_path / "o.yaml"
            p.write_text(yaml.safe_dump({key: value}))
            OffloadOptions.from_any(p)
    assert msg in str(ei.value)


def test_recipe_yaml_reads_recipe_keys_and_rejects_typos_of_ours(tmp_path):
    recipe = {"model_name": "GLM-5.2", "model_path": "/data/x", "exe_mode": "eager", "world_size": 32,
              "model_config": {"enable_offload": True, "shared_indexer_offload": True, "enlarge_pool_size": True,
                               "next_n": 3, "pa_block_size": 128, "enable_weight_nz": True},
              "data_config": {"batch_size": 32}}
    o = OffloadOptions.from_any(recipe)
    assert (o.resolved_pool_size, o.next_n, o.pa_block_size, o.exe_mode) == (16384, 3, 128, "eager")
    # our own options in their section: strict there
    o = OffloadOptions.from_any({**recipe, "offload_passes": {"pool_size": 1024, "strict": True}})
    assert (o.resolved_pool_size, o.strict) == (1024, True)
    with pytest.raises(ValueError, match=r"in section 'offload_passes': 'pool_sise' \(did you mean 'pool_size'\?\)"):
        OffloadOptions.from_any({**recipe, "offload_passes": {"pool_sise": 1024}})
    # a near-miss of one of our names beside the recipe's own settings is a typo, not a recipe key
    with pytest.raises(ValueError, match=r"unknown offload option 'pool_sise' \(did you mean 'pool_size'\?\)"):
        OffloadOptions.from_any({**recipe, "pool_sise": 1024})
    with pytest.raises(ValueError, match="option enable_offload must be bool, got str 'False'"):
        OffloadOptions.from_any({**recipe, "model_config": {"enable_offload": "False"}})


def test_named_backend_options_are_validated():
    m = torch.nn.Linear(4, 4)
    c = torch.compile(m, backend="dsa_offload", options={"pool_sise": 1024})
    with pytest.raises(Exception, match=r"'pool_sise' \(did you mean 'pool_size'\?\)"):
        c(torch.randn(2, 4))


def test_path_dump_dir_is_kept_as_text(tmp_path):
    assert OffloadOptions(dump_dir=tmp_path).dump_dir == str(tmp_path)


def test_id_range_limit_is_the_install_ops_and_is_accepted():
    from offload_passes.custom_ops import spec_for
    from offload_passes.options import MAX_ID_RANGE

    assert MAX_ID_RANGE == spec_for("dsa_install").limit("MAX_ID_RANGE") == spec_for("dsa_install_sc").limit(
        "MAX_ID_RANGE") == 1409024
    assert OffloadOptions(id_range=MAX_ID_RANGE).id_range == MAX_ID_RANGE


RECIPE = {"model_name": "GLM-5.2", "exe_mode": "eager",
          "model_config": {"enable_offload": True, "shared_indexer_offload": True, "next_n": 1,
                           "enable_weight_nz": True, "enable_mla_prolog": True, "enable_multi_streams": False,
                           "mm_quant_mode": "w8a8", "pa_max_length": 8192, "block_size": 128, "batch_size": 4},
          "runner_config": {"pa_block_size": 128, "enable_kv_offload": False}}

MODEL_CONFIG_TYPOS = [  # (section, typo, the key it was meant to be)
    ("model_config", "enable_ofload", "enable_offload"),
    ("model_config", "enable_offlaod", "enable_offload"),
    ("model_config", "shared_indexer_ofload", "shared_indexer_offload"),
    ("model_config", "enlarge_poolsize", "enlarge_pool_size"),
    ("model_config", "nextn", "next_n"),
    ("runner_config", "pa_blocksize", "pa_block_size"),
    ("runner_config", "exec_mode", "exe_mode"),
]


@pytest.mark.parametrize("section,typo,meant", MODEL_CONFIG_TYPOS, ids=[t for _, t, _ in MODEL_CONFIG_TYPOS])
def test_recipe_key_typo_inside_a_section_names_the_key(section, typo, meant, tmp_path):
    """A typo inside model_config was silently ignored (the backend then ran with the default)."""
    import yaml

    data = {**RECIPE, section: {**RECIPE[section], typo: True}}
    p = tmp_path / "recipe.yaml"
    p.write_text(yaml.safe_dump(data))
    for src in (data, p):
        with pytest.raises(ValueError) as ei:
            OffloadOptions.from_any(src)
        assert str(ei.value) == f"unknown recipe key '{section}.{typo}' (did you mean '{meant}'?)"


def test_recipe_sections_own_settings_are_not_typos():
    """The recipe's many other settings, some close to ours (block_size, enable_kv_offload, pa_max_length),
    pass; and so does every shipped model config."""
    from pathlib import Path

    o = OffloadOptions.from_any(RECIPE)
    assert (o.enable_offload, o.shared_indexer_offload, o.next_n, o.pa_block_size) == (True, True, 1, 128)
    configs = sorted((Path(__file__).resolve().parents[2] / "models" / "configs").glob("*.yaml"))
    assert len(configs) >= 5
    for c in configs:
        OffloadOptions.from_any(c)

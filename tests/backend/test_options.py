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
    ("pool_size", 16 * 3, "the number of sets) must be a power of two"),
    ("pool_size", 32768, "option pool_size must be in (0, 16384]"),
    ("next_n", 4, "option next_n must be in [0, 3]"),
    ("pa_block_size", 48, "option pa_block_size must be a power of two in [16, 128]"),
    ("exe_mode", "graph", "option exe_mode must be one of"),
    ("id_range", 0, "option id_range must be > 0"),
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

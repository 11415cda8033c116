"""Config loading: HF glm_moe_dsa keys, recipe runner keys, IndexShare schedules, errors naming the key."""
from __future__ import annotations

import pytest
import torch
import yaml

from offload_passes import models
from offload_passes.models.glm.config import indexer_types_from_freq


def test_presets_and_their_schedules():
    presets = models.list_presets()
    assert presets == sorted(presets)
    assert {"glm-5.2-78l", "glm-5.2-78l-w8a8", "small", "tiny", "tiny-w8a8"} <= set(presets)
    tiny = models.load_config("tiny")
    assert tiny.model.num_hidden_layers >= 8 and tiny.model.index_topk == 64
    assert tiny.model.indexer_types == ["full", "shared", "shared", "shared"] * 2
    assert tiny.runner.prefill_len >= 256 and tiny.runner.seq_per_step == 1
    small = models.load_config("small")
    assert small.model.index_groups() == [[0], [1], [2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13], [14, 15]]
    big = models.load_config("glm-5.2-78l")
    m = big.model
    assert (m.num_hidden_layers, m.index_topk, m.kv_lora_rank, m.qk_rope_head_dim) == (78, 2048, 512, 64)
    expected = [[0], [1]] + [list(range(i, i + 4)) for i in range(2, 78, 4)]
    assert m.index_groups() == expected and len(expected) == 21 and expected[-1] == [74, 75, 76, 77]


def test_hf_schedule_formula():
    # HF: full iff max(i - offset + 1, 0) % freq == 0; defaults freq 1 / offset 2 -> every layer full.
    assert indexer_types_from_freq(10, 4, 3) == ["full"] * 3 + ["shared"] * 3 + ["full"] + ["shared"] * 3
    assert indexer_types_from_freq(5, 2, 1) == ["full", "shared", "full", "shared", "full"]
    cfg = models.load_config("tiny", index_topk_pattern=None)
    assert cfg.model.indexer_types == ["full"] * 8  # no schedule key at all: HF defaults
    cfg = models.load_config("tiny", index_topk_pattern=None, index_topk_freq=3, index_skip_topk_offset=1)
    assert cfg.model.index_groups() == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_explicit_indexer_types_and_agreement():
    types = ["full", "shared", "full", "full", "shared", "shared", "shared", "full"]
    cfg = models.load_config("tiny", index_topk_pattern=None, indexer_types=types)
    assert cfg.model.index_groups() == [[0, 1], [2], [3, 4, 5, 6], [7]]
    # The same schedule twice is fine; a disagreeing pattern is an error naming the key and the layer.
    models.load_config("tiny", index_topk_pattern="FSFFSSSF", indexer_types=types)
    with pytest.raises(ValueError, match=r"'index_topk_pattern': disagrees with indexer_types at layer 1"):
        models.load_config("tiny", index_topk_pattern="FFFFSSSF", indexer_types=types)


@pytest.mark.parametrize("overrides, key", [
    (dict(index_topk_pattern="FSS"), "index_topk_pattern"),
    (dict(index_topk_pattern="SSSSFSSS"), "index_topk_pattern"),        # layer 0 must be full
    (dict(index_topk_pattern=None, indexer_types=["full", "bogus"] + ["full"] * 6), "indexer_types"),
    (dict(index_topk_pattern=None, index_topk_freq=0), "index_topk_freq"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(index_topk=4096), "index_topk"),
    (dict(torch_dtype="float16"), "torch_dtype"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(next_n=4), "next_n"),
    (dict(pa_block_size=128), "pa_block_size"),  # must divide index_topk = 64
    (dict(pa_max_length=300), "pa_max_length"),
    (dict(exe_mode="graph"), "exe_mode"),
    (dict(cache_write="scatter"), "cache_write"),
    (dict(enable_offload="yes"), "enable_offload"),
    (dict(batch_size=0), "batch_size"),
    (dict(rope_scaling={"type": "yarn"}), "rope_scaling"),
    (dict(enable_offload=True, torch_dtype="float32"), "torch_dtype"),  # the gather copies bf16/f16 only
])
def test_inconsistent_values_name_the_key(overrides, key):
    with pytest.raises(ValueError, match=f"config key '{key}'"):
        models.load_config("tiny", **overrides)


def test_unknown_keys_name_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"config key 'num_layers': unknown key"):
        models.load_config("tiny", num_layers=3)
    data = yaml.safe_load(open(models.glm.config.preset_path("tiny")))
    bad = dict(data, model_config=dict(data["model_config"], n_experts=4))
    with pytest.raises(ValueError, match=r"config key 'model_config.n_experts': unknown model key"):
        models.load_config(bad)
    bad = dict(data, runner_config=dict(data["runner_config"], pool_size=8192))
    p = tmp_path / "x.yaml"
    p.write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match=r"config key 'runner_config.pool_size': unknown runner key"):
        models.load_config(str(p))
    with pytest.raises(ValueError, match=r"config key 'extra': unknown section"):
        models.load_config(dict(data, extra={}))
    with pytest.raises(ValueError, match=r"config preset 'huge': unknown"):
        models.load_config("huge")


def test_yaml_file_and_overrides_roundtrip(tmp_path):
    cfg = models.load_config("tiny", next_n=3, dtype="float32")  # "dtype": HF's newer spelling
    assert cfg.runner.seq_per_step == 4 and not cfg.runner.enable_offload and cfg.model.dtype == torch.float32
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg.to_dict()))
    again = models.load_config(str(p))
    assert again.to_dict() == cfg.to_dict()


def test_hf_config_json_reader():
    hf = {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "transformers_version": "5.0",
        "dtype": "bfloat16", "num_hidden_layers": 6, "index_topk_freq": 4, "index_skip_topk_offset": 3,
        "hidden_size": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "head_dim": 64,
    }
    m = models.model_config_from_hf(hf)
    assert m.torch_dtype == "bfloat16" and m.rope_theta == 1e6
    assert m.indexer_types == ["full", "full", "full", "shared", "shared", "shared"]
    with pytest.raises(ValueError, match=r"config key 'config.json.foo': unknown model key"):
        models.model_config_from_hf(dict(hf, foo=1))
    with pytest.raises(ValueError, match=r"config key 'rope_parameters'"):
        models.model_config_from_hf(dict(hf, rope_parameters={"rope_type": "yarn", "factor": 4}))


def test_78l_preset_buffers_on_meta():
    """The real layout without allocating: buffer shapes of docs/ops.md §7 and the memory footprint."""
    b = models.build("glm-5.2-78l", device="meta", batch_size=2, next_n=1)
    m, r = b.model, b.runner
    B, S, K, BS, cache_len = 2, 2, 2048, 128, r.pa_max_length // 128
    assert len(m.model.layers) == 78
    full = [i for i, layer in enumerate(m.model.layers) if layer.self_attn.indexer is not None]
    assert full == [0, 1] + list(range(2, 78, 4))
    a = m.model.layers[5].self_attn
    assert a.kv_cache.shape == (cache_len * B, BS, 1, 512) and a.k_rope_cache.shape == (cache_len * B, BS, 1, 64)
    assert a.sel_kv.shape == (B * S * K // BS, BS, 512) and a.sel_rope.shape == (B * S * K // BS, BS, 64)
    assert a.sel_block_table.shape == (B * S, K // BS) and a.sel_status.shape == (B, S, 1, K + 1)
    assert m.block_table.shape == (B, cache_len)
    assert m.model.layers[2].self_attn.indexer.key_cache.shape == (cache_len * B, BS, 1, 128)
    fp = m.memory_footprint()
    assert fp["full_kv_cache"] == 78 * cache_len * B * BS * (512 + 64) * 2
    assert fp["selection"] == 78 * (B * S * K * (512 + 64) * 2 + B * S * (K + 1) * 4)
    assert fp["indexer_key_cache"] == 21 * cache_len * B * BS * 128 * 2

"""Weights: seeded init and loading a safetensors checkpoint with HF glm_moe_dsa names.

The checkpoint is written by the test from names and shapes spelled out here (HF's layout for
GlmMoeDsaForCausalLM), not from the model's own state_dict, so a naming drift in the model fails.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from offload_passes import models


def hf_tensors(cfg, seed=7, extra_layers=1):
    """HF checkpoint tensors for ``cfg`` (plus ``extra_layers`` MTP layers HF also ignores)."""
    g = torch.Generator().manual_seed(seed)
    H, D = cfg.num_attention_heads, cfg.hidden_size
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    t = {}

    def r(name, *shape):
        t[name] = torch.randn(*shape, generator=g)

    r("model.embed_tokens.weight", cfg.vocab_size, D)
    r("model.norm.weight", D)
    r("lm_head.weight", cfg.vocab_size, D)
    for i in range(cfg.num_hidden_layers + extra_layers):
        p = f"model.layers.{i}."
        r(p + "input_layernorm.weight", D)
        r(p + "post_attention_layernorm.weight", D)
        a = p + "self_attn."
        r(a + "q_a_proj.weight", cfg.q_lora_rank, D)
        r(a + "q_a_layernorm.weight", cfg.q_lora_rank)
        r(a + "q_b_proj.weight", H * qk, cfg.q_lora_rank)
        r(a + "kv_a_proj_with_mqa.weight", cfg.kv_lora_rank + cfg.qk_rope_head_dim, D)
        r(a + "kv_a_layernorm.weight", cfg.kv_lora_rank)
        r(a + "kv_b_proj.weight", H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        r(a + "o_proj.weight", D, H * cfg.v_head_dim)
        if i >= cfg.num_hidden_layers or cfg.indexer_types[i] == "full":
            r(a + "indexer.wq_b.weight", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
            r(a + "indexer.wk.weight", cfg.index_head_dim, D)
            r(a + "indexer.k_norm.weight", cfg.index_head_dim)
            r(a + "indexer.k_norm.bias", cfg.index_head_dim)
            r(a + "indexer.weights_proj.weight", cfg.index_n_heads, D)
        m = p + "mlp."
        if i < cfg.first_k_dense_replace:
            r(m + "gate_proj.weight", cfg.intermediate_size, D)
            r(m + "up_proj.weight", cfg.intermediate_size, D)
            r(m + "down_proj.weight", D, cfg.intermediate_size)
        else:
            r(m + "gate.weight", cfg.n_routed_experts, D)
            r(m + "gate.e_score_correction_bias", cfg.n_routed_experts)
            I = cfg.moe_intermediate_size
            for e in range(cfg.n_routed_experts):
                r(m + f"experts.{e}.gate_proj.weight", I, D)
                r(m + f"experts.{e}.up_proj.weight", I, D)
                r(m + f"experts.{e}.down_proj.weight", D, I)
            Is = I * cfg.n_shared_experts
            r(m + "shared_experts.gate_proj.weight", Is, D)
            r(m + "shared_experts.up_proj.weight", Is, D)
            r(m + "shared_experts.down_proj.weight", D, Is)
    return t


def _write_sharded(tensors, directory):
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for f, ns in shards.items():
        save_file({n: tensors[n].to(torch.bfloat16) for n in ns}, str(directory / f))
        weight_map.update({n: f for n in ns})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_load_hf_named_checkpoint(tmp_path):
    cfg = models.load_config("tiny").model
    tensors = hf_tensors(cfg)
    _write_sharded(tensors, tmp_path)
    b = models.build("tiny", weights=tmp_path, decode_steps=2)
    sd = b.model.state_dict()
    model_names = set(sd)
    hf_names = {n for n in tensors if not n.startswith(f"model.layers.{cfg.num_hidden_layers}.")}
    assert model_names == hf_names  # the model's parameter names are exactly HF's
    for n in hf_names:
        assert torch.equal(sd[n], tensors[n].to(torch.bfloat16).to(sd[n].dtype)), n
    assert sd["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # router stays fp32
    b.driver.prefill()
    out = b.driver.step().logits
    assert torch.isfinite(out.float()).all()


def test_load_errors_name_the_tensor(tmp_path):
    cfg = models.load_config("tiny").model
    tensors = hf_tensors(cfg, extra_layers=0)
    missing = dict(tensors)
    del missing["model.layers.3.self_attn.o_proj.weight"]
    d1 = tmp_path / "missing"
    d1.mkdir()
    save_file(missing, str(d1 / "model.safetensors"))
    with pytest.raises(RuntimeError, match=r"missing \['model.layers.3.self_attn.o_proj.weight'\]"):
        models.build("tiny", weights=d1)
    bad = dict(tensors)
    bad["model.layers.0.self_attn.indexer.wk.weight"] = torch.zeros(3, 3)
    d2 = tmp_path / "shape"
    d2.mkdir()
    save_file(bad, str(d2 / "model.safetensors"))
    with pytest.raises(RuntimeError, match=r"'model.layers.0.self_attn.indexer.wk.weight' has shape \(3, 3\)"):
        models.build("tiny", weights=d2)
    extra = dict(tensors)
    extra["model.layers.1.self_attn.indexer.wk.weight"] = torch.zeros(cfg.index_head_dim, cfg.hidden_size)
    d3 = tmp_path / "extra"
    d3.mkdir()
    save_file(extra, str(d3 / "model.safetensors"))  # a shared layer has no indexer
    with pytest.raises(RuntimeError, match=r"unexpected \['model.layers.1.self_attn.indexer.wk.weight'\]"):
        models.build("tiny", weights=d3)


def test_seeded_init_is_deterministic_and_save_roundtrips(tmp_path):
    a = models.build("tiny").model.state_dict()
    b = models.build("tiny").model.state_dict()
    c = models.build("tiny", seed=1).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    m = models.build("tiny").model
    models.save_safetensors(m, tmp_path)
    loaded = models.build("tiny", weights=tmp_path).model.state_dict()
    assert all(torch.equal(a[k], loaded[k]) for k in a)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "glm_moe_dsa"

"""The KV store's reload on every transformers family the offload serves (``families.FAMILY_TABLE``'s
"offload" rows of the installed release), each a tiny fp32 model of its preset shrunk to 2 layers: turn 2
of a chat reloads turn 1's conversation and generates exactly the tokens of one full prefill of the whole
prompt. A family whose cache a stored prefix cannot be reloaded into is refused by name, never reloaded wrong."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import yaml
from transformers import StaticCache

from offload_passes import _compat
from offload_passes.models import hf
from offload_passes.models.hf import families
from offload_passes.store import KVStore, RamTier
from offload_passes.store.hf import check_hf_store, generate_with_store, hf_cache_layout, hf_fingerprint, reload_hf

C = 16
GEN = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, pad_token_id=0)

#: each family's preset shrunk to 2 layers (the per-layer lists cut to match, every kind of layer kept)
SHRINK = {
    "glm_moe_dsa": {"num_hidden_layers": 2, "index_topk_pattern": "FS"},
    "deepseek_v32": {"num_hidden_layers": 2},
    "axk2": {"num_hidden_layers": 2},
    "hy_v4": {"num_hidden_layers": 2, "indexer_types": ["full", "shared"]},
    "hy_v4_vl": {"num_hidden_layers": 2, "indexer_types": ["full", "shared"]},
    "dots3_note": {"num_hidden_layers": 2, "layer_types": ["indexed_attention", "sliding_attention"]},
    "mistral_large4": {"num_hidden_layers": 2, "indexer_types": ["full", "shared"], "kv_source_layers": [0, 0]},
    "glm5_next": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "indexed_attention"],
                  "mlp_layer_types": ["dense", "sparse"], "indexer_types": ["full", "full"]},
}
#: families the store refuses, and why (offload_passes/store/hf.py)
REFUSED = {"dots3_note": "sliding-window layers keep only the last window",
           "mistral_large4": "kv_source_layers read another layer's cache",
           "glm5_next": "linear-attention layers keep a recurrent state"}


def _installed(family: str) -> bool:
    since = families.FAMILY_TABLE[family].since
    return since is None or _compat.transformers_version() >= tuple(int(p) for p in since.split(".")[:2])


OFFLOADED = [f for f, e in families.FAMILY_TABLE.items() if e.outcome == "offload" and _installed(f)]
SERVED = [f for f in OFFLOADED if f not in REFUSED]


def test_every_offloaded_family_is_served_or_refused():
    assert sorted(set(OFFLOADED) - set(SHRINK)) == [], "an offloaded family without a shrunk preset here"
    assert set(REFUSED) <= set(OFFLOADED)
    assert {"glm_moe_dsa", "deepseek_v32", "hy_v4"} <= set(SERVED)


@functools.lru_cache(maxsize=None)
def _model(family: str):
    torch.set_num_threads(1)
    raw = copy.deepcopy(yaml.safe_load((hf.CONFIG_DIR / f"{families.FAMILY_TABLE[family].preset}.yaml").read_text()))
    mc = raw["model_config"]
    (mc["text_config"] if "text_config" in mc else mc).update(SHRINK[family])
    m = hf.build(raw, dtype="float32", attn="eager").model
    m.generation_config.eos_token_id = None
    return m


@pytest.mark.parametrize("family", SERVED)
def test_second_turn_reloads_and_equals_a_full_prefill(family):
    m = _model(family)
    lay = hf_cache_layout(m)
    assert {"0.k", "0.v", "1.k", "1.v"} <= set(lay) and any(n.endswith(".index_k") for n in lay), lay
    store = KVStore(hf_fingerprint(m, C, weights_id=f"{family}-2l"), C, [RamTier(1 << 26)])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 256, (1, 40), generator=g)
    out1 = generate_with_store(m, store, ids, max_cache_len=128, **GEN)
    assert store.stats.tokens_loaded == 0
    ids = torch.cat([out1.sequences, torch.randint(2, 256, (1, 7), generator=g)], 1)  # 44 + 7 tokens
    out2 = generate_with_store(m, store, ids, max_cache_len=128, **GEN)
    assert store.stats.tokens_loaded == 43  # turn 1's prompt and 3 decoded tokens (the last one has no KV)
    full = m.generate(ids, attention_mask=torch.ones_like(ids), cache=StaticCache(config=m.config, max_cache_len=128),
                      **GEN)
    assert torch.equal(out2.sequences, full.sequences)
    assert store.stats.chunks_rejected == 0


@pytest.mark.parametrize("family", [f for f in OFFLOADED if f in REFUSED])
def test_unserved_family_is_refused_by_name(family):
    m = _model(family)
    with pytest.raises(ValueError, match=rf"hf_fingerprint: the KV store does not serve model type '\w+': its "
                                         rf"{REFUSED[family]}"):
        hf_fingerprint(m, C, weights_id="x")
    other = _model(SERVED[0])
    store = KVStore(hf_fingerprint(other, C, weights_id="x"), C, [RamTier(1 << 20)])
    with pytest.raises(ValueError, match=rf"offload: the KV store does not serve model type .*{REFUSED[family]}"):
        check_hf_store(m, store, where="offload")
    cache = StaticCache(config=m.config, max_cache_len=64)
    with pytest.raises(ValueError, match=rf"reload_hf: the KV store does not serve .*{REFUSED[family]}"):
        reload_hf(store, m, torch.randint(2, 256, (1, 20)), cache)
    assert cache.get_seq_length() == 0 and store.stats.tokens_loaded == 0

"""The KV store's reload on every transformers family the offload serves (``families.FAMILY_TABLE``'s
"offload" rows of the installed release), each a tiny fp32 model of its preset shrunk to 2 layers: turn 2
of a chat reloads turn 1's conversation and generates exactly the tokens of one full prefill of the whole
prompt. The families whose layers keep less than per-token KV of their own (``mistral_large4``: a layer reading
another's cache; ``dots3_note``: sliding-window layers; ``glm5_next``: linear-attention layers) reload bit-identical
to the same model that kept its cache, with a StaticCache, a DynamicCache and a HostStaticCache, and from disk in
a new process; where no end snapshot exists, nothing is reloaded."""
from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import DynamicCache, StaticCache

from offload_passes import _compat
from offload_passes.hf_cache import HostStaticCache
from offload_passes.models import hf
from offload_passes.models.hf import families
from offload_passes.store import DiskTier, Fingerprint, KVStore, RamTier
from offload_passes.store.chunk import encode_chunk
from offload_passes.store.hf import (check_hf_store, generate_with_store, hf_cache_layout, hf_end_snapshot,
                                     hf_fingerprint, reload_hf)

C = 16
GEN = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True, pad_token_id=0)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
#: the families whose layers keep less than per-token KV of their own: shared, sliding-window, linear-attention
PARTIAL = ["mistral_large4", "dots3_note", "glm5_next"]
#: the cache kinds a reload fills (HostStaticCache: each of them has an indexed_attention layer to keep on the host)
CACHES = {"static": lambda m: StaticCache(config=m.config, max_cache_len=128),
          "dynamic": lambda m: DynamicCache(config=m.config),
          "host": lambda m: HostStaticCache(m.config, max_cache_len=128)}


def _installed(family: str) -> bool:
    since = families.FAMILY_TABLE[family].since
    return since is None or _compat.transformers_version() >= tuple(int(p) for p in since.split(".")[:2])


OFFLOADED = [f for f, e in families.FAMILY_TABLE.items() if e.outcome == "offload" and _installed(f)]


def test_every_offloaded_family_is_served():
    assert sorted(set(OFFLOADED) - set(SHRINK)) == [], "an offloaded family without a shrunk preset here"
    assert {"glm_moe_dsa", "deepseek_v32", "hy_v4", *PARTIAL} <= set(OFFLOADED)


def _build(family: str, shrink: dict):
    torch.set_num_threads(1)
    raw = copy.deepcopy(yaml.safe_load((hf.CONFIG_DIR / f"{families.FAMILY_TABLE[family].preset}.yaml").read_text()))
    mc = raw["model_config"]
    (mc["text_config"] if "text_config" in mc else mc).update(shrink)
    m = hf.build(raw, dtype="float32", attn="eager").model
    m.generation_config.eos_token_id = None
    return m


@functools.lru_cache(maxsize=None)
def _model(family: str):
    return _build(family, SHRINK[family])


def _store(m, family: str, tiers=None) -> KVStore:
    return KVStore(hf_fingerprint(m, C, weights_id=f"{family}-2l"), C, tiers or [RamTier(1 << 26)])


def _same(a, b) -> bool:
    return torch.equal(a.sequences, b.sequences) and all(torch.equal(x, y) for x, y in zip(a.scores, b.scores))


def _full(m, ids, kind="static"):
    return m.generate(ids, attention_mask=torch.ones_like(ids), cache=CACHES[kind](m), **GEN)


@pytest.mark.parametrize("family", OFFLOADED)
def test_second_turn_reloads_and_equals_a_full_prefill(family):
    m = _model(family)
    lay = hf_cache_layout(m)
    assert all(any(n.endswith(t) for n in lay) for t in (".k", ".index_k")), lay
    if family not in PARTIAL:
        assert {"0.k", "0.v", "1.k", "1.v"} <= set(lay) and hf_end_snapshot(m) == {}, lay
    store = _store(m, family)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 256, (1, 40), generator=g)
    out1 = generate_with_store(m, store, ids, max_cache_len=128, **GEN)
    assert store.stats.tokens_loaded == 0
    ids = torch.cat([out1.sequences, torch.randint(2, 256, (1, 7), generator=g)], 1)  # 44 + 7 tokens
    out2 = generate_with_store(m, store, ids, max_cache_len=128, **GEN)
    assert store.stats.tokens_loaded == 43  # turn 1's prompt and 3 decoded tokens (the last one has no KV)
    assert torch.equal(out2.sequences, _full(m, ids).sequences)
    assert store.stats.chunks_rejected == 0


def test_layouts_of_the_partial_families():
    f32 = torch.float32
    kv = {"0.k": ((1, 64), f32), "0.v": ((1, 16), f32), "0.index_k": ((32,), f32)}
    # layer 1 reads layer 0's cache (kv_source_layers [0, 0]) and shares its indexer: no chunk tensor
    assert hf_cache_layout(_model("mistral_large4")) == kv and hf_end_snapshot(_model("mistral_large4")) == {}
    # layer 1 keeps a window of 32 tokens: its last 31 rows, the ones the next token reads, at a saved end
    assert _model("dots3_note").config.get_text_config().sliding_window == 32
    assert hf_cache_layout(_model("dots3_note")) == kv
    assert hf_end_snapshot(_model("dots3_note")) == {"1.window.k": ((31, 1, 64), f32), "1.window.v": ((31, 1, 16), f32)}
    # layer 0 keeps a conv state (kernel 4) and a recurrent state; layer 1's values are [B, 1, T, 0]: not stored
    assert hf_cache_layout(_model("glm5_next")) == {"1.k": ((1, 64), f32), "1.index_k": ((65,), f32)}
    assert hf_end_snapshot(_model("glm5_next")) == {"0.state.conv.0": ((192, 4), f32),
                                                    "0.state.recurrent.0": ((4, 16, 16), f32)}
    fp = hf_fingerprint(_model("glm5_next"), C, weights_id="x")
    assert fp.fields["chunk_extras"] == {"0.state.conv.0": [[192, 4], "float32"],
                                         "0.state.recurrent.0": [[4, 16, 16], "float32"]}


@pytest.mark.parametrize("kind", sorted(CACHES))
@pytest.mark.parametrize("first, new", [(40, 7), (12, 7), (20, 12)])  # beyond the window, within, crossing it
@pytest.mark.parametrize("family", PARTIAL)
def test_reload_is_bit_identical_to_the_kept_cache(family, first, new, kind):
    """Turn 2 reloads turn 1's whole conversation (its end snapshot) into a fresh cache: bit-identical logits
    and tokens to the same model continuing from the cache it kept, token-equal to one full prefill."""
    m = _model(family)
    store = _store(m, family)
    g = torch.Generator().manual_seed(first)
    ids = torch.randint(2, 256, (1, first), generator=g)
    kept = CACHES[kind](m)
    ref1 = m.generate(ids, attention_mask=torch.ones_like(ids), cache=kept, **GEN)
    out1 = generate_with_store(m, store, ids, cache=CACHES[kind](m), **GEN)
    assert _same(out1, ref1) and store.stats.tokens_loaded == 0
    ids = torch.cat([out1.sequences, torch.randint(2, 256, (1, new), generator=g)], 1)
    out2 = generate_with_store(m, store, ids, cache=CACHES[kind](m), **GEN)
    assert store.stats.tokens_loaded == first + 3
    assert _same(out2, m.generate(ids, attention_mask=torch.ones_like(ids), cache=kept, **GEN))
    assert torch.equal(out2.sequences, _full(m, ids, kind).sequences)
    assert store.stats.chunks_rejected == 0


@pytest.mark.parametrize("family, at_32", [("mistral_large4", 32), ("dots3_note", 0), ("glm5_next", 0)])
def test_a_prefix_reloads_only_where_an_end_snapshot_is(family, at_32):
    """A request sharing 35 tokens of a stored 43-token conversation: the per-token families reload the 32 of
    its whole chunks; a model with an end snapshot reloads nothing (its state at 32 is not stored). A request
    going on from turn 1's end reloads to there, even after turn 2 stored more past it."""
    m = _model(family)
    store = _store(m, family)
    g = torch.Generator().manual_seed(7)
    out1 = generate_with_store(m, store, torch.randint(2, 256, (1, 40), generator=g), max_cache_len=128, **GEN)
    seq1 = out1.sequences  # 44 tokens, 43 of them stored
    other = torch.cat([seq1[:, :35], torch.randint(2, 256, (1, 10), generator=g)], 1)
    assert store.lookup(other[0]).tokens == 32
    assert reload_hf(store, m, other, CACHES["static"](m)) == at_32
    out = generate_with_store(m, store, other, max_cache_len=128, **GEN)
    assert torch.equal(out.sequences, _full(m, other).sequences)
    turn2 = torch.cat([seq1, torch.randint(2, 256, (1, 9), generator=g)], 1)
    generate_with_store(m, store, turn2, max_cache_len=128, **GEN)  # stores 56 tokens: [32, 48) without a snapshot
    branch = torch.cat([seq1[:, :43], torch.randint(2, 256, (1, 9), generator=g)], 1)
    assert reload_hf(store, m, branch, CACHES["dynamic"](m)) == 43  # turn 1's end chunk [32, 43)
    out = generate_with_store(m, store, branch, max_cache_len=128, **GEN)
    assert torch.equal(out.sequences, _full(m, branch).sequences)
    assert store.stats.chunks_rejected == 0


def test_a_state_of_the_wrong_shape_is_rejected(tmp_path):
    """A chunk on disk whose recurrent state has the wrong shape fails verification: rejected, deleted, and the
    turn is computed in full (token-equal to a full prefill), never reloaded with it."""
    m = _model("glm5_next")
    store = _store(m, "glm5_next", [DiskTier(str(tmp_path), budget_bytes=1 << 28)])
    g = torch.Generator().manual_seed(3)
    out1 = generate_with_store(m, store, torch.randint(2, 256, (1, 40), generator=g), max_cache_len=128, **GEN)
    seq1 = out1.sequences[0, :43]
    n, chunks, keys = store.load_keyed(seq1, ends_with=["0.state.recurrent.0"])
    assert n == 43 and len(keys) == 3
    bad = dict(chunks[-1], **{"0.state.recurrent.0": torch.zeros(4, 16, 8)})
    store.tiers[0].delete(keys[-1])  # a tier keeps the first copy of a key: replace it
    store.tiers[0].put(keys[-1], encode_chunk(store.fp, keys[-1], 11, bad))
    ids = torch.cat([out1.sequences, torch.randint(2, 256, (1, 7), generator=g)], 1)
    cache = CACHES["static"](m)
    assert reload_hf(store, m, ids, cache) == 0 and int(cache.get_seq_length()) == 0
    assert store.stats.chunks_rejected == 1
    assert torch.equal(generate_with_store(m, store, ids, max_cache_len=128, **GEN).sequences, _full(m, ids).sequences)


def test_mistral_kv_source_layers_are_in_the_fingerprint_and_own_indexer_keys_reload():
    """kv_source_layers is a fingerprint field (a store of [0, 0] is not one of [0, 1]); a layer that reads
    layer 0's KV but runs its own indexer keeps only its indexer keys, and reloads exactly."""
    shared = _model("mistral_large4")
    own = _build("mistral_large4", {**SHRINK["mistral_large4"], "kv_source_layers": [0, 1]})
    indexer = _build("mistral_large4", {**SHRINK["mistral_large4"], "indexer_types": ["full", "full"]})
    fps = [hf_fingerprint(x, C, weights_id="w") for x in (shared, own, indexer)]
    assert [fp.fields["kv_source_layers"] for fp in fps] == [[0, 0], [0, 1], [0, 0]]
    assert len({fp.digest for fp in fps}) == 3
    assert sorted(hf_cache_layout(own)) == ["0.index_k", "0.k", "0.v", "1.k", "1.v"]
    assert sorted(hf_cache_layout(indexer)) == ["0.index_k", "0.k", "0.v", "1.index_k"]
    with pytest.raises(ValueError, match=r"offload: store's fingerprint is not this model's \(it differs in "
                                         r"\['caches', 'kv_source_layers'\]\)"):
        check_hf_store(own, KVStore(fps[0], C, [RamTier(1 << 20)]), where="offload")
    for kind in ("static", "dynamic"):
        store = _store(indexer, "mistral-own-indexer")
        g = torch.Generator().manual_seed(11)
        ids = torch.randint(2, 256, (1, 40), generator=g)
        kept = CACHES[kind](indexer)
        indexer.generate(ids, attention_mask=torch.ones_like(ids), cache=kept, **GEN)
        out1 = generate_with_store(indexer, store, ids, cache=CACHES[kind](indexer), **GEN)
        ids = torch.cat([out1.sequences, torch.randint(2, 256, (1, 7), generator=g)], 1)
        out2 = generate_with_store(indexer, store, ids, cache=CACHES[kind](indexer), **GEN)
        assert store.stats.tokens_loaded == 43
        assert _same(out2, indexer.generate(ids, attention_mask=torch.ones_like(ids), cache=kept, **GEN))


def test_a_cache_or_store_that_does_not_fit_is_refused_and_changes_nothing():
    from transformers.cache_utils import DynamicLayer

    from offload_passes.store.hf_layers import probe_layers

    with pytest.raises(ValueError, match=r"reload_hf: layer 1 is a object, whose cache the KV store does not know"):
        probe_layers(SimpleNamespace(layers=[DynamicLayer(), object()]), "reload_hf")
    glm, dots = _model("glm5_next"), _model("dots3_note")
    store = _store(glm, "glm5_next")
    ids = torch.randint(2, 256, (1, 20))
    generate_with_store(glm, store, ids, max_cache_len=64, **GEN)
    wrong = StaticCache(config=dots.config, max_cache_len=64)
    with pytest.raises(ValueError, match=r"reload_hf: cache layer 0 is a StaticIndexedLayer; the model's layer 0 "
                                         r"keeps a linear cache"):
        reload_hf(store, glm, ids, wrong)
    fields = {k: v for k, v in store.fp.fields.items() if k != "chunk_extras"}
    no_state = KVStore(Fingerprint.of(fields), C, [RamTier(1 << 20)])
    cache = CACHES["static"](glm)
    with pytest.raises(ValueError, match=r"reload_hf: the store's chunks lack \['0.state.conv.0', "
                                         r"'0.state.recurrent.0'\] of the caches the model keeps"):
        reload_hf(no_state, glm, ids, cache)
    assert int(cache.get_seq_length()) == 0 and wrong.get_seq_length() == 0
    assert store.stats.tokens_loaded == 0 and no_state.stats.loads == 0


_CHILD = textwrap.dedent("""
    import copy, json, sys, torch, yaml
    torch.set_num_threads(1)
    from offload_passes.models import hf
    from offload_passes.models.hf import families
    from offload_passes.store import DiskTier, KVStore
    from offload_passes.store.hf import generate_with_store, hf_fingerprint
    family, shrink, path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    raw = copy.deepcopy(yaml.safe_load((hf.CONFIG_DIR / f"{families.FAMILY_TABLE[family].preset}.yaml").read_text()))
    mc = raw["model_config"]
    (mc["text_config"] if "text_config" in mc else mc).update(shrink)
    m = hf.build(raw, dtype="float32", attn="eager").model
    m.generation_config.eos_token_id = None
    store = KVStore(hf_fingerprint(m, 16, weights_id=family + "-2l"), 16, [DiskTier(path, budget_bytes=1 << 28)])
    ids = torch.randint(2, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    out = generate_with_store(m, store, ids, max_cache_len=128, max_new_tokens=4, do_sample=False,
                              return_dict_in_generate=True, pad_token_id=0)
    store.close()
    print(" ".join(map(str, out.sequences[0].tolist())))
""")


@pytest.mark.parametrize("family", PARTIAL)
def test_new_process_reloads_from_disk(family, tmp_path):
    """A first process stores its conversation on disk; this one reloads it (the end snapshot too) into a fresh
    cache: bit-identical to recomputing the first turn and keeping its cache."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-c", _CHILD, family, json.dumps(SHRINK[family]), str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    seq = torch.tensor([[int(t) for t in run.stdout.split()]])
    m = _model(family)
    store = _store(m, family, [DiskTier(str(tmp_path), budget_bytes=1 << 28)])
    first = torch.randint(2, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    kept = CACHES["static"](m)
    assert torch.equal(m.generate(first, attention_mask=torch.ones_like(first), cache=kept, **GEN).sequences, seq)
    ids = torch.cat([seq, torch.randint(2, 256, (1, 6), generator=torch.Generator().manual_seed(6))], 1)
    out = generate_with_store(m, store, ids, max_cache_len=128, **GEN)
    assert store.stats.tokens_loaded == 43 and store.stats.chunks_loaded == {"disk": 3}
    assert _same(out, m.generate(ids, attention_mask=torch.ones_like(ids), cache=kept, **GEN))

"""Hugging Face reuse without keeping the cache object: a chat's next turn and a request sharing a long system
prompt reload the stored prefix into a fresh cache and generate() computes only the rest; bit-identical to
the same model that kept its cache cut at the same boundary, token-equal to one full prefill, and the same
from disk in a new process."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from offload_passes.models import hf
from offload_passes.store import DiskTier, KVStore, RamTier
from offload_passes.store.hf import generate_with_store, hf_cache_layout, hf_fingerprint, reload_hf, save_hf

C = 16
GEN = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True, pad_token_id=0)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    m = hf.build("hf-tiny", num_hidden_layers=2, index_topk_pattern="FS", dtype="float32", attn="eager").model
    m.generation_config.eos_token_id = None
    return m


def _store(model, tiers=None) -> KVStore:
    return KVStore(hf_fingerprint(model, C, weights_id="hf-tiny-2l"), C, tiers or [RamTier(1 << 26)])


def _static(model, n=256):
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=n)


def _kept(model, cache, ids, n):
    """The reference: the same model's own cache of the previous turn, cut at the reload's boundary ``n``."""
    for layer in cache.layers:
        layer.keys[:, :, n:].zero_()
        layer.values[:, :, n:].zero_()
        layer.cumulative_length.fill_(n)
        if getattr(layer, "is_indexer_initialized", False):
            layer.indexer_keys[:, n:].zero_()
            layer.indexer_cumulative_length.fill_(n)
    return model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)


def _same(a, b) -> bool:
    return torch.equal(a.sequences, b.sequences) and all(torch.equal(x, y) for x, y in zip(a.scores, b.scores))


def test_cache_layout_names_the_indexer_keys(model):
    lay = hf_cache_layout(model)
    assert lay == {"0.k": ((1, 64), torch.float32), "0.v": ((1, 16), torch.float32),
                   "0.index_k": ((32,), torch.float32), "1.k": ((1, 64), torch.float32),
                   "1.v": ((1, 16), torch.float32)}


def test_multi_turn_chat_reuses_exactly(model):
    """Three turns, each prompt = the conversation so far + new user tokens: every turn after the first
    reloads the stored conversation, bit-identical to the kept cache, token-equal to a full prefill."""
    g = torch.Generator().manual_seed(0)
    store = _store(model)
    ids = torch.randint(2, 256, (1, 70), generator=g)
    ref_cache = _static(model)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), cache=ref_cache, **GEN)
    out = generate_with_store(model, store, ids, max_cache_len=256, **GEN)
    assert _same(out, ref)
    for turn in range(2):
        ids = torch.cat([out.sequences, torch.randint(2, 256, (1, 9), generator=g)], dim=1)
        n = min(store.lookup(ids[0]).tokens, ids.size(1) - 1)
        assert n >= 64 + 16 * turn, n  # the previous turn's prompt and decoded tokens, whole chunks
        loaded = store.stats.tokens_loaded
        out = generate_with_store(model, store, ids, max_cache_len=256, **GEN)
        assert store.stats.tokens_loaded - loaded == n
        assert _same(out, _kept(model, ref_cache, ids, n))  # ref_cache now holds this turn: the next one's reference
        full = model.generate(ids, attention_mask=torch.ones_like(ids), cache=_static(model), **GEN)
        assert torch.equal(out.sequences, full.sequences)
    assert store.stats.chunks_rejected == 0


def test_shared_system_prompt_and_dynamic_cache(model):
    """A new request sharing a long system prompt reloads it into a DynamicCache as well as a StaticCache."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(1)
    system = torch.randint(2, 256, (1, 96), generator=g)
    store = _store(model)
    generate_with_store(model, store, torch.cat([system, torch.randint(2, 256, (1, 5), generator=g)], 1),
                        max_cache_len=256, **GEN)
    ids = torch.cat([system, torch.randint(2, 256, (1, 7), generator=g)], 1)
    a = generate_with_store(model, store, ids, max_cache_len=256, **GEN)
    b = generate_with_store(model, store, ids, cache=DynamicCache(config=model.config), **GEN)
    full = model.generate(ids, attention_mask=torch.ones_like(ids), cache=_static(model), **GEN)
    assert torch.equal(a.sequences, full.sequences) and torch.equal(b.sequences, full.sequences)
    assert store.stats.tokens_loaded >= 2 * 96


def test_chunk_without_indexer_keys_is_no_hit(model):
    """Chunks without the indexer keys (a layout that omits them) share no key with the model's store, and a
    reload from such a store is refused, naming what is missing; bad input is refused by name."""
    from offload_passes.store import Fingerprint

    good = _store(model)
    fields = dict(hf_fingerprint(model, C, weights_id="hf-tiny-2l").fields)
    fields["caches"] = {k: v for k, v in fields["caches"].items() if "index" not in k}
    bad = KVStore(Fingerprint.of(fields), C, [RamTier(1 << 26)])
    ids = torch.randint(2, 256, (1, 40))
    cache = _static(model)
    model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
    rows = {f"{i}.{t}": getattr(cache.layers[i], a)[0, :, :32].transpose(0, 1).contiguous()
            for i in range(2) for t, a in (("k", "keys"), ("v", "values"))}
    assert bad.put(ids[0, :32], [{k: v[:16] for k, v in rows.items()}, {k: v[16:] for k, v in rows.items()}]) == 2
    assert bad.lookup(ids[0]).tokens == 32 and good.lookup(ids[0]).tokens == 0
    with pytest.raises(ValueError, match=r"reload_hf: the store's chunks lack \['0.index_k'\]"):
        reload_hf(bad, model, ids, _static(model))
    with pytest.raises(ValueError, match=r"reload_hf: cache must be empty \(it holds 43 tokens\)"):
        reload_hf(good, model, ids, cache)
    with pytest.raises(TypeError, match="save_hf: input_ids must be an integer tensor"):
        save_hf(good, ids.float(), cache)


_CHILD = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    from offload_passes.models import hf
    from offload_passes.store import DiskTier, KVStore
    from offload_passes.store.hf import generate_with_store, hf_fingerprint
    m = hf.build("hf-tiny", num_hidden_layers=2, index_topk_pattern="FS", dtype="float32", attn="eager").model
    m.generation_config.eos_token_id = None
    store = KVStore(hf_fingerprint(m, 16, weights_id="hf-tiny-2l"), 16, [DiskTier(sys.argv[1], budget_bytes=1 << 28)])
    ids = torch.randint(2, 256, (1, 70), generator=torch.Generator().manual_seed(5))
    out = generate_with_store(m, store, ids, max_cache_len=256, max_new_tokens=4, do_sample=False,
                              return_dict_in_generate=True, pad_token_id=0)
    store.close()
    print(" ".join(map(str, out.sequences[0].tolist())))
""")


def test_new_process_reloads_from_disk(model, tmp_path):
    """A first process stores its conversation on disk; this process reloads it into a fresh cache and
    generates the next turn bit-identical to recomputing the first turn and keeping its cache."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    seq = torch.tensor([[int(t) for t in run.stdout.split()]])
    store = _store(model, [DiskTier(str(tmp_path), budget_bytes=1 << 28)])
    ids = torch.cat([seq, torch.randint(2, 256, (1, 6), generator=torch.Generator().manual_seed(6))], 1)
    n = min(store.lookup(ids[0]).tokens, ids.size(1) - 1)
    assert n == 73, n  # the first process's 70-token prompt and 3 of its 4 decoded tokens (the last has no KV)
    out = generate_with_store(model, store, ids, max_cache_len=256, **GEN)
    assert store.stats.chunks_loaded == {"disk": 5}  # 4 whole chunks of 16 and the partial last one
    ref_cache = _static(model)
    first = torch.randint(2, 256, (1, 70), generator=torch.Generator().manual_seed(5))
    assert torch.equal(model.generate(first, attention_mask=torch.ones_like(first), cache=ref_cache,
                                      **GEN).sequences, seq)
    assert _same(out, _kept(model, ref_cache, ids, n))

"""Hugging Face reuse without keeping the cache object: a chat's next turn and a request sharing a long system
prompt reload the stored prefix into a fresh cache and generate() computes only the rest; bit-identical to
the same model that kept its cache cut at the same boundary, token-equal to one full prefill, and the same
from disk in a new process."""
from __future__ import annotations

import copy
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


@pytest.fixture(scope="module")
def model16():
    """bf16: the offload ops take float16/bfloat16 KV (an fp32 model's decode keeps sparse attention)."""
    m = hf.build("hf-tiny", num_hidden_layers=2, index_topk_pattern="FS", dtype="bfloat16", attn="eager").model
    m.generation_config.eos_token_id = None
    return m


def _store16(model, tiers) -> KVStore:
    return KVStore(hf_fingerprint(model, C, weights_id="hf-tiny-2l-bf16"), C, tiers)


def _prefill_lengths(model):
    """A hook recording the token count of every forward's ``input_ids`` (the prefill's is the first of a call)."""
    seen = []
    handle = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    return seen, handle


def test_offload_with_a_store_reloads_the_chat_and_offloads_the_decode(model16, tmp_path):
    """``m = offload(model16, store=kv)`` and plain ``m.generate(ids)`` calls: turn 2 (turn 1's conversation + 9 new
    tokens) prefills only what the store lacks, its tokens are one full prefill's, the decode is offloaded (pool
    hits on the call's own cache); after a restart (a new KVStore over the same directory, a new wrapper) the
    same turn reloads from disk."""
    from offload_passes.decorator import offload, static_cache_state

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    first = torch.randint(2, 256, (1, 70), generator=g)
    new = torch.randint(2, 256, (1, 9), generator=g)
    store = _store16(model16, [RamTier(1 << 26), DiskTier(str(tmp_path), budget_bytes=1 << 28)])
    m = offload(model16, store=store, pool_size=1024)
    seen, handle = _prefill_lengths(model16)
    try:
        out1 = m.generate(first, **GEN)
        assert seen[0] == 70 and m.offload_router.reloaded == 0  # an empty store: the whole prompt computed
        ids = torch.cat([out1.sequences, new], dim=1)  # 74 + 9 = 83 tokens
        seen.clear()
        out2 = m.generate(ids, **GEN)
        # turn 1's 73 tokens with KV (its last decoded token has none) reloaded: 10 computed by the prefill
        assert store.stats.tokens_loaded == 73 and m.offload_router.reloaded == 73 and seen[0] == 10
        assert static_cache_state(out2).totals()["hits"] > 0
        full = model16.generate(ids, attention_mask=torch.ones_like(ids), cache=_static(model16), **GEN)
        assert torch.equal(out2.sequences, full.sequences)
        store.close()

        restarted = _store16(model16, [DiskTier(str(tmp_path), budget_bytes=1 << 28)])
        m2 = offload(model16, store=restarted, pool_size=1024)
        seen.clear()
        out3 = m2.generate(ids, **GEN)
        # turn 2 stored its 86 tokens with KV: its 5 whole chunks reload from disk (the partial last one holds
        # 6 tokens, the prompt has 3 of them: another key), 3 tokens computed
        assert restarted.stats.tokens_loaded == 80 and seen[0] == 3
        assert restarted.stats.chunks_loaded == {"disk": 5}
        assert torch.equal(out3.sequences, full.sequences)
        assert static_cache_state(out3).totals()["hits"] > 0
        restarted.close()
    finally:
        handle.remove()


def test_offload_store_keeps_a_callers_cache_with_content(model):
    """A cache the caller gives that already holds tokens wins: nothing reloaded into it, nothing stored."""
    from offload_passes.decorator import offload

    store = _store(model)
    m = offload(model, store=store)
    ids = torch.randint(2, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    cache = _static(model)
    m.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)  # an empty cache: served
    assert store.stats.chunks_stored == {"ram": 3} and m.offload_router.reloaded == 0  # 43 tokens: 16 + 16 + 11
    loaded, stored = store.stats.tokens_loaded, dict(store.stats.chunks_stored)
    longer = torch.cat([ids, torch.randint(2, 256, (1, 20), generator=torch.Generator().manual_seed(5))], 1)
    m.generate(longer, attention_mask=torch.ones_like(longer), cache=cache, **GEN)  # holds 43 tokens
    assert store.stats.tokens_loaded == loaded and dict(store.stats.chunks_stored) == stored
    assert m.offload_router.reloaded == 0
    assert copy.deepcopy(m).offload_router.store is None and m.offload_router.store is store  # process state


def test_offload_refuses_a_bad_store_naming_the_argument(model, model16):
    """``store`` must be a KVStore or None, of this model's fingerprint (config, dtype, cache layout, chunk
    size, and the weights when the store hashed them); a refused call changes nothing."""
    from torch import nn

    from offload_passes.decorator import offload

    with pytest.raises(TypeError, match=r"offload: store must be a KVStore \(offload_passes.store\) or None, got int"):
        offload(model, store=5)
    with pytest.raises(TypeError, match=r"offload: store must be a KVStore .* got int"):
        offload(store=5)
    with pytest.raises(TypeError, match=r"offload: store needs a model with generate\(\) .* got Linear"):
        offload(nn.Linear(2, 2), store=_store(model))
    other = hf.build("hf-tiny", num_hidden_layers=1, index_topk_pattern="F", dtype="float32", attn="eager").model
    with pytest.raises(ValueError, match=r"offload: store's fingerprint is not this model's \(it differs in "
                                         r"\['caches', 'index_topk_pattern', 'layer_types', 'num_hidden_layers'\]"):
        offload(model, store=KVStore(hf_fingerprint(other, C, weights_id="hf-tiny-2l"), C, [RamTier(1 << 20)]))
    with pytest.raises(ValueError, match=r"offload: store's fingerprint is not this model's \(it differs in "
                                         r"\['caches', 'dtype'\]"):
        offload(model, store=KVStore(hf_fingerprint(model16, C, weights_id="hf-tiny-2l"), C, [RamTier(1 << 20)]))
    retrained = copy.deepcopy(model)
    with torch.no_grad():
        next(retrained.parameters()).add_(1.0)
    with pytest.raises(ValueError, match=r"offload: store's fingerprint names other weights \(hash [0-9a-f]{12}"):
        offload(model, store=KVStore(hf_fingerprint(retrained, C), C, [RamTier(1 << 20)]))
    assert not hasattr(model, "offload_backend") and "forward" not in model.__dict__
    assert offload(model, store=KVStore(hf_fingerprint(model, C), C, [RamTier(1 << 20)])).offload_router.store


def test_class_form_reloads_too(model16):
    """``@offload(store=kv)`` on the class: each instance's generate() reloads and stores as the wrapper does
    (the fingerprint checked at the instance's first generate(), once its weights are in place)."""
    from offload_passes.decorator import offload

    store = _store16(model16, [RamTier(1 << 26)])
    cls = offload(store=store, pool_size=1024)(type(model16))
    m = cls(model16.config).to(torch.bfloat16)
    m.load_state_dict(model16.state_dict())
    m.generation_config.eos_token_id = None
    ids = torch.randint(2, 256, (1, 70), generator=torch.Generator().manual_seed(8))
    out = m.generate(ids, **GEN)
    ids = torch.cat([out.sequences, torch.randint(2, 256, (1, 9), generator=torch.Generator().manual_seed(9))], 1)
    out = m.generate(ids, **GEN)
    assert m.offload_router.reloaded == 73 and store.stats.tokens_loaded == 73
    full = model16.generate(ids, attention_mask=torch.ones_like(ids), cache=_static(model16), **GEN)
    assert torch.equal(out.sequences, full.sequences)

"""Chunk extras: whole tensors some chunks hold besides their per-token caches (the fingerprint's
``chunk_extras``), checksummed like the rest; a chunk cut short by ``limit`` loses them, ``load(ends_with=)``
ends the prefix at the last chunk holding them, and a claimed extra of the wrong shape or dtype is refused on
put and rejected on load."""
from __future__ import annotations

import pytest
import torch
from store_helpers import chunks_for, make_fp

from offload_passes.store import DiskTier, KVStore, RamTier
from offload_passes.store.chunk import ChunkError, chunk_extras, decode_chunk, encode_chunk

C = 4
EXTRAS = {"s.a": ((2, 3), torch.float32), "s.b": ((5,), torch.bfloat16)}


def _fp(**kw):
    return make_fp(chunk_extras={n: (list(s), d) for n, (s, d) in EXTRAS.items()}, **kw)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(d) for n, (s, d) in EXTRAS.items()}


def test_fingerprint_names_the_extras_and_a_bad_field_is_refused():
    assert chunk_extras(_fp()) == EXTRAS and chunk_extras(make_fp()) == {}
    assert _fp().digest != make_fp().digest
    with pytest.raises(ValueError, match=r"KVStore: chunk_extras.s must be \(shape of positive ints, torch dtype "
                                         r"name\), got \[\[0\], 'float32'\]"):
        KVStore(make_fp(chunk_extras={"s": ([0], "float32")}), C, [RamTier(1 << 20)])
    with pytest.raises(ValueError, match=r"KVStore: chunk_extras.kv is also a per-token cache"):
        KVStore(make_fp(chunk_extras={"kv": ([2], "float32")}), C, [RamTier(1 << 20)])
    with pytest.raises(ValueError, match=r"KVStore: fingerprint field 'chunk_extras' must be a non-empty mapping"):
        KVStore(make_fp(chunk_extras={}), C, [RamTier(1 << 20)])


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_extras_round_trip_and_ends_with_cuts_back_to_the_last_holder(tmp_path, tier):
    store = KVStore(_fp(), C, [RamTier(1 << 20) if tier == "ram" else DiskTier(tmp_path / "kv", 1 << 20)])
    ids = list(range(2, 12))  # 10 tokens: chunks [0, 4), [4, 8), [8, 10)
    chunks = chunks_for(store.fp, ids, C)
    chunks[1].update(_state(1))  # a sequence saved earlier ended at 8
    chunks[2].update(_state(2))
    assert store.put(ids, chunks) == 3
    n, got = store.load(ids)
    assert n == 10 and [sorted(c) for c in got] == [["idx", "kv", "rope"], sorted(chunks[1]), sorted(chunks[2])]
    assert all(torch.equal(got[2][k], v) for k, v in _state(2).items())
    n, got = store.load(ids, ends_with=["s.a", "s.b"])
    assert n == 10 and len(got) == 3 and store.stats.tokens_loaded == 20
    n, got = store.load(ids, limit=9, ends_with=["s.a"])  # the last chunk cut short: its state is not at 9
    assert n == 8 and len(got) == 2 and torch.equal(got[1]["s.a"], _state(1)["s.a"])
    n, got = store.load(ids, limit=9)
    assert n == 9 and sorted(got[2]) == ["idx", "kv", "rope"]  # cut short: it keeps no extras
    assert store.load(ids, limit=7, ends_with=["s.b"]) == (0, [])  # no holder within 7 tokens
    assert store.stats.tokens_loaded == 20 + 8 + 9
    assert store.stats.chunks_rejected == 0


def test_bad_extras_are_refused_on_put_and_rejected_on_load(tmp_path):
    store = KVStore(_fp(), C, [DiskTier(tmp_path / "kv", 1 << 20)])
    ids = list(range(2, 10))
    chunks = chunks_for(store.fp, ids, C)
    for bad, msg in (({"s.a": torch.zeros(2, 4)}, r"chunk cache 's.a' is \(2, 4\) torch.float32; expected \(2, 3\)"),
                     ({"s.b": torch.zeros(5)}, r"chunk cache 's.b' is \(5,\) torch.float32; expected \(5,\) "
                                               r"torch.bfloat16"),
                     ({"s.c": torch.zeros(1)}, r"chunk caches .* differ from the fingerprint's \['idx', 'kv', "
                                               r"'rope'\] \(optional extras: \['s.a', 's.b'\]\)"),
                     ({"s.a": [[0.0] * 3] * 2}, r"chunk cache 's.a' is a list, not a tensor")):
        with pytest.raises((ValueError, TypeError), match=r"KVStore.put: chunks\[1\]: " + msg):
            store.put(ids, [chunks[0], {**chunks[1], **bad}])
        assert store.lookup(ids).tokens == 0  # refused before anything was written
    key = store.chunk_keys(ids)[1]
    good = {**chunks[1], **_state(3)}
    assert decode_chunk(store.fp, key, encode_chunk(store.fp, key, 4, good))[1].keys() == good.keys()
    wrong = {**chunks[1], **_state(3), "s.a": torch.zeros(3, 2)}  # checksummed, but not the fingerprint's shape
    with pytest.raises(ChunkError, match=r"chunk cache 's.a' is \(3, 2\) torch.float32; expected \(2, 3\)"):
        decode_chunk(store.fp, key, encode_chunk(store.fp, key, 4, wrong))
    assert store.put(ids[:4], chunks[:1]) == 1
    store.tiers[0].put(key, encode_chunk(store.fp, key, 4, wrong))
    assert store.load(ids, ends_with=["s.a"]) == (0, [])
    assert store.stats.chunks_rejected == 1 and store.lookup(ids).tokens == 4  # the bad copy is deleted


def test_ends_with_is_checked():
    store = KVStore(_fp(), C, [RamTier(1 << 20)])
    with pytest.raises(ValueError, match=r"KVStore.load: ends_with names \['kv'\], not chunk extras of the "
                                         r"fingerprint \(it has \['s.a', 's.b'\]\)"):
        store.load([1, 2, 3], ends_with=["kv"])
    with pytest.raises(TypeError, match=r"KVStore.load: ends_with must be a sequence of chunk extra names, got 's.a'"):
        store.load([1, 2, 3], ends_with="s.a")
    assert store.stats.loads == 0

"""Fingerprints, chained chunk keys, and the chunk format: what is verified, and that nothing is unpickled."""
from __future__ import annotations

import pickle

import pytest
import torch
from store_helpers import CACHES, make_chunk, make_fp

from offload_passes.store import Fingerprint, KVStore, RamTier
from offload_passes.store.chunk import ChunkError, decode_chunk, encode_chunk
from offload_passes.store.keys import chain_keys


def test_fingerprint_is_canonical_and_sensitive():
    a = Fingerprint.of({"arch": "glm", "world": 2, "caches": CACHES, "dims": (64, 16)})
    b = Fingerprint.of({"dims": [64, 16], "caches": {k: (list(s), str(d)[6:]) for k, (s, d) in CACHES.items()},
                        "world": 2, "arch": "glm"})
    assert a.digest == b.digest and len(a.digest) == 64
    assert a.caches == {"kv": ((1, 8), torch.bfloat16), "rope": ((1, 4), torch.bfloat16), "idx": ((1, 4), torch.int8)}
    assert a.bytes_per_token() == 8 * 2 + 4 * 2 + 4
    for change in ({"world": 4}, {"dims": (64, 32)}, {"quant": "w8a8"}, {"arch": "glm5"}):
        assert Fingerprint.of({"arch": "glm", "world": 2, "caches": CACHES, "dims": (64, 16), **change}).digest != a.digest


@pytest.mark.parametrize("fields,err,msg", [
    ({"arch": "x"}, ValueError, "must include 'caches'"),
    ({"caches": {}}, ValueError, "non-empty mapping"),
    ({"caches": {"kv": ((0, 8), torch.bfloat16)}}, ValueError, "caches.kv per-token shape"),
    ({"caches": {"kv": ((8,), "floaty")}}, ValueError, "caches.kv dtype 'floaty'"),
    ({"caches": CACHES, "w": torch.zeros(1)}, TypeError, "field fields.w is a Tensor"),
    ({"caches": CACHES, "lr": float("nan")}, ValueError, "field fields.lr is nan"),
    ([("caches", CACHES)], TypeError, "fields must be a mapping"),
])
def test_fingerprint_refuses(fields, err, msg):
    with pytest.raises(err, match=msg.replace("(", r"\(").replace(")", r"\)")):
        Fingerprint.of(fields)


def test_keys_chain_over_the_prefix_and_are_salted():
    fp = make_fp()
    ids = list(range(100, 150))
    keys = chain_keys(fp.digest, ids, 16)
    assert len(keys) == 4 and len(set(keys)) == 4  # 16 + 16 + 16 + partial 2
    assert chain_keys(fp.digest, ids[:32], 16) == keys[:2]  # a shared prefix shares its keys
    other = ids.copy()
    other[3] = 7  # one token early on changes every later key
    assert all(x != y for x, y in zip(chain_keys(fp.digest, other, 16), keys))
    assert chain_keys(fp.digest, ids[:34], 16)[2] != keys[2]  # a partial chunk is not the full one
    assert chain_keys(make_fp(weights="w1").digest, ids, 16)[0] != keys[0]


@pytest.mark.parametrize("ids,err,msg", [
    ([1, 2.0], TypeError, r"KVStore.chunk_keys: token_ids\[1\] is 2.0 \(float\); token ids must be ints"),
    ([1, -3], ValueError, r"token_ids\[1\] is -3; token ids must be >= 0"),
    ([1, 600], ValueError, r"token_ids\[1\] is 600; token ids must be < vocab_size 512"),
    ([True], TypeError, r"token_ids\[0\] is True"),
    (torch.tensor([1.0]), TypeError, "must be integers, got a tensor of torch.float32"),
    ("abc", TypeError, "must be a sequence of ints"),
])
def test_token_ids_refused(ids, err, msg):
    store = KVStore(make_fp(), 4, [RamTier(1000)], vocab_size=512)
    with pytest.raises(err, match=msg):
        store.chunk_keys(ids)
    assert store.chunk_keys(torch.tensor([1, 511])) == store.chunk_keys([1, 511])


def _blob(fp, key="ab" * 32, n=3):
    return encode_chunk(fp, key, n, make_chunk(fp, n, 1)), make_chunk(fp, n, 1)


def test_chunk_round_trip_and_every_single_byte_flip_is_caught():
    fp = make_fp()
    key = "ab" * 32
    blob, tensors = _blob(fp, key)
    n, got = decode_chunk(fp, key, blob)
    assert n == 3 and all(torch.equal(got[k], tensors[k]) for k in tensors)
    for pos in range(len(blob)):  # header, metadata, checksums and tensor bytes alike
        bad = bytearray(blob)
        bad[pos] ^= 0x01
        with pytest.raises(ChunkError):
            decode_chunk(fp, key, bytes(bad))


def test_truncated_chunk_is_rejected_at_every_length():
    fp = make_fp()
    blob, _ = _blob(fp)
    for cut in range(len(blob)):
        with pytest.raises(ChunkError):
            decode_chunk(fp, "ab" * 32, blob[:cut])


def test_chunk_of_another_fingerprint_or_key_is_rejected():
    fp = make_fp()
    blob, _ = _blob(fp)
    with pytest.raises(ChunkError, match="fingerprint"):
        decode_chunk(make_fp(quant="w8a8"), "ab" * 32, blob)
    with pytest.raises(ChunkError, match="chunk key"):
        decode_chunk(fp, "cd" * 32, blob)
    # same digest field but other cache layout cannot happen; a wrong dtype in the tensors is caught by layout
    other = make_fp(caches={**CACHES, "idx": ((1, 4), torch.bfloat16)})
    with pytest.raises(ChunkError):
        decode_chunk(other, "ab" * 32, encode_chunk(fp, "ab" * 32, 3, make_chunk(fp, 3, 1)))


class _Planted:
    """A pickle whose loading would create a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_planted_pickle_is_never_unpickled(tmp_path, monkeypatch):
    marker = tmp_path / "unpickled"
    blob = pickle.dumps(_Planted(marker))
    calls = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: calls.append(a) or None)
    monkeypatch.setattr(pickle, "load", lambda *a, **k: calls.append(a) or None)
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(a) or None)
    with pytest.raises(ChunkError):
        decode_chunk(make_fp(), "ab" * 32, blob)
    assert not marker.exists() and calls == []

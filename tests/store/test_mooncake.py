"""The Mooncake tier against a real mooncake_master and holder process (``LocalMooncake``, tests/store/conftest.py): sharing
between processes, eviction as misses, the master killed and restarted mid-run, and addresses that do not
answer."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch
from store_helpers import chunks_for, make_fp, same

from offload_passes.store import KVStore, MooncakeTier, RamTier
from offload_passes.store.chunk import encode_chunk
from offload_passes.store.mooncake_local import free_port

C = 4


def _tier(cluster, **kw):
    kw.setdefault("key_prefix", f"t{uuid.uuid4().hex[:8]}/")  # tests sharing the session master never collide
    return MooncakeTier(cluster.master_addr, cluster.metadata_url, **kw)


READER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {helpers!r})
    from store_helpers import chunks_for, make_fp
    from offload_passes.store import KVStore, MooncakeTier
    fp = make_fp()
    tier = MooncakeTier(sys.argv[1], sys.argv[2], key_prefix=sys.argv[3])
    store = KVStore(fp, 4, [tier])
    ids = list(range(10))
    n, got = store.load(ids)
    want = chunks_for(fp, ids, 4, seed=7)
    ok = n == 10 and all((a[k] == b[k]).all() for a, b in zip(got, want) for k in a)
    print(n, ok, store.stats.chunks_loaded, flush=True)
    store.close()
""")


def test_chunks_are_shared_with_another_process(mooncake):
    fp = make_fp()
    tier = _tier(mooncake)
    store = KVStore(fp, C, [RamTier(1 << 20), tier])
    ids = list(range(10))
    assert store.put(ids, chunks_for(fp, ids, C, seed=7)) == 3
    assert store.stats.chunks_stored == {"ram": 3, "mooncake": 3}
    code = READER.format(helpers=os.path.dirname(__file__))
    env = dict(os.environ, GLOG_minloglevel="3", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code, mooncake.master_addr, mooncake.metadata_url, tier.key_prefix],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split(" ", 2) == ["10", "True", "{'mooncake': 3}\n"]
    store.close()


def test_load_from_the_shared_tier_promotes_and_verifies(mooncake):
    fp = make_fp()
    tier = _tier(mooncake)
    writer = KVStore(fp, C, [tier])
    ids = list(range(100, 109))
    chunks = chunks_for(fp, ids, C, seed=2)
    writer.put(ids, chunks)
    reader = KVStore(fp, C, [RamTier(1 << 20), _tier(mooncake, key_prefix=tier.key_prefix)])
    assert reader.lookup(ids).tokens == 9
    n, got = reader.load(ids + [5, 6])  # the conversation goes on: its stored 1-token tail is found in one batch
    assert n == 9 and same(got, chunks) and reader.stats.chunks_promoted == {"ram": 3}
    # a chunk of another fingerprint planted under this store's key is rejected, never loaded
    other = make_fp(weights="other")
    key = writer.chunk_keys(ids)[1]
    bad = KVStore(other, C, [RamTier(1 << 20)])
    tier.delete(key)
    tier.put(key, encode_chunk(other, bad.chunk_keys(ids)[1], C, chunks_for(other, ids, C)[1]))
    fresh = KVStore(fp, C, [_tier(mooncake, key_prefix=tier.key_prefix)])
    n, got = fresh.load(ids)
    assert n == C and same(got, chunks[:1]) and fresh.stats.chunks_rejected == 1
    assert not tier.exists(key)  # the bad copy is removed from the shared store
    for s in (writer, reader, bad, fresh):
        s.close()


BIG = {"kv": ((1, 32768), torch.bfloat16)}  # 64 KiB a token: a chunk of 4 tokens is 256 KiB


def test_a_full_shared_store_evicts_into_misses(mooncake_own):
    fp = make_fp(caches=BIG)
    store = KVStore(fp, C, [_tier(mooncake_own)])
    seqs = [[i] + list(range(1, 4 * C)) for i in range(120)]  # 120 x 1 MiB into a 16 MiB segment
    for i, ids in enumerate(seqs):
        store.put(ids, chunks_for(fp, ids, C, seed=i))
    held = 0
    for i, ids in enumerate(seqs):  # whatever survived loads exactly; what was evicted is a miss
        n, got = store.load(ids)
        assert n % C == 0 and same(got, chunks_for(fp, ids, C, seed=i)[: n // C])
        held += n
    assert held * 64 * 1024 <= 16 << 20 and held < len(seqs) * 4 * C // 2
    stats = store.stats
    assert stats.tier_faults == {} and stats.chunks_rejected == 0
    store.close()


def test_master_killed_and_restarted_mid_run(mooncake_own, caplog):
    fp = make_fp()
    tier = _tier(mooncake_own)
    store = KVStore(fp, C, [RamTier(1 << 20), tier], retry_after_s=0.5)
    a, b, c = list(range(8)), list(range(50, 58)), list(range(70, 78))
    store.put(a, chunks_for(fp, a, C, seed=1))
    mooncake_own.kill_master()
    with caplog.at_level(logging.WARNING, logger="offload_passes.store"):
        assert store.put(b, chunks_for(fp, b, C, seed=2)) == 2  # RAM still takes them
        assert store.load(a)[0] == 8 and store.load(b)[0] == 8  # from RAM
        assert store.lookup(c).tokens == 0
    assert caplog.text.count("tier 'mooncake' failed") == 1
    assert store.stats.tier_faults["mooncake"] >= 1
    mooncake_own.start_master()
    time.sleep(0.6)  # past retry_after_s: the tier is tried again
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the holder mounts its segment on the new master by itself
        store.put(c, chunks_for(fp, c, C, seed=3))
        if tier.exists(store.chunk_keys(c)[0]):
            break
        time.sleep(0.6)
    reader = KVStore(fp, C, [_tier(mooncake_own, key_prefix=tier.key_prefix)])
    n, got = reader.load(c)
    assert n == 8 and same(got, chunks_for(fp, c, C, seed=3))
    assert reader.load(a) == (0, [])  # the new master never had them: a miss, never an error
    store.close()
    reader.close()


def test_store_address_that_does_not_answer(caplog):
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=f"MooncakeTier: master '{dead}' does not answer"):
        MooncakeTier(dead, f"http://{dead}/metadata", connect_timeout_s=0.5)
    with pytest.raises(ValueError, match="MooncakeTier: master 'nowhere' names no host and port"):
        MooncakeTier("nowhere", "http://127.0.0.1:1/metadata")
    with caplog.at_level(logging.WARNING, logger="offload_passes.store.mooncake"):
        tier = MooncakeTier(dead, f"http://{dead}/metadata", optional=True, connect_timeout_s=0.5)
    assert not tier.available and "unavailable" in caplog.text
    fp = make_fp()
    store = KVStore(fp, C, [RamTier(1 << 20), tier])
    ids = list(range(8))
    assert store.put(ids, chunks_for(fp, ids, C)) == 2 and store.load(ids)[0] == 8
    assert store.stats.chunks_stored == {"ram": 2} and store.stats.tier_faults == {}


def test_metadata_that_does_not_answer(mooncake):
    dead = free_port()
    with pytest.raises(ValueError, match=f"MooncakeTier: metadata 'http://127.0.0.1:{dead}/metadata' does not answer"):
        MooncakeTier(mooncake.master_addr, f"http://127.0.0.1:{dead}/metadata", connect_timeout_s=0.5)
    with pytest.raises(ValueError, match="MooncakeTier: local_buffer_size must be an int >= 0"):
        MooncakeTier(mooncake.master_addr, mooncake.metadata_url, local_buffer_size=-1)

"""KVStore over RAM and disk tiers: reuse, budgets, spill and promotion, restarts, bad files, disk faults,
killed writers, concurrent writers, and refused arguments."""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal

import pytest
import torch
from store_helpers import chunks_for, make_chunk, make_fp, same

import offload_passes.store.tiers.disk as disk_mod
from offload_passes.store import DiskTier, KVStore, RamTier

C = 4


def _store(tmp_path, ram=1 << 20, disk=1 << 20, fp=None, **kw):
    return KVStore(fp or make_fp(), C, [RamTier(ram), DiskTier(tmp_path / "kv", disk)], **kw)


def test_put_lookup_load_and_limit(tmp_path):
    store = _store(tmp_path)
    ids = list(range(10))
    chunks = chunks_for(store.fp, ids, C)
    assert store.put(ids, chunks) == 3
    look = store.lookup(ids + [99, 98])  # a resumed conversation: the stored partial chunk is found too
    assert look.tokens == 10 and [c[2] for c in look.chunks] == [4, 4, 2]
    assert [c[1] for c in look.chunks] == ["ram", "ram", "ram"] and look.chunks[2][0] == store.chunk_keys(ids)[2]
    n, got = store.load(ids + [99, 98, 97, 96, 95])
    assert n == 10 and same(got, chunks)
    assert store.lookup(ids[:9] + [42]).tokens == 8  # chunk [8, 42] is not the stored [8, 9], nor is [8] stored
    n, got = store.load(ids)
    assert n == 10 and same(got, chunks)
    n, got = store.load(ids, limit=9)
    assert n == 9 and [next(iter(c.values())).shape[0] for c in got] == [4, 4, 1]
    assert torch.equal(got[2]["kv"], chunks[2]["kv"][:1])
    assert store.load(ids, limit=0) == (0, [])
    assert store.put(ids, chunks) == 0 and store.stats.chunks_skipped == 3
    s = store.stats
    assert s.chunks_stored == {"ram": 3, "disk": 3} and s.chunks_loaded == {"ram": 9}
    # RAM keeps the tensors (their bytes), disk the safetensors files (the tensors + a header each)
    assert s.bytes["ram"] == sum(t.numel() * t.element_size() for c in chunks for t in c.values()) > 0
    assert s.bytes["disk"] == sum(f.stat().st_size for f in (tmp_path / "kv").rglob("*.safetensors")) > s.bytes["ram"]


def test_disk_survives_restart_and_promotes(tmp_path):
    ids = list(range(12))
    fp = make_fp()
    chunks = chunks_for(fp, ids, C, seed=3)
    _store(tmp_path, fp=fp).put(ids, chunks)
    again = _store(tmp_path, fp=fp)  # a new process's store on the same directory
    assert again.lookup(ids).chunks[0][1] == "disk"
    n, got = again.load(ids)
    assert n == 12 and same(got, chunks)
    assert again.stats.chunks_loaded == {"disk": 3} and again.stats.chunks_promoted == {"ram": 3}
    assert again.lookup(ids).chunks[0][1] == "ram"


def test_ram_hits_are_neither_decoded_nor_hashed_and_disk_hits_are_verified(tmp_path, monkeypatch):
    """A chunk is verified when it enters the process: a RAM hit does no deserialisation and no sha256, a disk
    hit decodes and checks every chunk (then the RAM copy it was promoted to is trusted). The RAM tier keeps its
    own copy of what ``put`` got; ``load`` hands out clones unless told the caller copies (``copy=False``)."""
    import offload_passes.store.chunk as chunk_mod

    ids = list(range(10))
    fp = make_fp()
    chunks = chunks_for(fp, ids, C, seed=5)
    _store(tmp_path, fp=fp).put(ids, [{k: v.clone() for k, v in c.items()} for c in chunks])
    store = _store(tmp_path, fp=fp)  # a new process: the chunks are on disk only
    hashed = []
    real_sha = chunk_mod._tensor_sha
    monkeypatch.setattr(chunk_mod, "_tensor_sha", lambda t: hashed.append(1) or real_sha(t))
    n, got = store.load(ids)
    assert n == 10 and same(got, chunks) and len(hashed) == 3 * len(fp.caches)  # every tensor of every chunk
    assert store.stats.chunks_loaded == {"disk": 3} and store.stats.chunks_promoted == {"ram": 3}
    monkeypatch.setattr(chunk_mod, "_tensor_sha", lambda t: pytest.fail("a RAM hit was hashed"))
    monkeypatch.setattr("offload_passes.store.store.decode_chunk", lambda *a: pytest.fail("a RAM hit was decoded"))
    n, mine = store.load(ids)  # copy=True: the caller's to change
    assert n == 10 and same(mine, chunks) and store.stats.chunks_loaded == {"disk": 3, "ram": 3}
    for c in mine:
        c["kv"].fill_(7)
    n, shared = store.load(ids, copy=False)
    n2, again = store.load(ids, copy=False)
    assert n == n2 == 10 and same(shared, chunks)
    assert all(a[k].data_ptr() == b[k].data_ptr() for a, b in zip(shared, again) for k in a)  # the tier's own
    monkeypatch.setattr(chunk_mod, "_tensor_sha", real_sha)  # put encodes for the disk tier (hashing is right)
    fresh = _store(tmp_path / "other", fp=fp)
    mutable = [{k: v.clone() for k, v in c.items()} for c in chunks]
    fresh.put(ids, mutable)
    for c in mutable:
        c["kv"].fill_(3)  # the caller changes its tensors after put: the stored chunk does not change
    assert same(fresh.load(ids)[1], chunks)
    with pytest.raises(TypeError, match="KVStore.load: copy must be a bool, got 'yes'"):
        store.load(ids, copy="yes")


def test_budgets_hold_after_every_put_and_evictions_spill_down(tmp_path):
    fp = make_fp()
    blob_size = len(__import__("offload_passes.store.chunk", fromlist=["x"]).encode_chunk(
        fp, "ab" * 32, C, make_chunk(fp, C, 0)))
    held_size = sum(t.numel() * t.element_size() for t in make_chunk(fp, C, 0).values())  # what RAM counts
    ram, disk = 3 * held_size + 10, 7 * blob_size + 10
    store = KVStore(fp, C, [RamTier(ram), DiskTier(tmp_path / "kv", disk)], write_through=False)
    seqs = []
    for i in range(12):
        ids = [1000 + i] + list(range(2 * C - 1))
        seqs.append(ids)
        store.put(ids, chunks_for(fp, ids, C, seed=i))
        assert store.tiers[0].used_bytes <= ram and store.tiers[1].used_bytes <= disk
        on_disk = sum(f.stat().st_size for f in (tmp_path / "kv").rglob("*.safetensors"))
        assert on_disk == store.tiers[1].used_bytes <= disk
    assert store.stats.chunks_spilled["disk"] > 0
    # the most recent sequences load, whole, from RAM or disk; the oldest were evicted from both
    n, got = store.load(seqs[-1])
    assert n == 2 * C and same(got, chunks_for(fp, seqs[-1], C, seed=11))
    assert store.load(seqs[0]) == (0, [])


def _plant(tmp_path, store, ids, data: bytes):
    key = store.chunk_keys(ids)[0]
    path = tmp_path / "kv" / key[:2] / (key + ".safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("damage", ["truncate", "flip", "pickle", "other_fingerprint"])
def test_bad_chunk_file_ends_the_prefix(tmp_path, damage, caplog):
    fp = make_fp()
    ids = list(range(8))
    chunks = chunks_for(fp, ids, C)
    _store(tmp_path, fp=fp).put(ids, chunks)
    store = KVStore(fp, C, [DiskTier(tmp_path / "kv", 1 << 20)])
    key0, key1 = store.chunk_keys(ids)
    p1 = tmp_path / "kv" / key1[:2] / (key1 + ".safetensors")
    p0 = tmp_path / "kv" / key0[:2] / (key0 + ".safetensors")
    marker = tmp_path / "unpickled"
    data = p1.read_bytes()
    if damage == "truncate":
        p1.write_bytes(data[: len(data) - 5])
    elif damage == "flip":
        p1.write_bytes(data[:-3] + bytes([data[-3] ^ 0x40]) + data[-2:])
    elif damage == "pickle":
        p1.write_bytes(pickle.dumps(_Planted(marker)))
    else:  # a whole, valid chunk of another model renamed to this key
        other = make_fp(quant="w8a8")
        other_store = KVStore(other, C, [DiskTier(tmp_path / "other", 1 << 20)])
        other_store.put(ids, chunks_for(other, ids, C))
        okey = other_store.chunk_keys(ids)[1]
        p1.write_bytes((tmp_path / "other" / okey[:2] / (okey + ".safetensors")).read_bytes())
    with caplog.at_level(logging.WARNING, logger="offload_passes.store"):
        n, got = store.load(ids)
    assert n == C and same(got, chunks[:1])  # the first chunk, then the bad one ends the prefix
    assert store.stats.chunks_rejected == 1 and not marker.exists()
    assert not p1.exists() and p0.exists()  # the bad copy is deleted; the next put writes a good one
    assert "rejected" in caplog.text
    store.put(ids, chunks)
    assert store.load(ids)[0] == 8


class _Planted:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _write(mode: str, path: str, n_chunks: int, seed: int, out, start=None) -> None:
    """A writer process (forked: no second torch import): stores ``n_chunks`` chunks, sends (stored, faults)."""
    import resource
    import signal

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("offload_passes.store").addHandler(handler)
    fp = make_fp()
    if mode == "fsize":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))
    store = KVStore(fp, 4, [DiskTier(path, 1 << 30, fsync=mode == "slow")])
    if mode == "slow":
        def stall(fd):
            out.send("writing")
            signal.pause()
        disk_mod.os.fsync = stall
    ids = list(range(4 * n_chunks))
    chunks = chunks_for(fp, ids, 4, seed=seed)
    if start is not None:
        start.wait()
    n = store.put(ids, chunks)
    out.send((n, store.stats.tier_faults, warnings))


def _writer(tmp_path, mode, n_chunks, seed=0, start=None):
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_write, args=(mode, str(tmp_path / "kv"), n_chunks, seed, send, start))
    p.start()
    return p, recv


def test_writer_killed_mid_chunk_leaves_nothing_loadable(tmp_path):
    w, out = _writer(tmp_path, "slow", 1)
    assert out.recv() == "writing"  # blocked after writing the temporary file, before it is linked
    os.kill(w.pid, signal.SIGKILL)
    w.join()
    temps = list((tmp_path / "kv").rglob(".tmp.*"))
    assert len(temps) == 1 and not list((tmp_path / "kv").rglob("*.safetensors"))
    store = KVStore(make_fp(), C, [DiskTier(tmp_path / "kv", 1 << 20)])
    assert store.load(list(range(4))) == (0, []) and store.stats.chunks_rejected == 0
    assert not list((tmp_path / "kv").rglob(".tmp.*"))  # the dead writer's temporary file is removed


def test_file_size_limit_is_a_counted_fault_not_an_error(tmp_path):
    w, out = _writer(tmp_path, "fsize", 3)
    stored, faults, warnings = out.recv()
    w.join()
    assert w.exitcode == 0 and stored == 0 and faults == {"disk": 1}  # one fault, then the tier is skipped
    assert len(warnings) == 1 and "tier 'disk' failed" in warnings[0] and "File too large" in warnings[0]
    assert not list((tmp_path / "kv").rglob(".tmp.*")) and not list((tmp_path / "kv").rglob("*.safetensors"))


def test_directory_replaced_by_a_file_mid_run(tmp_path, caplog):
    fp = make_fp()
    store = KVStore(fp, C, [RamTier(1 << 20), DiskTier(tmp_path / "kv", 1 << 20)], retry_after_s=0)
    ids = list(range(8))
    store.put(ids[:4], chunks_for(fp, ids[:4], C))
    import shutil
    shutil.rmtree(tmp_path / "kv")
    (tmp_path / "kv").write_bytes(b"not a directory")
    with caplog.at_level(logging.WARNING, logger="offload_passes.store"):
        assert store.put(ids, chunks_for(fp, ids, C)) == 1  # RAM took the new chunk
        n, _ = store.load(ids)
        store.put(list(range(50, 58)), chunks_for(fp, list(range(50, 58)), C))
    assert n == 8 and store.stats.tier_faults["disk"] >= 2
    assert caplog.text.count("tier 'disk' failed") == 1  # one warning for the outage


def test_two_processes_store_the_same_chunks(tmp_path):
    start = multiprocessing.get_context("fork").Barrier(2)
    ws = [_writer(tmp_path, "plain", 20, seed=5, start=start) for _ in range(2)]
    outs = [out.recv()[:2] for _, out in ws]
    for w, _ in ws:
        w.join()
    assert [w.exitcode for w, _ in ws] == [0, 0] and sum(n for n, _ in outs) >= 20 and all(f == {} for _, f in outs)
    files = list((tmp_path / "kv").rglob("*.safetensors"))
    assert len(files) == 20 and not list((tmp_path / "kv").rglob(".tmp.*"))
    fp = make_fp()
    ids = list(range(80))
    for _ in range(2):
        store = KVStore(fp, C, [DiskTier(tmp_path / "kv", 1 << 20)])
        n, got = store.load(ids)
        assert n == 80 and same(got, chunks_for(fp, ids, C, seed=5))


@pytest.mark.parametrize("build,err,msg", [
    (lambda p: RamTier(-1), ValueError, "RamTier: budget_bytes must be >= 0, got -1"),
    (lambda p: RamTier(1.5), TypeError, r"RamTier: budget_bytes must be an int >= 0, got 1.5 \(float\)"),
    (lambda p: RamTier(True), TypeError, r"RamTier: budget_bytes must be an int >= 0, got True \(bool\)"),
    (lambda p: DiskTier(p / "f", 10), ValueError, "DiskTier: path .* exists and is not a directory"),
    (lambda p: DiskTier(p / "f" / "sub", 10), ValueError, "DiskTier: path .* cannot be created"),
    (lambda p: DiskTier(p / "d", -5), ValueError, "DiskTier: budget_bytes must be >= 0, got -5"),
    (lambda p: KVStore(make_fp(), 6, [RamTier(9)], block_size=4), ValueError,
     "KVStore: chunk_tokens 6 must be a multiple of block_size 4"),
    (lambda p: KVStore(make_fp(), 0, [RamTier(9)]), ValueError, r"KVStore: chunk_tokens must be a positive int \(>= 1\), got 0"),
    (lambda p: KVStore(make_fp(), 4, [RamTier(9)], block_size=True), TypeError, "KVStore: block_size must be a positive int"),
    (lambda p: KVStore(make_fp(), 4, []), ValueError, "KVStore: tiers must be a non-empty list"),
    (lambda p: KVStore(make_fp(), 4, [RamTier(9), RamTier(9)]), ValueError, "repeats the tier name 'ram'"),
    (lambda p: KVStore(make_fp(), 4, [object()]), TypeError, r"tiers\[0\] \(object\) lacks"),
    (lambda p: KVStore(make_fp(chunk_tokens=8), 4, [RamTier(9)]), ValueError, "differs from the fingerprint's chunk_tokens 8"),
    (lambda p: KVStore(make_fp(), 4, [RamTier(9)], vocab_size=0), ValueError, "KVStore: vocab_size must be a positive int"),
    (lambda p: KVStore({"caches": {}}, 4, [RamTier(9)]), TypeError, "KVStore: fp must be a Fingerprint"),
])
def test_constructor_arguments_refused(tmp_path, build, err, msg):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(err, match=msg):
        build(tmp_path)


def test_refused_put_and_load_change_nothing(tmp_path):
    store = _store(tmp_path, vocab_size=64)
    fp = store.fp
    ids = list(range(8))
    good = chunks_for(fp, ids, C)
    before = store.stats.as_dict()
    bad_calls = [
        (lambda: store.put(ids, good + good[:1]), ValueError, "3 chunks for 8 tokens; at most 2"),
        (lambda: store.put(ids, [good[0], {**good[1], "kv": good[1]["kv"].float()}]), ValueError,
         r"chunks\[1\]: chunk cache 'kv' is \(4, 1, 8\) torch.float32; expected \(4, 1, 8\) torch.bfloat16"),
        (lambda: store.put(ids, [{k: v for k, v in good[0].items() if k != "idx"}, good[1]]), ValueError,
         "chunk caches .* differ from the fingerprint's"),
        (lambda: store.put(ids, [{k: v[:2] for k, v in good[0].items()}, good[1]]), ValueError,
         r"chunks\[0\] holds 2 tokens; tokens \[0, 4\) need 4"),
        (lambda: store.put(ids[:7] + [64], good), ValueError, "token ids must be < vocab_size 64"),
        (lambda: store.load(ids, limit=-1), ValueError, "KVStore.load: limit must be None or an int >= 0"),
        (lambda: store.put(ids, good[0]), TypeError, "chunks must be a list of dicts"),
    ]
    for call, err, msg in bad_calls:
        with pytest.raises(err, match=msg):
            call()
    assert store.stats.as_dict() == before and store.tiers[0].used_bytes == 0
    assert not list((tmp_path / "kv").rglob("*.safetensors"))

"""Property: over random puts, loads, evictions across RAM and disk, and restarts (a new KVStore on the same
directory), every load returns exactly the tensors put for that prefix, never a chunk of another prefix or
fingerprint, and the budgets hold."""
from __future__ import annotations

import shutil
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st
from store_helpers import chunks_for, make_fp, same

from offload_passes.store import DiskTier, KVStore, RamTier
from offload_passes.store.chunk import encode_chunk

C = 3
FPS = [make_fp(), make_fp(weights="w1")]
BLOB = len(encode_chunk(FPS[0], "ab" * 32, C, chunks_for(FPS[0], [0] * C, C)[0]))

# a few sequences sharing prefixes (and whole chunks), and random ones
POOL = [[1] * 7, [1] * 9 + [2], [1, 1, 1, 2, 2], [3] * 12, [3] * 6 + [0, 0]]
seqs = st.one_of(st.sampled_from(POOL), st.lists(st.integers(0, 3), min_size=1, max_size=4 * C))
ops = st.lists(st.tuples(st.sampled_from(["put", "load", "restart"]), st.integers(0, 1), seqs, st.integers(0, 5)),
               min_size=1, max_size=25)


def _seed(fp_index: int, ids: list) -> int:
    # the chunk contents are a function of the fingerprint and the prefix only, as real KV is
    return hash((fp_index, tuple(ids))) % (1 << 31)


def _expected(fp_index: int, ids: list) -> list:
    """The chunks a put of ``ids`` stores: chunk i's contents depend on the prefix up to its end only."""
    out = []
    for s in range(0, len(ids), C):
        e = min(len(ids), s + C)
        out.append(chunks_for(FPS[fp_index], ids[s:e], C, seed=_seed(fp_index, ids[:e]))[0])
    return out


@settings(max_examples=60)
@given(ops=ops, ram_chunks=st.integers(1, 4), disk_chunks=st.integers(1, 8))
def test_loads_return_exactly_what_was_put(ops, ram_chunks, disk_chunks):
    root = tempfile.mkdtemp()
    try:
        ram, disk = ram_chunks * BLOB + 1, disk_chunks * BLOB + 1

        def open_stores():
            return [KVStore(fp, C, [RamTier(ram), DiskTier(f"{root}/d", disk, fsync=False)], write_through=wt)
                    for fp, wt in zip(FPS, (True, False))]

        stores = open_stores()
        for op, which, ids, lim in ops:
            store = stores[which]
            if op == "put":
                store.put(ids, _expected(which, ids))
            elif op == "restart":
                stores = open_stores()
                continue
            else:
                limit = None if lim == 5 else lim
                n, got = store.load(ids, limit=limit)
                want = _expected(which, ids)
                cut = [{k: v[: n - i * C] for k, v in c.items()} for i, c in enumerate(want[: len(got)])]
                assert n <= (len(ids) if limit is None else min(limit, len(ids)))
                assert sum(next(iter(c.values())).shape[0] for c in got) == n and same(got, cut)
                assert store.stats.chunks_rejected == 0
            for s in stores:
                assert s.tiers[0].used_bytes <= ram and s.tiers[1].used_bytes <= disk
    finally:
        shutil.rmtree(root)

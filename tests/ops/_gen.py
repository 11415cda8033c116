"""Seeded random-input generators shared by the op tests (plan / install / serve / gather).

Stable API (other test files import it; extend, do not change signatures):

``gen(seed) -> torch.Generator``
``lengths(B, S, K, g, lo=None, hi=None) -> int32 [B]``
    ``full_kv_actual_seq``: per batch row cache length including this step's S tokens,
    uniform in ``[lo, hi]`` (defaults ``[1, 2*K]``).
``topk(L, S, K, g, prev=None, reuse=0.8, fill=1.0, hole=0.0, future=0.0, beyond=0, dup=0.0) -> int32 [B,S,1,K]``
    Indexer-like top-k: row ``(b, s)`` holds ``min(K, max_sel+1)`` (times ``fill``) distinct valid ids
    in random order, then ``-1``. ``prev`` (last step's top-k, same shape) gives temporal locality: a
    ``reuse`` fraction of each row is drawn from last step's ids of batch row ``b`` and from this
    step's row ``(b, 0)``. Contract breakers, each applied per row with the given probability:
    ``hole`` puts a ``-1`` inside the valid prefix (half the time at a microtask's last column),
    ``future`` puts an id ``> max_sel`` inside the prefix, ``dup`` duplicates an id inside the row;
    ``beyond`` (an int id_range IR, 0 = off) replaces a few ids by ids ``>= IR``.
``pool_state(B, PS, IR, g, fill=0.5, max_id=None, prefer=None) -> (pool_ids, id_to_slot, lru_counter)``
    A consistent pool (docs/ops.md §8.4): distinct resident ids ``< min(IR, max_id)`` in their own set,
    ``id_to_slot`` the inverse, counters in ``[0, 15]``. ``prefer`` (int tensor ``[B, ...]``, e.g.
    last step's top-k) lists ids tried first, so that a following top-k gets pool hits.
``garbage_state(B, PS, IR, g) -> (pool_ids, id_to_slot, lru_counter)``
    Arbitrary int32 metadata (out-of-range values, negatives, inconsistent maps) for robustness tests.
``first_occurrence(x) -> int64 indices``
    Indices of the first occurrence of each distinct value of a 1-D tensor, in order of appearance
    (the install dedupe order).
``payload(shape, dtype, g) -> Tensor``
    Random f16/bf16 values in ``±[0.01, 1.01]`` (no zeros, no NaN): rows are almost surely pairwise
    distinct, so a row copied from the wrong source is detected.
``single_thread()`` / ``threads(n)``
    Context managers running torch with 1 / ``n`` intra-op threads (small ops are several times
    faster single-threaded on a loaded 2-core box); the generators above use it internally.
"""
from __future__ import annotations

import contextlib
import functools

import torch

MICROTASKS = 8


@contextlib.contextmanager
def threads(n: int):
    """Run the block with ``n`` torch intra-op threads, restoring the previous count."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def single_thread():
    return threads(1)


def _single_threaded(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with single_thread():
            return fn(*args, **kwargs)

    return wrapper


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _randint(lo: int, hi: int, g: torch.Generator) -> int:
    """Uniform int in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def _rand(g: torch.Generator) -> float:
    return float(torch.rand((), generator=g))


def lengths(B: int, S: int, K: int, g: torch.Generator, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
    lo = 1 if lo is None else lo
    hi = 2 * K if hi is None else hi
    return torch.randint(lo, hi + 1, (B,), generator=g, dtype=torch.int32)


def _sample_new(n: int, upper: int, exclude: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``n`` distinct ids from ``[0, upper]`` not in ``exclude`` (fewer if not enough exist)."""
    if n <= 0 or upper < 0:
        return torch.empty(0, dtype=torch.int64)
    perm = torch.randperm(upper + 1, generator=g)
    if exclude.numel():
        taken = torch.zeros(upper + 1, dtype=torch.bool)
        taken[exclude] = True
        perm = perm[~taken[perm]]
    return perm[:n]


@_single_threaded
def topk(
    L: torch.Tensor,
    S: int,
    K: int,
    g: torch.Generator,
    prev: torch.Tensor | None = None,
    reuse: float = 0.8,
    fill: float = 1.0,
    hole: float = 0.0,
    future: float = 0.0,
    beyond: int = 0,
    dup: float = 0.0,
) -> torch.Tensor:
    B = L.numel()
    P = K // MICROTASKS
    out = torch.full((B, S, 1, K), -1, dtype=torch.int32)
    for b in range(B):
        hot = prev[b].reshape(-1).to(torch.int64) if prev is not None else torch.empty(0, dtype=torch.int64)
        for s in range(S):
            ms = int(L[b]) - (S - 1 - s) - 1
            c = min(K, ms + 1) if ms >= 0 else 0
            if fill < 1.0:
                c = int(c * fill)
            row = torch.empty(0, dtype=torch.int64)
            if c > 0:
                cand = hot
                if s > 0:
                    cand = torch.cat([cand, out[b, 0, 0].to(torch.int64)])
                cand = torch.unique(cand[(cand >= 0) & (cand <= ms)])
                n_re = min(int(round(reuse * c)), cand.numel())
                reused = cand[torch.randperm(cand.numel(), generator=g)[:n_re]]
                fresh = _sample_new(c - n_re, ms, reused, g)
                row = torch.cat([reused, fresh])
                row = row[torch.randperm(row.numel(), generator=g)]
            n = row.numel()
            if n >= 2 and _rand(g) < dup:
                row[_randint(1, n - 1, g)] = row[_randint(0, n - 1, g)]
            if n >= 1 and _rand(g) < future:
                row[_randint(0, n - 1, g)] = ms + 1 + _randint(0, 50, g)
            if beyond and n >= 1:
                for _ in range(_randint(0, 3, g)):
                    row[_randint(0, n - 1, g)] = beyond + _randint(0, 100, g)
            if n >= 2 and _rand(g) < hole:
                if _rand(g) < 0.5 and n > P:
                    pos = (_randint(1, (n - 1) // P, g) * P) - 1  # last column of a microtask
                else:
                    pos = _randint(0, n - 2, g)
                row[pos] = -_randint(1, 3, g)
            out[b, s, 0, :n] = row.to(torch.int32)
    return out


@_single_threaded
def pool_state(
    B: int,
    PS: int,
    IR: int,
    g: torch.Generator,
    fill: float = 0.5,
    max_id: int | None = None,
    prefer: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    NS = PS // 16
    top = min(IR, max_id if max_id is not None else IR)
    pool_ids = torch.full((B, PS), -1, dtype=torch.int32)
    id_to_slot = torch.full((B, IR), -1, dtype=torch.int32)
    for b in range(B):
        want = int(fill * PS)
        ids = torch.randperm(top, generator=g)[: 2 * want]
        if prefer is not None:
            pref = prefer[b].reshape(-1).to(torch.int64)
            pref = pref[(pref >= 0) & (pref < top)]
            pref = pref[torch.randperm(pref.numel(), generator=g)]
            ids = torch.cat([pref, ids])
            ids = ids[first_occurrence(ids)]
        st = ids & (NS - 1)
        order = torch.sort(st, stable=True).indices  # within a set, earlier (preferred) ids first
        ids, st = ids[order], st[order]
        first = torch.searchsorted(st, st, right=False)
        way = torch.arange(ids.numel()) - first
        keep = way < 16
        ids, st, way, order = ids[keep], st[keep], way[keep], order[keep]
        pick = torch.sort(order).indices[:want]  # the `want` earliest ids that found a way
        ids, slot = ids[pick], st[pick] * 16 + way[pick]
        pool_ids[b, slot] = ids.to(torch.int32)
        id_to_slot[b, ids] = slot.to(torch.int32)
    lru = torch.randint(0, 16, (B, NS), generator=g, dtype=torch.int32)
    return pool_ids, id_to_slot, lru


def first_occurrence(x: torch.Tensor) -> torch.Tensor:
    """Indices of the first occurrence of each value of ``x``, in order of appearance."""
    uniq, inv = torch.unique(x, return_inverse=True)
    first = torch.full((uniq.numel(),), x.numel(), dtype=torch.int64)
    first = first.scatter_reduce(0, inv, torch.arange(x.numel()), reduce="amin")
    return torch.sort(first).values


@_single_threaded
def garbage_state(B: int, PS: int, IR: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pool_ids = torch.randint(-3, IR + 3, (B, PS), generator=g, dtype=torch.int32)
    id_to_slot = torch.randint(-3, PS + 3, (B, IR), generator=g, dtype=torch.int32)
    lru = torch.randint(-40, 40, (B, PS // 16), generator=g, dtype=torch.int32)
    return pool_ids, id_to_slot, lru


@_single_threaded
def payload(shape, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = torch.rand(shape, generator=g, dtype=torch.float32) * 2 - 1
    return (x + torch.sign(x) * 0.01).to(dtype)

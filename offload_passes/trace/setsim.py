"""Set-associative policies and the per-set MIN bound, vectorised over sets in NumPy.

An implementation independent of ``csrc/trace_sim.cpp``: same step semantics as ``offload-sim`` (hits
decided on the pool at step start over the distinct eligible ids of all query rows; misses installed in
first-occurrence order; ``set = id & (sets - 1)``), written as whole-array operations over the sets, one
"install round" at a time (round ``r`` installs every set's ``r``-th miss of the step).

* :func:`per_set_min`: Belady's MIN run independently in each 16-way set. ``bypass=True``: after each
  step keep, per set, the ``ways`` candidates (residents + this step's misses) used soonest — optimal
  for the distinct-id hit count of that geometry, hence an upper bound of every policy that places an id
  only in its own set; the independent re-computation of ``offload-sim``'s ``min_per_set`` (C++), both
  checked against an exhaustive search on tiny geometries (``tests/trace/test_exact_min.py``).
  ``bypass=False``: every miss is installed in record order (as ``dsa_install`` always does), the victim
  being the way used farthest in the future, ties broken arbitrarily; like the kernels' FIFO, a later
  install of the same step may overwrite an earlier one. This greedy is a *feasible always-install
  schedule, not a bound*: a tie broken the wrong way can force a useless id in later (one set of 2
  ways, steps ``[0], [2], [1], [0, 2], [2, 1]``: greedy 2 hits, best always-install schedule 3).
  With ``sets = 1`` the bypass variant is the fully associative MIN (``offload-sim``'s ``belady``).
* :func:`simulate_sa`: ``sa_fifo`` (the kernels' round-robin pointer — the independent re-computation of
  ``offload-sim``'s), ``sa_clock`` with either insert convention (reference bit 0 or 1 at install), and
  the score-informed ``sa_rank`` (per-way stamp of the id's latest appearance in the indexer's top-P).
  Every metadata write is counted: reference-bit sets on hits, bit clears during the victim sweep,
  stamps written for ranks beyond K.

Prefetching policies (``rank_prefetch``) are outside both MIN bounds for the *hit rate* (a prefetched id
hits without having been demanded). They are not outside them for *host traffic*: demand fetching is
optimal for the number of rows loaded (any prefetch schedule can be postponed to the demand without more
loads), so a prefetching policy's host rows (misses + prefetches) are bounded below by MIN's misses of
the same geometry — :func:`host_rows_bound_holds` checks that.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Iterator, Optional

import numpy as np

from .format import Trace

log = logging.getLogger("offload_passes.trace.setsim")

_NEVER = np.int64(1) << 60   # next use of an id that never recurs
_EMPTY = np.int64(1) << 61   # key of an empty way: evicted before anything real
SA_POLICIES = ("sa_fifo", "sa_clock", "sa_rank")


@dataclass
class SetSimResult:
    policy: str
    pool_size: int
    ways: int
    hits: int
    misses: int
    hit_writes: int          # metadata writes caused by hits (bit sets, stamps of hit ids)
    clear_writes: int        # reference-bit clears during victim sweeps
    rank_writes: int         # stamps written for resident ids seen only in ranks K..P-1
    probes: int              # ways examined by victim searches
    max_probes: int          # most ways one victim search examined
    installs: int
    steps: int               # measured (group, row, step) triples

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0

    def per_step(self, what: str) -> float:
        return getattr(self, what) / max(self.steps, 1)

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


def _geometry(pool_size: int, ways: int) -> int:
    if ways < 1 or pool_size < ways or pool_size % ways:
        raise ValueError(f"pool_size must be a positive multiple of ways={ways}, got {pool_size}")
    ns = pool_size // ways
    if ns & (ns - 1):
        raise ValueError(f"pool_size / ways must be a power of two, got {ns}")
    return ns


def demand(trace: Trace, group: int, b: int, extra: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Per step: (distinct eligible ids of the K columns in first-occurrence order (s, k), distinct eligible
    ids of ranks K..P-1 not among them, in score order — empty unless ``extra``), as ``offload-sim``'s core."""
    S, K = trace.S, trace.K
    for t in range(trace.steps):
        L = int(trace.lengths[t, b])
        mv = max(L - S - 1, 0)
        parts, xparts = [], []
        for s in range(S):
            ms = L - (S - 1 - s) - 1
            if L <= 0 or ms < 0:
                continue
            row = trace.topk[t, group, b, s]
            neg = np.flatnonzero(row[:K] < 0)
            r = row[: neg[0]] if neg.size else row[:K]
            parts.append(r[r <= min(mv, ms)])
            if extra and trace.P > K:
                rest = row[K:]
                neg = np.flatnonzero(rest < 0)
                rest = rest[: neg[0]] if neg.size else rest
                xparts.append(rest[rest <= mv])
        ids = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        _, first = np.unique(ids, return_index=True)
        u = ids[np.sort(first)]
        if extra and xparts:
            x = np.concatenate(xparts).astype(np.int64)
            _, first = np.unique(x, return_index=True)
            x = x[np.sort(first)]
            x = x[~np.isin(x, u)]
        else:
            x = np.zeros(0, np.int64)
        yield u, x


def _next_use(U: list) -> list:
    """Per step, for each id of ``U[t]``: the next step it is demanded again (``_NEVER`` if none)."""
    if not U:
        return []
    lens = np.array([len(u) for u in U])
    ids = np.concatenate(U) if lens.sum() else np.zeros(0, np.int64)
    steps = np.repeat(np.arange(len(U), dtype=np.int64), lens)
    order = np.lexsort((steps, ids))
    si, st = ids[order], steps[order]
    nxt = np.full(si.size, _NEVER, dtype=np.int64)
    same = si[1:] == si[:-1]
    nxt[:-1][same] = st[1:][same]
    nu = np.empty_like(nxt)
    nu[order] = nxt
    return np.split(nu, np.cumsum(lens)[:-1])


def _rounds(m: np.ndarray, ns: int):
    """Group this step's misses ``m`` by set: (misses sorted by set, their sets, rank within the set)."""
    sets = m & (ns - 1)
    order = np.argsort(sets, kind="stable")
    ms, ss = m[order], sets[order]
    counts = np.bincount(ss, minlength=ns)
    starts = np.cumsum(counts) - counts
    rank = np.arange(ms.size) - starts[ss]
    return ms, ss, rank, order


def per_set_min(trace: Trace, pool_size: int, ways: int = 16, bypass: bool = True, warmup: int = 0) -> SetSimResult:
    """Belady's MIN per set (module docstring); ``ways = pool_size`` gives the fully associative MIN."""
    ns = _geometry(pool_size, ways)
    if not 0 <= warmup < trace.steps:
        raise ValueError(f"warmup must be in [0, steps={trace.steps}), got {warmup}")
    W, IR = ways, trace.id_range
    hits = misses = installs = 0
    for g in range(len(trace.groups)):
        for b in range(trace.B):
            U = [u for u, _ in demand(trace, g, b)]
            NU = _next_use(U)
            keys = np.full((ns, W), _EMPTY, dtype=np.int64)
            ids = np.full((ns, W), -1, dtype=np.int64)
            pos = np.full(IR, -1, dtype=np.int64)
            for t, (u, nu) in enumerate(zip(U, NU)):
                p = pos[u]
                hit = p >= 0
                if t >= warmup:
                    nh = int(hit.sum())
                    hits += nh
                    misses += u.size - nh
                keys.flat[p[hit]] = nu[hit]
                miss = ~hit
                if not miss.any():
                    continue
                m, mn = u[miss], nu[miss]
                ms, ss, rank, order = _rounds(m, ns)
                mns = mn[order]
                active, inv = np.unique(ss, return_inverse=True)
                width = W + int(rank.max()) + 1
                ck = np.full((active.size, width), _EMPTY, dtype=np.int64)
                ci = np.full((active.size, width), -1, dtype=np.int64)
                ck[:, :W], ci[:, :W] = keys[active], ids[active]
                ck[inv, W + rank], ci[inv, W + rank] = mns, ms
                if not bypass:
                    # the set's last miss is installed last, so it survives the step: force it (key -1)
                    last = np.zeros(active.size, dtype=np.int64)
                    np.maximum.at(last, inv, W + rank)
                    real = ck[np.arange(active.size), last].copy()
                    ck[np.arange(active.size), last] = -1
                sel = np.argpartition(ck, W - 1, axis=1)[:, :W]
                nk = np.take_along_axis(ck, sel, 1)
                ni = np.take_along_axis(ci, sel, 1)
                if not bypass:
                    forced = nk == -1
                    nk[forced] = np.repeat(real, forced.sum(1))
                old = ids[active]
                pos[old[old >= 0]] = -1
                flat = active[:, None] * W + np.arange(W)
                valid = ni >= 0
                pos[ni[valid]] = flat[valid]
                installs += int(np.isin(ni[valid], ms).sum()) if t >= warmup else 0
                keys[active], ids[active] = nk, ni
    steps = (trace.steps - warmup) * len(trace.groups) * trace.B
    return SetSimResult("min_per_set" + ("" if bypass else "_nobypass"), pool_size, ways, hits, misses,
                        0, 0, 0, 0, 0, installs, steps)


def simulate_sa(trace: Trace, policy: str, pool_size: int, ways: int = 16, warmup: int = 0,
                insert_bit: int = 0, rank_columns: Optional[int] = None) -> SetSimResult:
    """One set-associative policy (module docstring). ``insert_bit``: sa_clock's reference bit at install
    (0 = the kernel ``dsa_install_sc`` / ``offload-sim``'s ``sa_clock``; 1 = "referenced on arrival").
    ``rank_columns``: ranks ``0..rank_columns-1`` refresh a resident id's metadata (sa_rank, and sa_clock
    when given; default K, i.e. hits only) — the indexer would have to export them."""
    if policy not in SA_POLICIES:
        raise ValueError(f"policy must be one of {', '.join(SA_POLICIES)}, got {policy!r}")
    if insert_bit not in (0, 1):
        raise ValueError(f"insert_bit must be 0 or 1, got {insert_bit}")
    if rank_columns is not None and not trace.K <= rank_columns <= trace.P:
        raise ValueError(f"rank_columns must be in [K={trace.K}, P={trace.P}], got {rank_columns}")
    if not 0 <= warmup < trace.steps:
        raise ValueError(f"warmup must be in [0, steps={trace.steps}), got {warmup}")
    ns = _geometry(pool_size, ways)
    W, IR = ways, trace.id_range
    tr = trace if rank_columns is None or rank_columns == trace.P else \
        Trace(trace.topk[..., :rank_columns], trace.lengths, trace.K, trace.groups)
    use_extra = rank_columns is not None and rank_columns > trace.K
    c = dict(hits=0, misses=0, hit_writes=0, clear_writes=0, rank_writes=0, probes=0, max_probes=0, installs=0)
    for g in range(len(tr.groups)):
        for b in range(tr.B):
            ids = np.full((ns, W), -1, dtype=np.int64)
            meta = np.zeros((ns, W), dtype=np.int64)   # sa_clock: reference bit; sa_rank: stamp (step + 1)
            ctr = np.zeros(ns, dtype=np.int64)
            pos = np.full(IR, -1, dtype=np.int64)
            for t, (u, x) in enumerate(demand(tr, g, b, extra=use_extra)):
                on = t >= warmup
                p = pos[u]
                hit = p >= 0
                hp = p[hit]
                if policy == "sa_clock":
                    hw = int((meta.flat[hp] == 0).sum())
                    meta.flat[hp] = 1
                elif policy == "sa_rank":
                    hw = hp.size
                    meta.flat[hp] = t + 1
                else:
                    hw = 0
                rw = 0
                if use_extra and policy != "sa_fifo":
                    xp = pos[x]
                    xp = xp[xp >= 0]
                    if policy == "sa_clock":
                        rw = int((meta.flat[xp] == 0).sum())
                        meta.flat[xp] = 1
                    else:
                        rw = xp.size
                        meta.flat[xp] = t + 1
                m = u[~hit]
                cl = pr = mp = 0
                if m.size:
                    ms, ss, rank, _ = _rounds(m, ns)
                    for r in range(int(rank.max()) + 1):
                        sel = rank == r
                        xs, st = ms[sel], ss[sel]
                        if policy == "sa_fifo":
                            way = ctr[st]
                            ctr[st] = (way + 1) % W
                            n_pr = np.ones(st.size, dtype=np.int64)
                        elif policy == "sa_clock":
                            order = (ctr[st, None] + np.arange(W)) % W
                            rid = np.take_along_axis(ids[st], order, 1)
                            rb = np.take_along_axis(meta[st], order, 1)
                            cand = (rid < 0) | (rb == 0)
                            anyc = cand.any(1)
                            f = np.where(anyc, cand.argmax(1), 0)
                            # ways swept before the victim lose their bit (all W when none was free)
                            nclear = np.where(anyc, f, W)
                            clr = np.arange(W)[None, :] < nclear[:, None]
                            rows = np.repeat(st, W).reshape(-1, W)
                            meta[rows[clr], order[clr]] = 0
                            cl += int(nclear.sum())
                            way = order[np.arange(st.size), f]
                            ctr[st] = (way + 1) % W
                            n_pr = np.where(anyc, f + 1, W + 1)
                        else:  # sa_rank: the way whose id was seen longest ago (empty ways: stamp 0)
                            stamps = np.where(ids[st] < 0, -1, meta[st])
                            way = stamps.argmin(1)
                            n_pr = np.full(st.size, W, dtype=np.int64)
                        old = ids[st, way]
                        pos[old[old >= 0]] = -1
                        ids[st, way] = xs
                        pos[xs] = st * W + way
                        meta[st, way] = insert_bit if policy == "sa_clock" else t + 1
                        pr += int(n_pr.sum())
                        mp = max(mp, int(n_pr.max()))
                if on:
                    nh = int(hit.sum())
                    c["hits"] += nh
                    c["misses"] += u.size - nh
                    c["hit_writes"] += hw
                    c["rank_writes"] += rw
                    c["clear_writes"] += cl
                    c["probes"] += pr
                    c["max_probes"] = max(c["max_probes"], mp)
                    c["installs"] += int(m.size)
    steps = (tr.steps - warmup) * len(tr.groups) * tr.B
    name = policy + (f"_ins{insert_bit}" if policy == "sa_clock" else "") + \
        (f"_P{rank_columns}" if use_extra else "")
    return SetSimResult(name, pool_size, ways, steps=steps, **c)


def host_rows_bound_holds(trace: Trace, pool_size: int, warmup: int = 0) -> tuple[int, int]:
    """(``rank_prefetch``'s host rows = distinct misses + prefetches, fully associative MIN's misses) on
    the K columns; demand-fetch optimality says the first is never smaller."""
    from . import sim

    r = sim.simulate(trace, "rank_prefetch", pool_size, warmup=warmup)
    lo = per_set_min(trace, pool_size, ways=pool_size, bypass=True, warmup=warmup)
    rows = int(round((1 - r.hit_rate) * (lo.hits + lo.misses))) + r.prefetch
    return rows, lo.misses

"""Replay a top-k trace through replacement policies (``offload-sim``).

Every policy sees what ``dsa_plan`` sees: per batch row and step, the eligible ids (``id <= max_valid``)
of all S query rows; hits are decided on the pool at step start, then hits update the policy's
metadata and the misses are installed in record order with per-row dedupe (as ``dsa_install``). Each
batch row and each group has its own pool of ``pool_size`` slots.

Metrics (``SimResult``):

* ``hit_rate``: distinct ids per (group, row, step) found in the pool / distinct eligible ids. This is
  the quantity Belady's MIN maximises, hence the bound ``belady >= every policy``.
* ``entry_hit_rate``: per top-k entry, the plan's ``POOL_HIT / (POOL_HIT + FULL_OLD_MISS)`` (what
  ``OffloadState`` counts; differs from ``hit_rate`` only when S > 1 repeats ids across query rows).
* ``host_rows_per_step``: rows one layer reads from host per group step and batch row (misses + decode
  window + prefetches); ``host_rows_total`` multiplies by the layers of each group (= ``OffloadState``'s
  ``host_rows_read``).
* ``writes_per_step`` / ``scans_per_step``: metadata work per group step and batch row — writes caused by
  hits (LRU reordering, reference bits, RRPV resets, frequency counters) and slots/queue entries examined
  to pick victims (1 for FIFO's pointer); ``clears_per_step``: the reference bits second chance
  (``sa_clock``, ``clock``) clears while sweeping for a victim — metadata writes too, not in
  ``writes_per_step``. Insert convention of both: a newly installed id starts with its bit clear
  (``offload_passes.trace.setsim`` simulates the other convention).

Policies: ``adjacent`` (the basic gather's K-entry selection buffer per query row: reuse = id selected by
the same row at the previous step; pool size ignored), ``lru`` (fully associative), ``sa_fifo`` (the
reference: 16-way, round-robin pointer; bit-exact with our kernels), ``sa_lru``, ``sa_clock`` (16-way
second-chance FIFO, one bit per way), ``clock``, ``srrip`` / ``brrip`` (16-way, 2-bit RRPV), ``s3fifo``,
``rank_keep`` / ``rank_prefetch`` (score-informed, need ranks beyond K: see csrc). The policy study's
set-associative candidates (:data:`STUDY`): ``gclock`` (2-bit counters, sweeping hand), ``srrip_1p`` (SRRIP
with a single pass per victim search: srrip's decisions), ``drrip`` (set dueling SRRIP / BRRIP), ``srrip_rank``
(insertion RRPV from the entry's column, i.e. its rank when the top-k is in score order), ``sa_s3fifo``
(S3-FIFO inside each set, 8-bit ghost tags), ``sa_lrfu`` (LRFU per set, set dueling over two decay rates).

Bounds (offline, demand fetch with bypass; :data:`BOUNDS` says what each bounds):

* ``min_per_set``: Belady's MIN run independently in each ``ways``-way set (``set = id & (sets - 1)``) —
  the optimum of the pool's geometry, hence an upper bound of every demand policy of that geometry
  (``sa_*``, ``srrip``, ``brrip`` and anything the kernels could run), not of fully associative ones.
* ``belady``: the fully associative MIN with the same number of slots — an upper bound of every demand
  policy with that many slots, whatever its placement (``min_per_set`` included).
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from .format import Trace

log = logging.getLogger("offload_passes.trace.sim")

WAYS = 16
ONLINE = ("adjacent", "lru", "sa_lru", "sa_fifo", "sa_clock", "clock", "srrip", "brrip", "s3fifo")
#: set-associative candidates of the policy study (docs/trace-science.md §3; csrc/trace_sim.cpp)
STUDY = ("gclock", "srrip_1p", "drrip", "srrip_rank", "sa_s3fifo", "sa_lrfu")
RANKED = ("rank_keep", "rank_prefetch")
#: what each offline bound bounds (printed beside it by ``offload-sim``)
BOUNDS = {
    "min_per_set": "per-set optimum (MIN with bypass in each {ways}-way set): bounds the hit % of every "
                   "demand policy of this set-associative geometry",
    "belady": "fully associative optimum (MIN with bypass): bounds the hit % of every demand policy with "
              "this many slots, any placement",
}
POLICIES = ONLINE + STUDY + RANKED + tuple(BOUNDS)
SET_ASSOC = ("sa_lru", "sa_fifo", "sa_clock", "srrip", "brrip") + STUDY + ("min_per_set",)
# per-step counter columns of the C++ core
HIT_E, MISS_E, WIN_E, UHIT, UMISS, WRITES, SCANS, PREFETCH = range(8)


@dataclass
class SimResult:
    policy: str
    pool_size: int
    hit_rate: float
    entry_hit_rate: float
    hits: int
    misses: int
    window: int
    prefetch: int
    host_rows_per_step: float
    host_rows_total: int
    writes_per_step: float
    scans_per_step: float
    lookups: int
    seconds: float
    clears_per_step: float = 0.0   # second chance: reference bits cleared by victim sweeps (also writes)
    bounds: str = ""               # what an offline bound bounds (BOUNDS); "" for a feasible on-line policy
    distinct_misses: int = 0       # distinct ids missed (installs of an on-line policy), summed over steps

    def as_dict(self) -> dict:
        return asdict(self)


def check_pool_size(policy: str, pool_size: int, ways: int = WAYS) -> None:
    if pool_size <= 0:
        raise ValueError(f"pool_size must be > 0, got {pool_size}")
    if ways < 1:
        raise ValueError(f"ways must be >= 1, got {ways}")
    if policy in SET_ASSOC:
        ns = pool_size // ways
        if pool_size % ways or ns & (ns - 1):
            raise ValueError(f"pool_size for {policy} must be {ways} x a power of two, got {pool_size}")


def per_step(trace: Trace, policy: str, pool_size: int, group: int = 0, ways: int = WAYS,
             id_range: Optional[int] = None) -> np.ndarray:
    """Counters ``int64 [steps, 8]`` of one group (columns: HIT_E, MISS_E, WIN_E, UHIT, UMISS, WRITES,
    SCANS, PREFETCH), summed over batch rows."""
    from ._native import module

    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    check_pool_size(policy, pool_size, ways)
    if not 0 <= group < len(trace.groups):
        raise ValueError(f"group must be in [0, {len(trace.groups)}), got {group}")
    topk = torch.from_numpy(np.ascontiguousarray(trace.topk[:, group]))
    lengths = torch.from_numpy(trace.lengths)
    ir = trace.id_range if id_range is None else id_range
    return module().simulate(topk, lengths, trace.K, policy, pool_size, ways, ir).numpy()


def simulate(trace: Trace, policy: str, pool_size: int, ways: int = WAYS,
             id_range: Optional[int] = None, warmup: int = 0) -> SimResult:
    """Replay every group of ``trace`` through ``policy`` with ``pool_size`` slots per batch row.

    ``warmup`` first steps are replayed but left out of every figure (cold pool)."""
    if not 0 <= warmup < trace.steps:
        raise ValueError(f"warmup must be in [0, steps={trace.steps}), got {warmup}")
    t0 = time.perf_counter()
    tot = np.zeros(8, dtype=np.int64)
    host_total = 0
    for g, layers in enumerate(trace.groups):
        c = per_step(trace, policy, pool_size, g, ways, id_range)[warmup:].sum(0)
        tot += c
        host_total += int(c[MISS_E] + c[WIN_E] + c[PREFETCH]) * len(layers)
    dt = time.perf_counter() - t0
    denom = max((trace.steps - warmup) * len(trace.groups) * trace.B, 1)
    uh, um = int(tot[UHIT]), int(tot[UMISS])
    he, me = int(tot[HIT_E]), int(tot[MISS_E])
    return SimResult(
        policy=policy, pool_size=pool_size,
        hit_rate=uh / (uh + um) if uh + um else 0.0,
        entry_hit_rate=he / (he + me) if he + me else 0.0,
        hits=he, misses=me, window=int(tot[WIN_E]), prefetch=int(tot[PREFETCH]),
        host_rows_per_step=float(tot[MISS_E] + tot[WIN_E] + tot[PREFETCH]) / denom,
        host_rows_total=host_total,
        writes_per_step=float(tot[WRITES]) / denom, scans_per_step=float(tot[SCANS]) / denom,
        lookups=int(tot[HIT_E] + tot[MISS_E] + tot[WIN_E]), seconds=dt,
        # each sweep probe clears a bit or takes the way: clears = probes - installs (one per distinct
        # miss; exact with the default id range, where every eligible id can be installed)
        clears_per_step=float(tot[SCANS] - tot[UMISS]) / denom if policy in ("sa_clock", "clock") else 0.0,
        bounds=bound_label(policy, ways), distinct_misses=um,
    )


def bound_label(policy: str, ways: int = WAYS) -> str:
    """What ``policy`` bounds (:data:`BOUNDS`), or ``""`` for an on-line policy (a feasible schedule)."""
    return BOUNDS[policy].format(ways=ways) if policy in BOUNDS else ""


def sweep(trace: Trace, policies: Sequence[str], pool_sizes: Iterable[int], ways: int = WAYS,
          warmup: int = 0, bounds: bool = False, skipped: Optional[list] = None) -> list[SimResult]:
    """Every policy at every pool size (pool-size major). ``bounds``: also both :data:`BOUNDS` at every
    pool size; ``min_per_set`` is left out where the pool is not ``ways`` x a power of two (no such
    geometry), and ``(policy, pool_size, reason)`` is appended to ``skipped``."""
    out: list[SimResult] = []
    extra = [b for b in BOUNDS if b not in policies] if bounds else []
    for ps in pool_sizes:
        for p in list(policies) + extra:
            if p == "adjacent" and out and any(r.policy == "adjacent" for r in out):
                # pool size does not apply: one row, reported once
                continue
            if p in extra:
                try:
                    check_pool_size(p, ps, ways)
                except ValueError as e:
                    if skipped is not None:
                        skipped.append((p, ps, str(e)))
                    continue
            out.append(simulate(trace, p, ps, ways, warmup=warmup))
    return out


def default_policies(trace: Trace) -> list[str]:
    """All policies and both bounds; the score-informed ones only when the trace stores ranks beyond K."""
    return [p for p in POLICIES if p not in RANKED or (trace.P > trace.K and trace.ranked)]


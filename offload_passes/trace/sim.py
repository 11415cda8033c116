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
``rank_keep`` / ``rank_prefetch`` (score-informed, need ranks beyond K: see csrc) and ``belady`` (offline
optimum with bypass).
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
RANKED = ("rank_keep", "rank_prefetch")
POLICIES = ONLINE + RANKED + ("belady",)
SET_ASSOC = ("sa_lru", "sa_fifo", "sa_clock", "srrip", "brrip")
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
    )


def sweep(trace: Trace, policies: Sequence[str], pool_sizes: Iterable[int], ways: int = WAYS,
          warmup: int = 0) -> list[SimResult]:
    out: list[SimResult] = []
    for ps in pool_sizes:
        for p in policies:
            if p == "adjacent" and out and any(r.policy == "adjacent" for r in out):
                # pool size does not apply: one row, reported once
                continue
            out.append(simulate(trace, p, ps, ways, warmup=warmup))
    return out


def default_policies(trace: Trace) -> list[str]:
    """All policies; the score-informed ones only when the trace stores ranks beyond K."""
    return [p for p in POLICIES if p not in RANKED or (trace.P > trace.K and trace.ranked)]

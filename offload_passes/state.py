"""``OffloadState``: the pools and per-group metadata a rewritten graph owns.

Per layer ``l``: ``pool_kv [B, PS, Dkv]``, ``pool_rope [B, PS, Dr]`` (KV dtype). Per group ``g``:
``pool_ids [B, PS]`` (-1), ``id_to_slot [B, IR]`` (-1), ``lru_counter [B, PS/16]`` (0) int32, and
``stats [2, 7]`` int64 written *in the graph* every step: row 0 = this step's plan-kind counts
(kinds 0..5, then 1 for the step), row 1 = the running sum. hits = kind 1, misses = kind 2,
window = kind 3; host rows read = (misses + window) × layers of the group (every layer serves the
same plan from its own host cache).

The tensors are registered as buffers of the rewritten GraphModule and are the very objects AOT
lifts as inputs, so every method here works in place (never reallocates).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch

log = logging.getLogger("offload_passes.state")

KIND_HIT, KIND_MISS, KIND_WINDOW = 1, 2, 3
STATS_WIDTH = 7  # kinds 0..5 + step count


@dataclass
class GroupState:
    group_id: int
    owner_layer: int
    layers: list[int]
    pool_ids: torch.Tensor
    id_to_slot: torch.Tensor
    lru_counter: torch.Tensor
    stats: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        g = self.group_id
        return {f"pool_ids_g{g}": self.pool_ids, f"id_to_slot_g{g}": self.id_to_slot,
                f"lru_counter_g{g}": self.lru_counter, f"stats_g{g}": self.stats}


@dataclass
class OffloadState:
    """State owned by one compiled graph (``graph_id``)."""

    graph_id: str
    B: int
    pool_size: int
    id_range: int
    groups: list[GroupState] = field(default_factory=list)
    pools: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # layer -> (kv, rope)
    resets: int = 0

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def allocate(cls, graph_id: str, plans: Sequence, device: torch.device | None = None) -> "OffloadState":
        """Allocate pools and metadata for the ``GroupPlan``\\ s of one graph."""
        device = device or torch.device("cpu")
        p0 = plans[0]
        st = cls(graph_id, p0.B, p0.pool_size, p0.id_range)
        for p in plans:
            B, PS, IR = p.B, p.pool_size, p.id_range
            st.groups.append(GroupState(
                p.group_id, p.owner_layer, list(p.layers),
                torch.full((B, PS), -1, dtype=torch.int32, device=device),
                torch.full((B, IR), -1, dtype=torch.int32, device=device),
                torch.zeros((B, PS // 16), dtype=torch.int32, device=device),
                torch.zeros((2, STATS_WIDTH), dtype=torch.int64, device=device)))
            for l in p.layers:
                geo = p.geometry[l]
                st.pools[l] = (torch.zeros((B, PS, geo.Dkv), dtype=geo.dtype, device=device),
                               torch.zeros((B, PS, geo.Dr), dtype=geo.dtype, device=device))
        return st

    # -- inspection -----------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for l in sorted(self.pools):
            out[f"pool_kv_l{l}"], out[f"pool_rope_l{l}"] = self.pools[l]
        for g in self.groups:
            out.update(g.tensors())
        return out

    def bytes(self) -> dict[str, int]:
        """Bytes allocated per state tensor."""
        return {k: t.numel() * t.element_size() for k, t in self.tensors().items()}

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes().values())

    def describe(self) -> list[dict]:
        """Report rows ``{name, shape, dtype, bytes, kind, layer|group_id}`` (docs/ARCHITECTURE.md §5)."""
        rows = []
        for l in sorted(self.pools):
            for nm, t in zip(("pool_kv", "pool_rope"), self.pools[l]):
                rows.append({"name": f"{nm}_l{l}", "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                             "bytes": t.numel() * t.element_size(), "kind": "pool", "layer": l})
        for g in self.groups:
            for nm, t in g.tensors().items():
                rows.append({"name": nm, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                             "bytes": t.numel() * t.element_size(), "kind": "stats" if nm.startswith("stats") else "group",
                             "group_id": g.group_id})
        return rows

    def counters(self) -> list[dict]:
        """Per group: ``step`` (last decode step) and ``total`` hits / misses / window / host_rows_read."""
        out = []
        for g in self.groups:
            s = g.stats.tolist()
            entry = {"group_id": g.group_id, "layers": list(g.layers)}
            for key, row in (("step", s[0]), ("total", s[1])):
                hits, misses, window = row[KIND_HIT], row[KIND_MISS], row[KIND_WINDOW]
                entry[key] = {"hits": hits, "misses": misses, "window": window,
                              "host_rows_read": (misses + window) * len(g.layers), "steps": row[6]}
            out.append(entry)
        return out

    def totals(self, which: str = "total") -> dict[str, int]:
        """Sums over groups of ``counters()[*][which]``."""
        keys = ("hits", "misses", "window", "host_rows_read")
        agg = {k: 0 for k in keys}
        for c in self.counters():
            for k in keys:
                agg[k] += c[which][k]
        return agg

    # -- mutation (in place) ----------------------------------------------------------------
    @torch.no_grad()
    def reset(self, rows: Optional[Iterable[int]] = None, counters: Optional[bool] = None) -> None:
        """Forget cached rows: all of them, or only batch ``rows`` (rows that start a new request).

        A full reset also clears the counters (``counters`` overrides); a row reset keeps them.
        """
        if rows is None:
            for g in self.groups:
                g.pool_ids.fill_(-1)
                g.id_to_slot.fill_(-1)
                g.lru_counter.zero_()
            for kv, rope in self.pools.values():
                kv.zero_()
                rope.zero_()
            if counters is None or counters:
                self.reset_counters()
            self.resets += 1
            return
        idx = sorted({int(r) for r in rows})
        for r in idx:
            if not 0 <= r < self.B:
                raise RuntimeError(f"reset: rows must be in [0, B={self.B}), got {r}")
        if not idx:
            return
        t = torch.tensor(idx, dtype=torch.long)
        for g in self.groups:
            g.pool_ids[t] = -1
            g.id_to_slot[t] = -1
            g.lru_counter[t] = 0
        for kv, rope in self.pools.values():
            kv[t] = 0
            rope[t] = 0
        if counters:
            self.reset_counters()

    @torch.no_grad()
    def reset_counters(self) -> None:
        for g in self.groups:
            g.stats.zero_()

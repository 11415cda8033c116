"""The tensors of one IndexShare group on one set of full caches (:class:`GroupPools`), one graph's view
of them (:class:`GroupState`), and what a compiled graph needs to allocate them (:class:`GroupLayout`).
Tensor by tensor: the package docstring (``offload_passes/state/__init__.py``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..custom_ops.plan_kind import NUM_PLAN_KINDS

STATS_WIDTH = NUM_PLAN_KINDS + 1  # the plan kinds' counts + the step count


class GroupPools:
    """The tensors of one IndexShare group on one set of full caches (shared by every graph serving them)."""

    __slots__ = ("pool_ids", "id_to_slot", "lru_counter", "stats", "seen_len", "external_write", "pools", "ran",
                 "versions", "flagged", "seen_table", "announced", "announced_batch", "growable", "batches", "gen",
                 "__weakref__")

    def __init__(self, B: int, PS: int, IR: int, dims: Sequence[tuple[int, int, torch.dtype]],
                 device: torch.device, table_cols: int = 0) -> None:
        self.gen = 0  # bumped when grow() replaces the tensors (memoised views of them are then rebuilt)
        self.pool_ids = torch.full((B, PS), -1, dtype=torch.int32, device=device)
        self.id_to_slot = torch.full((B, IR), -1, dtype=torch.int32, device=device)
        self.lru_counter = torch.zeros((B, PS // 16), dtype=torch.int32, device=device)
        self.stats = torch.zeros((2, STATS_WIDTH), dtype=torch.int64, device=device)
        # the previous step's cache length per row: a row whose length goes down starts a new request
        self.seen_len = torch.zeros((B,), dtype=torch.int32, device=device)
        # != 0: the host saw the full caches written outside the graph since the last step (their version
        # counters moved): the graph invalidates every row
        self.external_write = torch.zeros((1,), dtype=torch.int32, device=device)
        self.pools = [(torch.zeros((B, PS, dkv), dtype=dt, device=device),
                       torch.zeros((B, PS, dr), dtype=dt, device=device)) for dkv, dr, dt in dims]
        # paged groups: each row's block table at the previous step; a row whose blocks of the prefix it
        # already served changed holds another request (docs/new-requests.md, "Paged KV")
        self.seen_table = (torch.full((B, table_cols), -1, dtype=torch.int32, device=device) if table_cols
                           else None)
        # begin_request / move_rows since the last step: the engine named every row it wrote outside the
        # graph, so an outside write seen by the version counters invalidates only those rows
        self.announced = False
        # the batch a move_rows since the last step named (len(src)); the next graph's batch is compared with
        # it (a mismatch is served exactly and logged: StateBinder.state_for)
        self.announced_batch: Optional[int] = None
        # shared state (StateRegistry.bind): graphs take the tensors per call, so an announcement for a larger
        # batch bucket may grow them; private state (a graph's buffers) never grows
        self.growable = False
        # the batch sizes of the graphs bound to these tensors (what an announcement's row count is checked
        # against, with the model's batch)
        self.batches: set[int] = {B}
        self.ran = False  # has served a step (a fresh group holds nothing that could be stale)
        self.versions: Optional[tuple] = None  # the full caches' version counters after the last step
        self.flagged = False  # external_write was set for the coming step

    @property
    def rows(self) -> int:
        """Batch rows held (the largest batch of a graph bound to it so far)."""
        return int(self.pool_ids.size(0))

    def per_row(self) -> list[torch.Tensor]:
        """Every tensor with one row per batch row (metadata, ``seen_table``, pools)."""
        ts = [self.pool_ids, self.id_to_slot, self.lru_counter, self.seen_len]
        ts += [self.seen_table] if self.seen_table is not None else []
        return ts + [t for pair in self.pools for t in pair]

    @torch.no_grad()
    def grow(self, B: int) -> None:
        """Hold ``B`` rows: new tensors, the existing rows copied, the new rows empty (a graph of a larger
        batch bucket joined). Only for per-call bindings (the CPU modes): a graph that holds the old
        tensors as buffers would keep them, so private states never grow."""
        n = self.rows
        if B <= n:
            return

        def bigger(t: torch.Tensor, fill: float) -> torch.Tensor:
            out = torch.full((B, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
            out[:n].copy_(t)
            return out

        self.pool_ids = bigger(self.pool_ids, -1)
        self.id_to_slot = bigger(self.id_to_slot, -1)
        self.lru_counter = bigger(self.lru_counter, 0)
        self.seen_len = bigger(self.seen_len, 0)
        if self.seen_table is not None:
            self.seen_table = bigger(self.seen_table, -1)
        self.pools = [(bigger(kv, 0), bigger(rope, 0)) for kv, rope in self.pools]
        self.gen += 1


class GroupState:
    """One group of one compiled graph (``group_id``/``layers`` numbered in that graph), over the
    :class:`GroupPools` tensors of the caches it runs on."""

    def __init__(self, group_id: int, owner_layer: int, layers: Sequence[int], shared: GroupPools,
                 B: Optional[int] = None, sources: Optional[Sequence[int]] = None) -> None:
        self.group_id = group_id
        self.owner_layer = owner_layer
        self.layers = list(layers)
        self.shared = shared
        # per layer, the index (in ``layers``) of the layer whose pool it reads: a layer that attends to
        # another layer's cache (cross-layer KV sharing) shares that layer's pool (GroupLayout.sources)
        self.sources = list(range(len(self.layers))) if sources is None else list(sources)
        self.B = shared.rows if B is None else B  # this graph's batch: rows 0 .. B-1 of the shared tensors

    def _rows(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return t if t is None or t.size(0) == self.B else t[: self.B]

    pool_ids = property(lambda self: self._rows(self.shared.pool_ids))
    id_to_slot = property(lambda self: self._rows(self.shared.id_to_slot))
    lru_counter = property(lambda self: self._rows(self.shared.lru_counter))
    stats = property(lambda self: self.shared.stats)
    seen_len = property(lambda self: self._rows(self.shared.seen_len))
    external_write = property(lambda self: self.shared.external_write)
    seen_table = property(lambda self: self._rows(self.shared.seen_table))

    def pools(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer of the group: (kv, rope) pools, this graph's rows (a sharing layer: its source's)."""
        own = [(self._rows(kv), self._rows(rope)) for kv, rope in self.shared.pools]
        return [own[i] for i in self.sources]

    def pool_layers(self) -> list[int]:
        """The layers that hold a pool of their own (the others read one of theirs)."""
        return [l for i, l in enumerate(self.layers) if self.sources[i] == i]

    def tensors(self) -> dict[str, torch.Tensor]:
        g = self.group_id
        out = {f"pool_ids_g{g}": self.pool_ids, f"id_to_slot_g{g}": self.id_to_slot,
               f"lru_counter_g{g}": self.lru_counter, f"stats_g{g}": self.stats, f"seen_len_g{g}": self.seen_len,
               f"external_write_g{g}": self.external_write}
        if self.seen_table is not None:
            out[f"seen_table_g{g}"] = self.seen_table
        return out


@dataclass
class GroupLayout:
    """What a compiled graph needs to allocate one group's state (no fx nodes, no tensors)."""

    group_id: int
    owner_layer: int
    layers: list[int]
    B: int
    pool_size: int
    id_range: int
    dims: list[tuple[int, int, torch.dtype]]  # per layer of the group: (Dkv, Dr, dtype); (0, 0) sharing
    table_cols: int = 0  # paged groups: block-table columns (seen_table); 0: identity layout
    # where the pools and metadata live: the selection buffers' device, not the full caches' (those may
    # be pinned host memory on CUDA, docs/cuda.md); None: the full caches' device
    device: Optional[str] = None
    # per layer, the index (in ``layers``) of the layer whose pool it reads (None: each its own). A layer
    # reading the same full caches as an earlier layer of the group (transformers' ``kv_source_layers``)
    # shares its pool: one pool row serves both, and its own ``dims`` entry is (0, 0) (nothing allocated)
    sources: Optional[list[int]] = None

    @classmethod
    def from_plan(cls, p, device: Optional[str] = None) -> "GroupLayout":
        geo = p.geometry[p.owner_layer]
        cols = geo.F // geo.FBS if getattr(p, "paged", False) and getattr(geo, "FBS", 0) else 0
        src = getattr(p, "pool_source", None) or {}
        sources = [p.layers.index(src.get(l, l)) for l in p.layers]
        dims = [(p.geometry[l].Dkv, p.geometry[l].Dr, p.geometry[l].dtype) if sources[i] == i
                else (0, 0, p.geometry[l].dtype) for i, l in enumerate(p.layers)]
        return cls(p.group_id, p.owner_layer, list(p.layers), p.B, p.pool_size, p.id_range, dims, cols, device,
                   sources if src else None)

    @property
    def signature(self) -> tuple:
        """The pool geometry: graphs whose groups have the same one on the same caches share their state
        (the batch size is not part of it: a smaller batch serves the first rows)."""
        return (self.pool_size, self.id_range, tuple(self.dims), self.table_cols,
                None if self.sources is None else tuple(self.sources))


@torch.no_grad()
def reset_shared(sg: GroupPools) -> None:
    """Every row of ``sg`` empty (nothing cached: ``versions`` None trusts every row)."""
    sg.versions = None  # nothing cached any more
    sg.pool_ids.fill_(-1)
    sg.id_to_slot.fill_(-1)
    sg.lru_counter.zero_()
    sg.seen_len.zero_()
    for kv, rope in sg.pools:
        kv.zero_()
        rope.zero_()

"""``OffloadState``: the pools and per-group metadata a rewritten graph uses on one set of full caches.

Per layer ``l``: ``pool_kv [B, PS, Dkv]``, ``pool_rope [B, PS, Dr]`` (KV dtype). Per group ``g``:
``pool_ids [B, PS]`` (-1), ``id_to_slot [B, IR]`` (-1), ``lru_counter [B, PS/16]`` (0) int32, and
``stats [2, 7]`` int64 written *in the graph* every step: row 0 = this step's plan-kind counts
(``custom_ops/plan_kind.py``, kinds 0..5, then 1 for the step), row 1 = the running sum. hits =
POOL_HIT, misses = FULL_OLD_MISS, window = DECODE_WINDOW; host rows read = (misses + window) × layers
of the group (every layer serves the same plan from its own host cache). ``seen_len [B]`` int32: each row's cache length at the previous
step; ``external_write [1]`` int32: set by the host when the full caches were written outside the graph
since the last step (version counters). Paged groups also keep ``seen_table [B, maxblk]`` int32, each
row's block table at the previous step. The graph uses them to invalidate new requests' rows; the host
side (``OffloadState.begin_request`` / ``move_rows``) is the engine's account of its batch
(docs/new-requests.md).

Ownership: the tensors belong to the full caches, not to a graph. In the CPU modes they are
extra inputs of the rewritten graph, chosen per call by :class:`StateBinder` from :data:`REGISTRY`,
keyed by the caches' storage (:func:`cache_key`: the tensor that owns the memory, the address, shape
and strides; a fresh view object of the same cache finds the same state). Every graph whose group
has the same pool geometry (pool size, id range, dims, paged or not) on the same caches shares one
:class:`GroupPools`, whatever its batch size: its tensors have one row per cache row (the largest
batch bound so far) and a graph of batch ``B`` serves rows ``0 .. B-1`` (views). In the NPU modes the
tensors are buffers of the graph (private) and the same stale-state rule applies. Every method here
works in place: a graph that holds the tensors keeps holding them (only a per-call binding grows a
shared group, see :meth:`GroupPools.grow`).
"""
from __future__ import annotations

import logging
import numbers
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch

from .custom_ops.plan_kind import NUM_PLAN_KINDS, PlanKind

log = logging.getLogger("offload_passes.state")

STATS_WIDTH = NUM_PLAN_KINDS + 1  # the plan kinds' counts + the step count

#: what an announcement takes as row indices (``row_indices``)
ROW_FORMS = "a list, tuple or range of ints, or a 1-D integer tensor or numpy array (any device)"


def row_indices(value: Any, where: str, arg: str, lo: int, hi: Optional[int], limit: str,
                sets: bool = True) -> list[int]:
    """``value`` as a list of ints, each in ``[lo, hi)`` (``hi`` None: no upper limit known yet).

    Accepted: a list, tuple or range of Python / numpy ints (and, with ``sets``, a set: order-free row
    lists), a 1-D integer tensor on any real device (strided layout), a 1-D integer numpy array. Refused
    with a ``TypeError`` naming ``where``, ``arg``, the accepted forms and the limit: a bool mask (a mask is
    not a row list), floats (a float is not an index, 2.0 and NaN included), strings, mappings, iterators
    and generators (they cannot be checked without being consumed), scalars, None, a meta or sparse
    tensor (no values to read). ``ValueError``: a tensor or array that is not 1-D, an entry outside
    ``[lo, hi)`` (the message carries ``limit``, what the bound is)."""
    forms = ROW_FORMS.replace("list, tuple or range of ints", "list, tuple, range or set of ints") if sets \
        else ROW_FORMS
    bound = f"[{lo}, {hi})" if hi is not None else f">= {lo}"

    def refuse(what: str) -> TypeError:
        return TypeError(f"{where}: {arg} must be {forms}, each in {bound} ({limit}); got {what}")

    if isinstance(value, torch.Tensor):
        items = _tensor_items(value, where, arg, refuse)
    elif type(value).__module__ == "numpy":
        items = _array_items(value, where, arg, refuse)
    elif isinstance(value, (list, tuple, range)) or (sets and isinstance(value, (set, frozenset))):
        items = _sequence_items(value, refuse)
    else:
        raise refuse(_describe(value))
    bad = [x for x in items if x < lo or (hi is not None and x >= hi)]
    if bad:
        raise ValueError(f"{where}: {arg} entries must be in {bound} ({limit}), got {bad}")
    return items


#: the tensor dtypes a row list may have (quantized and bit dtypes are not indices)
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

_MASK_HINT = "a mask is not a row list: pass its row indices, e.g. mask.nonzero().flatten()"


def _tensor_items(t: torch.Tensor, where: str, arg: str, refuse: Any) -> list[int]:
    """A tensor's entries, after checks that it has values (not meta, not sparse) of an integer dtype."""
    if t.layout != torch.strided:
        raise refuse(f"a {t.layout} Tensor (a row list is a dense tensor: pass t.to_dense())")
    if t.device.type == "meta":
        raise refuse("a meta Tensor (it holds no values)")
    if t.dtype == torch.bool:
        raise refuse(f"a bool mask Tensor of shape {list(t.shape)} ({_MASK_HINT})")
    if t.dtype not in _INT_DTYPES:
        raise refuse(f"a Tensor of dtype {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{where}: {arg} must be 1-D (one entry per row), got shape {list(t.shape)}")
    return [int(x) for x in t.tolist()]


def _array_items(a: Any, where: str, arg: str, refuse: Any) -> list[int]:
    """A numpy array's entries (a numpy scalar is refused as not 1-D: one row is ``[x]``)."""
    dt = getattr(a, "dtype", None)
    if dt is None or getattr(a, "ndim", None) is None:
        raise refuse(f"{type(a).__name__} {a!r}")
    if str(dt) == "bool":
        raise refuse(f"a bool mask ndarray of shape {list(a.shape)} ({_MASK_HINT})")
    if not str(dt).startswith(("int", "uint")):
        raise refuse(f"a {type(a).__name__} of dtype {dt}")
    if a.ndim != 1:
        raise ValueError(f"{where}: {arg} must be 1-D (one entry per row), got shape {list(a.shape)}")
    return [int(x) for x in a.tolist()]


def _sequence_items(value: Any, refuse: Any) -> list[int]:
    """A list / tuple / range / set's entries, each a Python or numpy int (a bool is refused: no mask)."""
    items = []
    for x in value:
        if isinstance(x, bool) or type(x).__name__ in ("bool_", "bool"):
            raise refuse(f"{type(value).__name__} holding the bool {x!r} (a mask is not a row list: pass its "
                         f"row indices)")
        if not isinstance(x, numbers.Integral):
            raise refuse(f"{type(value).__name__} holding {type(x).__name__} {x!r}")
        items.append(int(x))
    return items


def _describe(value: Any) -> str:
    """What a refused row list is, for the message (a single int: the list it should have been)."""
    what = type(value).__name__
    if isinstance(value, (int, float, str, bytes)) or value is None:
        what += f" {value!r}"
        if isinstance(value, int) and not isinstance(value, bool):
            what += f" (one row: pass [{value}])"
    return what


def check_flag(value: Any, where: str, arg: str, none_ok: bool = False) -> None:
    """``value`` must be True or False (or None with ``none_ok``): a TypeError naming the call otherwise."""
    if isinstance(value, bool) or (none_ok and value is None):
        return
    allowed = "None, True or False" if none_ok else "True or False"
    raise TypeError(f"{where}: {arg} must be {allowed}, got {type(value).__name__} {value!r}")


def batch_text(held: int, cap: int, ran: Sequence[int], declared: Optional[int]) -> str:
    """What bounds an announcement's rows, for its error messages: the batch sizes that exist."""
    sizes = ", ".join(map(str, ran)) if ran else str(held)
    text = f"the batch: {held} rows held, graphs of batch {sizes} ran on these caches"
    if declared is not None:
        text += f", the model's batch {declared}"
        if cap < declared:
            text += " (private state: it cannot grow)"
    return text


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


@dataclass
class OffloadState:
    """The state one compiled graph (``graph_id``) uses on one set of full caches."""

    graph_id: str
    B: int
    pool_size: int
    id_range: int
    groups: list[GroupState] = field(default_factory=list)
    resets: int = 0
    _flat: dict = field(default_factory=dict, repr=False, compare=False)
    _pools: Optional[tuple] = field(default=None, repr=False, compare=False)  # (generations, layer -> pools)
    # how the backend rebuilds / selects this state per call (set by build_state)
    layouts: Optional[list] = field(default=None, repr=False, compare=False)
    cache_refs: Optional[list] = field(default=None, repr=False, compare=False)
    shared: bool = field(default=False, repr=False, compare=False)
    # the model's batch (module_state): how many rows an announcement may name before a graph of that batch
    # has run on a shared state (a larger bucket); None: the rows held
    batch_limit: Optional[int] = field(default=None, repr=False, compare=False)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def allocate(cls, graph_id: str, plans: Sequence, device: torch.device | None = None) -> "OffloadState":
        """Allocate private pools and metadata for the group plans (or layouts) of one graph."""
        layouts = [p if isinstance(p, GroupLayout) else GroupLayout.from_plan(p) for p in plans]
        dev = device or torch.device("cpu")
        return cls.from_shared(graph_id, layouts,
                               [GroupPools(g.B, g.pool_size, g.id_range, g.dims, dev, g.table_cols)
                                for g in layouts])

    @classmethod
    def from_shared(cls, graph_id: str, layouts: Sequence[GroupLayout], shared: Sequence[GroupPools]
                    ) -> "OffloadState":
        p0 = layouts[0]
        st = cls(graph_id, p0.B, p0.pool_size, p0.id_range)
        for lay, sg in zip(layouts, shared):
            st.groups.append(GroupState(lay.group_id, lay.owner_layer, lay.layers, sg, lay.B, lay.sources))
        return st

    def _gens(self) -> tuple:
        return tuple(g.shared.gen for g in self.groups)

    @property
    def pools(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """layer -> (pool_kv, pool_rope), this graph's rows (rebuilt after a shared group grew)."""
        gens = self._gens()
        if self._pools is None or self._pools[0] != gens:
            out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for g in self.groups:
                for l, pools in zip(g.layers, g.pools()):
                    out[l] = pools
            self._pools = (gens, out)
        return self._pools[1]

    def flat(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The state tensors named ``names`` (graph-input order of the rewritten graph), memoised."""
        key = (tuple(names), self._gens())
        out = self._flat.get(key)
        if out is None:
            t = self.tensors()
            self._flat = {key: [t[n] for n in names]}  # one entry: an old generation's views are dropped
            out = self._flat[key]
        return out

    # -- inspection -----------------------------------------------------------------------
    def _pool_layers(self) -> list[int]:
        """The layers holding a pool of their own (a layer sharing another's pool is not listed twice)."""
        return sorted(l for g in self.groups for l in g.pool_layers())

    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for l in self._pool_layers():
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
        for l in self._pool_layers():
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
                hits, misses, window = row[PlanKind.POOL_HIT], row[PlanKind.FULL_OLD_MISS], row[PlanKind.DECODE_WINDOW]
                entry[key] = {"hits": hits, "misses": misses, "window": window,
                              "host_rows_read": (misses + window) * len(g.layers), "steps": row[NUM_PLAN_KINDS]}
            out.append(entry)
        return out

    def totals(self, which: str = "total") -> dict[str, int]:
        """Sums over groups of ``counters()[*][which]``."""
        if which not in ("step", "total"):
            raise ValueError(f"OffloadState.totals: which must be 'step' (the last decode step) or 'total' (the "
                             f"running sum), got {which!r}")
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

        ``rows``: row indices in ``[0, B)`` as :func:`row_indices` accepts them (a list, tuple, range or
        set of ints, or a 1-D integer tensor / numpy array on any device; a bool mask is refused). A full
        reset also clears the counters (``counters``: None, True or False overrides); a row reset keeps
        them. Bad input raises ``TypeError`` / ``ValueError`` before anything changes.
        """
        check_flag(counters, "OffloadState.reset", "counters", none_ok=True)
        idx = None if rows is None else row_indices(rows, "OffloadState.reset", "rows", 0, self.B or None,
                                                     f"the batch B={self.B}")
        if not self.groups:  # nothing compiled yet: nothing cached
            return
        if idx is None:
            # every row of the shared tensors, not only this graph's: "nothing cached" must hold for the
            # caches as a whole (versions = None trusts every row), whichever batch bucket asks
            for sg in self._shared_groups():
                _reset_shared(sg)
            if counters is None or counters:
                self.reset_counters()
            self.resets += 1
            return
        self._reset_rows(idx)
        if counters:
            self.reset_counters()

    @torch.no_grad()
    def _reset_rows(self, idx: Sequence[int]) -> None:
        """Empty rows ``idx`` (validated, in range) of every shared group; rows a group does not hold yet
        (a batch bucket not bound yet) hold nothing."""
        for sg in self._shared_groups():
            rows = sorted({r for r in idx if r < sg.rows})
            if not rows:
                continue
            i = torch.tensor(rows, dtype=torch.long, device=sg.pool_ids.device)
            sg.pool_ids[i] = -1
            sg.id_to_slot[i] = -1
            sg.lru_counter[i] = 0
            sg.seen_len[i] = 0
            for kv, rope in sg.pools:
                kv[i] = 0
                rope[i] = 0

    def _shared_groups(self) -> list[GroupPools]:
        out: list[GroupPools] = []
        for g in self.groups:
            if all(g.shared is not o for o in out):
                out.append(g.shared)
        return out

    def _limits(self) -> tuple[Optional[int], Optional[int], str]:
        """(rows every shared group holds now, how many rows an announcement may name, the message text).

        The bound is the largest batch that exists: the rows held (the largest graph bound so far) or,
        when every group can grow (shared state), the model's batch (``batch_limit``, from
        :func:`module_state`): a larger bucket whose graph has not run yet."""
        groups = self._shared_groups()
        if not groups:  # nothing compiled yet: only the model's batch is known (None: nothing)
            n = self.batch_limit
            return n, n, "the batch" if n is None else f"the model's batch {n}; no graph has run yet"
        held = min(sg.rows for sg in groups)
        cap = held
        if self.batch_limit is not None and all(sg.growable for sg in groups):
            cap = max(held, self.batch_limit)
        ran = sorted(set().union(*(sg.batches for sg in groups)))
        return held, cap, batch_text(held, cap, ran, self.batch_limit)

    @torch.no_grad()
    def begin_request(self, rows: Iterable[int]) -> None:
        """The engine's per-step announcement: batch ``rows`` start new requests, and they are **every** row
        whose full KV was written outside the compiled decode graph since the previous step (a prefill, a
        KV transfer, any write, with or without version counters). Their pool rows are forgotten at once;
        an outside write the version counters show then invalidates only these rows, not the batch
        (docs/new-requests.md, "The engine's contract"). ``rows`` may be empty (nothing new).

        ``rows``: as :func:`row_indices` accepts them (a bool mask is refused), each below the largest batch
        that exists (:meth:`_limits`: the rows held, or on a shared state the model's batch, for a larger
        bucket whose graph has not run yet: such a row holds nothing yet). Everything is checked before
        anything changes: a refused call changes nothing."""
        where = "OffloadState.begin_request"
        _, cap, text = self._limits()  # nothing compiled yet: nothing cached, but the call is still checked
        idx = row_indices(rows, where, "rows", 0, cap, text)
        self._reset_rows(idx)
        self._announce(None)

    def _announce(self, batch: Optional[int]) -> None:
        """Mark every shared group announced (the engine's account of the interval before the next step);
        ``batch``: the next step's batch a ``move_rows`` named."""
        for sg in self._shared_groups():
            sg.announced = True
            if batch is not None:
                sg.announced_batch = batch

    @torch.no_grad()
    def move_rows(self, src: Sequence[int]) -> None:
        """The batch changed between steps: row ``b`` now holds the request that was at row ``src[b]``
        (``-1``: a new request). The pool rows follow their request (copied in place, once per change);
        rows with ``-1`` start cold. Like :meth:`begin_request`, it names every row written outside the
        graph: only the ``-1`` rows may have been (docs/new-requests.md). ``src`` is as long as the next
        step's batch; with batch buckets it may be shorter than the shared state's rows (the largest
        bucket): the rows past it hold no request and are emptied. Longer than the rows held (a larger
        bucket whose graph has not run yet: shared state, up to the model's batch): the shared state grows
        to it at once.

        ``src``: a list, tuple or range of ints, or a 1-D integer tensor / numpy array (any device); each
        entry in ``[-1, rows)`` (the rows of the previous step), no row twice, 1 to the largest batch that
        exists entries (:meth:`_limits`). Bad input raises ``TypeError`` / ``ValueError`` naming the call,
        the argument and the limit before anything changes."""
        where = "OffloadState.move_rows"
        full_src = self._checked_src(src, where)  # nothing compiled yet: nothing to move, the call is checked
        if self.groups:
            self._move(full_src)
        self._announce(len(full_src))

    def _checked_src(self, src: Any, where: str) -> list[int]:
        """``src`` as a list, after every check of :meth:`move_rows` (nothing changed yet)."""
        held, cap, text = self._limits()
        rows = "the rows of the previous step"
        if held is not None:
            rows = f"the {held} rows of the offload state: {rows}"
        full_src = row_indices(src, where, "src", -1, held, f"{rows}; -1: a new request", sets=False)
        if not full_src or (cap is not None and len(full_src) > cap):
            count = "at least 1" if cap is None else f"1 to {cap}"
            raise ValueError(f"{where}: src must have one entry per batch row of the next step, {count} "
                             f"({text}), got {len(full_src)}")
        kept = [x for x in full_src if x >= 0]
        if len(set(kept)) != len(kept):
            dup = sorted({x for x in kept if kept.count(x) > 1})
            raise ValueError(f"{where}: src names row(s) {dup} twice: a request cannot move to two rows")
        return full_src

    @torch.no_grad()
    def _move(self, src: list[int]) -> None:
        """Row ``b`` of every shared group takes row ``src[b]`` (checked); ``-1`` rows and the rows past
        ``len(src)`` are emptied; a state with fewer rows grows first (a larger bucket next)."""
        n = len(src)
        groups = self._shared_groups()
        held = min(sg.rows for sg in groups)
        if n > held:  # a larger batch bucket next: its rows exist before its graph binds
            for sg in groups:
                sg.grow(n)
        rows = max(n, held)
        # a smaller batch bucket next: the rows past it hold no request (emptied, never trusted)
        full = src + [-1] * (rows - n)
        if any(x >= 0 and x != b for b, x in enumerate(full)):  # some request moves (-1 rows: emptied below)
            idx = torch.tensor([max(x, 0) for x in full], dtype=torch.long)
            for sg in groups:
                i = idx.to(sg.pool_ids.device)
                for t in sg.per_row():
                    t[:rows].copy_(t[:rows][i])
        self._reset_rows([b for b, x in enumerate(full) if x < 0])

    @torch.no_grad()
    def reset_counters(self) -> None:
        for g in self.groups:
            g.stats.zero_()

    # -- trace recording (offload_passes.trace; format in offload_passes/trace/format.py) ------------
    def record_trace(self, enable: bool = True) -> None:
        """Start (``enable=False``: stop) recording the top-k and lengths every ``dsa_plan`` of this state's
        groups receives, step by step; ``trace()`` returns them. Recording stays on until stopped."""
        check_flag(enable, "OffloadState.record_trace", "enable")
        from .trace.record import attach

        attach(self, enable)

    def trace(self, model: str = "unknown"):
        """The recorded steps as an ``offload_passes.trace.Trace`` (``save_trace`` writes the npz)."""
        if not isinstance(model, str):
            raise TypeError(f"OffloadState.trace: model must be a str (the trace's model name), got "
                            f"{type(model).__name__}")
        from .trace.record import state_trace

        return state_trace(self, model)


# -- state by caches -------------------------------------------------------------------------------------
def cache_key(t: torch.Tensor) -> tuple:
    """What the registry knows a full cache by: the tensor that owns its memory (``t._base`` for a view,
    else ``t``) by identity, then the address, shape, strides and dtype of ``t``. A fresh view object of
    the same cache rows (an engine hands per-layer views every step) has the same key; a view of other
    rows, or of another cache, has another. The owner's identity is what makes it safe: the registry
    holds a ``weakref.finalize`` on the owner and forgets every key naming it when it dies, so memory
    freed and re-used by a later tensor at the same address never finds the old pools (the same
    Python id is only handed out after the finalizer ran). Memory swapped under a live owner
    (``set_``) moves its version counter, which the outside-write check sees (every row cold)."""
    base = t._base
    root = t if base is None else base
    return (id(root), _ptr(t), tuple(t.shape), tuple(t.stride()), t.dtype)


def _ptr(t: torch.Tensor) -> Any:
    try:
        return t.data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (a fake tensor): known by identity only
        return ("id", id(t))


def _owner(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def cache_keys(caches: Sequence[Sequence[torch.Tensor]]) -> tuple:
    """Per group, the :func:`cache_key` of each of its full caches."""
    return tuple(tuple(cache_key(t) for t in cs) for cs in caches)


class StateRegistry:
    """Which state serves which full caches (process-wide; keyed by the caches' storage, :func:`cache_key`).

    * ``bind(graph_id, layouts, caches)``: the :class:`OffloadState` of one compiled graph on one set of
      full caches. Every graph whose group has the same pool geometry (``GroupLayout.signature``: pool
      size, id range, dims, paged or not) on the same caches shares one :class:`GroupPools`, whatever
      its batch size (the pools mirror cache rows, which do not depend on the graph that planned them):
      recompiles, batch-size buckets, other backends, fresh view objects of the caches.
    * ``activate(state, caches)``: the one stale-state rule of every mode: a group whose caches were
      last served by *other* group tensors (another pool geometry, or another graph's private state)
      is reset before it runs: cold, never stale.
    * Entries die with the tensors that own the caches' memory (``weakref.finalize``) and with their
      graph (``drop_graph``); the group tensors are held only by the live states that use them.
    """

    def __init__(self) -> None:
        self._bindings: dict[tuple, OffloadState] = {}  # (graph_id, cache keys) -> state
        self._shared: dict[tuple, "weakref.ref[GroupPools]"] = {}  # (cache keys, signature) -> group tensors
        self._claims: dict[tuple, "weakref.ref[GroupPools]"] = {}  # cache key -> group tensors that ran last
        # cache key -> the state whose activation claimed it last: groups of one graph that read one cache
        # (a layer reading another group's cache, transformers' kv_source_layers) run together every step
        self._claim_state: dict[tuple, "weakref.ref[OffloadState]"] = {}
        self._watched: dict[int, "weakref.finalize"] = {}  # owner id -> its finalizer
        self._by_owner: dict[int, set] = {}  # owner id -> binding / shared / claim keys that name it
        self._seen: "weakref.WeakKeyDictionary[GroupPools, tuple]" = weakref.WeakKeyDictionary()  # -> cache keys

    # -- lifetime -------------------------------------------------------------------------
    def _watch(self, owner: torch.Tensor, key: tuple) -> None:
        i = id(owner)
        self._by_owner.setdefault(i, set()).add(key)
        if i not in self._watched:
            self._watched[i] = weakref.finalize(owner, StateRegistry._owner_died, weakref.ref(self), i)

    @staticmethod
    def _owner_died(ref: "weakref.ref[StateRegistry]", i: int) -> None:
        self = ref()
        if self is None:
            return
        self._watched.pop(i, None)
        for key in self._by_owner.pop(i, ()):
            if key[0] == "claim":
                self._claims.pop(key[1], None)
                self._claim_state.pop(key[1], None)
            else:
                self._bindings.pop(key, None)
                self._shared.pop(key, None)

    def drop_graph(self, graph_id: str) -> None:
        """Forget the states of a compiled graph that no longer exists."""
        for key in [k for k in self._bindings if k[0] == graph_id]:
            del self._bindings[key]

    # -- lookup ---------------------------------------------------------------------------
    def bind(self, graph_id: str, layouts: Sequence[GroupLayout], caches: Sequence[Sequence[torch.Tensor]],
             keys: Optional[tuple] = None) -> OffloadState:
        """``caches[g]``: the full caches (kv, rope per layer) of group ``g`` of ``layouts``; ``keys``: their
        :func:`cache_keys` when the caller has them."""
        keys = cache_keys(caches) if keys is None else keys
        key = (graph_id, keys)
        st = self._bindings.get(key)
        if st is not None:
            return st
        shared = []
        for lay, cs, gkeys in zip(layouts, caches, keys):
            dev = torch.device(lay.device) if lay.device else cs[0].device
            skey = (gkeys, lay.signature, str(dev))
            ref = self._shared.get(skey)
            sg = ref() if ref is not None else None
            if sg is None:
                sg = GroupPools(lay.B, lay.pool_size, lay.id_range, lay.dims, dev, lay.table_cols)
                sg.growable = True  # taken per call: an announcement for a larger bucket may grow it
                self._shared[skey] = weakref.ref(sg)
                for t in cs:
                    self._watch(_owner(t), skey)
                log.debug("%s: new pools for group %d", graph_id, lay.group_id)
            elif sg.rows < lay.B:
                # a larger batch bucket on the same caches: the rows it shares keep what they hold
                log.debug("%s: group %d's shared state grows from %d to %d rows", graph_id, lay.group_id,
                          sg.rows, lay.B)
                sg.grow(lay.B)
            sg.batches.add(lay.B)
            shared.append(sg)
        st = OffloadState.from_shared(graph_id, layouts, shared)
        self._bindings[key] = st
        for cs in caches:
            for t in cs:
                self._watch(_owner(t), key)
        return st

    def bindings(self, graph_ids: Optional[Iterable[str]] = None) -> list[OffloadState]:
        ids = None if graph_ids is None else set(graph_ids)
        return [s for k, s in self._bindings.items() if ids is None or k[0] in ids]

    def activate(self, state: OffloadState, caches: Sequence[Sequence[torch.Tensor]],
                 keys: Optional[tuple] = None) -> bool:
        """Apply the stale-state rule before ``state`` runs on ``caches``; True if something was reset."""
        keys = cache_keys(caches) if keys is None else keys
        reset = False
        mine = {id(g.shared) for g in state.groups}
        # decided before this activation claims anything: a cache claimed last by another group of this same
        # state, in its own last activation, is no foreign use (both groups ran on it together)
        stale = []
        for g, gkeys in zip(state.groups, keys):
            sg = g.shared
            stale.append(sg.ran and any(not self._claimed_by(k, sg, state, mine) for k in gkeys))
        for g, cs, gkeys, old_claim in zip(state.groups, caches, keys, stale):
            sg = g.shared
            if old_claim:
                reset = True
                _reset_shared(sg)
            sg.ran = True
            _check_outside_writes(sg, cs, state.graph_id)
            if self._seen.get(sg) != gkeys:
                self._seen[sg] = gkeys
            ref = None
            for t, k in zip(cs, gkeys):
                old = self._claims.get(k)
                if old is None or old() is not sg:
                    ref = ref or weakref.ref(sg)
                    self._claims[k] = ref
                    self._watch(_owner(t), ("claim", k))
                self._claim_state[k] = weakref.ref(state)
        if reset:
            state.resets += 1  # noqa: SIM113
            log.info("%s: its caches were served by other offload state since its last run; its pools "
                     "were reset (cold start)", state.graph_id)
        return reset

    def _claimed_by(self, k: tuple, sg: GroupPools, state: OffloadState, mine: set) -> bool:
        """Cache ``k`` was last served by ``sg``, or by a group of ``state`` (ids ``mine``) in ``state``'s own
        activation."""
        ref = self._claims.get(k)
        owner = ref() if ref is not None else None
        if owner is sg:
            return True
        last = self._claim_state.get(k)
        return owner is not None and id(owner) in mine and last is not None and last() is state

    def serves(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether some offload state ran on caches among ``tensors`` (by the tensors that own them)."""
        owners = {id(_owner(t)) for t in tensors}
        return any(k[0] in owners for keys in list(self._seen.values()) for k in keys)

    @torch.no_grad()
    def follow_rows(self, old: Sequence[torch.Tensor], new: Sequence[torch.Tensor], src: Sequence[int]) -> int:
        """Full caches ``old[i]`` were replaced by ``new[i]`` (same shapes), whose row ``b`` holds what row
        ``src[b]`` of ``old[i]`` held: a beam-search reorder (``hf_reorder``). Every group state that served
        exactly caches among ``old`` (and still holds them) follows: its rows are gathered by ``src`` (a row
        may be taken twice, two beams from one), it is found by the new caches from now on, and their
        version counters count as its own (the reorder is no outside write: the pools moved with it). Row
        lists of another length (the batch changed) are not followed: the new caches start cold. Returns
        how many groups followed."""
        by_key = {cache_key(t): n for t, n in zip(old, new)}
        idx = torch.tensor(list(src), dtype=torch.long)
        moved = 0
        for sg, keys in list(self._seen.items()):
            if not keys or not all(k in by_key for k in keys) or sg.rows != len(src):
                continue
            claim = self._claims.get(keys[0])
            if claim is None or claim() is not sg:
                continue  # superseded: another state served these caches since
            new_t = [by_key[k] for k in keys]
            if any(tuple(t.shape) != k[2] for t, k in zip(new_t, keys)):
                continue
            for t in sg.per_row():
                t.copy_(t[idx.to(t.device)])
            new_keys = tuple(cache_key(t) for t in new_t)
            ref = weakref.ref(sg)
            for skey, r in list(self._shared.items()):
                if r() is sg and skey[0] == keys:
                    nkey = (new_keys,) + skey[1:]
                    self._shared[nkey] = ref
                    for t in new_t:
                        self._watch(_owner(t), nkey)
            # the graphs' states of the old caches are the states of the new ones (the old entries die with
            # the old tensors, and with them the last strong reference to the group)
            for bkey, st in list(self._bindings.items()):
                if keys in bkey[1]:
                    nb = (bkey[0], tuple(new_keys if gk == keys else gk for gk in bkey[1]))
                    self._bindings[nb] = st
                    for t in new_t:
                        self._watch(_owner(t), nb)
            for k, t in zip(new_keys, new_t):
                self._claims[k] = ref
                self._watch(_owner(t), ("claim", k))
            self._seen[sg] = new_keys
            sg.versions = cache_versions(new_t)
            moved += 1
        return moved

    def current_groups(self, owner_ids: set) -> list[tuple[tuple, GroupPools]]:
        """Group tensors that ran on caches owned by tensors all in ``owner_ids`` (ids) and still hold
        them (not superseded); with their cache keys."""
        out = []
        for sg, keys in list(self._seen.items()):
            if not keys or not all(k[0] in owner_ids for k in keys):
                continue
            claim = self._claims.get(keys[0])
            if claim is not None and claim() is sg:
                out.append((keys, sg))
        return out


def module_state(module: Any, registry: Optional[StateRegistry] = None,
                 batch_size: Optional[int] = None) -> OffloadState:
    """The offload state of every graph that serves ``module`` (its buffers own the full caches; the graphs
    may get them as views), graph breaks and batch buckets included: one :class:`OffloadState` over all
    of them, with every row of the shared state (the largest batch bound), layers numbered in the
    module's buffer order (views of one buffer by address), groups by first layer. Empty
    (``groups == []``, ``reset`` a no-op) before the first call.

    ``batch_size``: the model's (largest) batch, how many rows an announcement may name before a graph of
    that batch has run (default: ``module.batch_size`` when it is an int, else the rows held)."""
    where = "module_state"
    if not callable(getattr(module, "buffers", None)):  # a module, or an object listing its cache tensors
        raise TypeError(f"{where}: module must be a torch.nn.Module (the model whose buffers hold the full caches), "
                        f"got {type(module).__name__}")
    if registry is not None and not isinstance(registry, StateRegistry):
        raise TypeError(f"{where}: registry must be a StateRegistry or None, got {type(registry).__name__}")
    if batch_size is None:
        own = getattr(module, "batch_size", None)
        batch_size = own if isinstance(own, int) and not isinstance(own, bool) and own >= 1 else None
    elif isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"{where}: batch_size must be an int >= 1 (the model's batch) or None, got "
                        f"{type(batch_size).__name__} {batch_size!r}")
    elif batch_size < 1:
        raise ValueError(f"{where}: batch_size must be an int >= 1 (the model's batch) or None, got {batch_size}")
    st = _module_groups(module, registry or REGISTRY)
    st.batch_limit = batch_size
    return st


def _module_groups(module: Any, reg: StateRegistry) -> OffloadState:
    """:func:`module_state` after its checks: the groups found by the module's buffers."""
    pos: dict[int, int] = {}
    for i, buf in enumerate(module.buffers()):
        pos.setdefault(id(buf), i)
        if isinstance(buf, torch.Tensor) and buf._base is not None:  # a view: the registry knows its owner
            pos.setdefault(id(buf._base), i)
    found = reg.current_groups(set(pos))

    def order(k: tuple) -> tuple:
        return (pos[k[0]], k[1] if isinstance(k[1], int) else -1)

    kv_keys = sorted({keys[j] for keys, _ in found for j in range(0, len(keys), 2)}, key=order)
    layer_of = {k: n for n, k in enumerate(kv_keys)}
    entries = sorted(((([layer_of[keys[j]] for j in range(0, len(keys), 2)]), sg) for keys, sg in found),
                     key=lambda e: e[0][0])
    if not entries:
        return OffloadState("module", 0, 0, 0)
    layouts = []
    for gi, (layers, sg) in enumerate(entries):
        B, PS = sg.pool_ids.shape
        sources = [layers.index(l) for l in layers]  # layers on the same caches share the first one's pool
        layouts.append(GroupLayout(gi, layers[0], layers, int(B), int(PS), int(sg.id_to_slot.size(1)),
                                   [(kv.size(-1), rope.size(-1), kv.dtype) for kv, rope in sg.pools],
                                   int(sg.seen_table.size(1)) if sg.seen_table is not None else 0, None,
                                   sources if sources != list(range(len(layers))) else None))
    return OffloadState.from_shared("module", layouts, [sg for _, sg in entries])


def cache_versions(caches: Sequence[torch.Tensor]) -> Optional[tuple]:
    """The version counters of ``caches`` (an in-place write outside autograd's view of them, e.g.
    through ``.data``, does not move them); None when one is an inference tensor (no counter)."""
    try:
        return tuple(t._version for t in caches)
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


_warned_inference: set = set()


@torch.no_grad()
def _check_outside_writes(sg: GroupPools, caches: Sequence[torch.Tensor], graph_id: str) -> None:
    """Set ``external_write`` for the coming step when the full caches were written since this group's
    last step by anything but its own graph (docs/new-requests.md): their version counters moved (an
    eager prefill or step, ``StaticCache.reset()``, a graph compiled by any AOT-based backend). Caches without version counters (inference tensors) are treated
    as written before every step: cold, never stale. A counter is per tensor, not per row: an
    announcement (``reset(rows=...)``, the ledger) cannot prove the other rows untouched, so it does not
    suppress the flag (a soak with one announced and one unannounced re-fill in the same step was
    served stale when it did). ``begin_request`` / ``move_rows`` do: they are the engine's complete account
    of the rows it wrote (``GroupPools.announced``)."""
    v = cache_versions(caches)
    moved = v is None or (sg.versions is not None and v != sg.versions)
    if moved and v is not None and sg.announced:
        # the engine named every row it wrote (begin_request / move_rows): those rows were reset at once,
        # the others are trusted (docs/new-requests.md, "The engine's contract")
        log.debug("%s: outside write covered by an announcement: only the announced rows were invalidated",
                  graph_id)
        moved = False
    if v is None and graph_id not in _warned_inference:
        _warned_inference.add(graph_id)
        log.warning("%s: the full caches are inference tensors (created under torch.inference_mode), which have "
                    "no version counter, so writes outside the compiled graph cannot be seen; the offload pools are "
                    "invalidated before every step (correct but cold). Allocate the caches outside "
                    "inference_mode (torch.no_grad() is fine) to keep the pools warm.", graph_id)
    if moved:
        sg.external_write.fill_(1)
        sg.flagged = True
        log.debug("%s: full caches written outside the graph since its last step: invalidating every row", graph_id)


def _check_announced_batch(st: OffloadState, graph_id: str) -> None:
    """A ``move_rows`` names the next step's batch (``len(src)``). A graph of another batch may still run:
    the rows past ``len(src)`` were emptied and the rows past the graph's batch are not served, so the step
    is exact; but the engine's account and its step disagree, which the log says (once per announcement)."""
    named = [(g.shared.announced_batch, g.B) for g in st.groups if g.shared.announced_batch is not None]
    for g in st.groups:
        g.shared.announced_batch = None
    bad = [(n, b) for n, b in named if n != b]
    if bad:
        n, b = bad[0]
        log.warning("%s: OffloadState.move_rows named a batch of %d rows (src had %d entries), but this step runs a "
                    "graph of batch %d: src should be as long as the next step's batch (docs/new-requests.md). "
                    "Served exactly: the rows past src were emptied, the rows past the batch are not served.",
                    graph_id, n, n, b)


@torch.no_grad()
def after_step(sg: GroupPools, caches: Sequence[torch.Tensor]) -> None:
    """After the group's graph ran: remember the caches' versions (its own cache writes included) and
    clear the flag the step consumed."""
    sg.versions = cache_versions(caches)
    sg.announced = False  # an announcement covers the interval before one step
    sg.announced_batch = None
    if sg.flagged:
        sg.external_write.zero_()
        sg.flagged = False


@torch.no_grad()
def _reset_shared(sg: GroupPools) -> None:
    sg.versions = None  # nothing cached any more
    sg.pool_ids.fill_(-1)
    sg.id_to_slot.fill_(-1)
    sg.lru_counter.zero_()
    sg.seen_len.zero_()
    for kv, rope in sg.pools:
        kv.zero_()
        rope.zero_()


REGISTRY = StateRegistry()


class StateBinder:
    """The piece every mode's compiled graph calls first (``backend._Compiled``, one core for all modes).

    ``cache_refs``: per group, per layer the full caches as ``("arg", i)`` (graph input i) or
    ``("const", tensor)`` (a buffer the graph holds). ``input_names`` set: the state is passed as extra
    graph inputs and chosen per call by the caches' storage (:func:`cache_key`); None: the graph holds ``initial``
    as buffers (one private state). Either way :meth:`StateRegistry.activate` runs before the graph.
    """

    def __init__(self, graph_id: str, layouts: Sequence[GroupLayout], cache_refs: Sequence[Sequence[tuple]],
                 input_names: Optional[Sequence[str]], initial: OffloadState,
                 registry: Optional[StateRegistry] = None) -> None:
        self.graph_id = graph_id
        self.layouts = list(layouts)
        self.cache_refs = [list(r) for r in cache_refs]
        self.input_names = list(input_names) if input_names is not None else None
        self.registry = registry or REGISTRY
        self._initial = initial if self.input_names is None else None  # a private state lives with the graph
        self._last: Optional["weakref.ref[OffloadState]"] = weakref.ref(initial)
        self.calls = 0
        # times the stale-state rule reset this graph's pools before a call: other offload state (another
        # pool geometry, another backend's private state) served its caches in between. More than one
        # means a pattern that keeps the pool cold (alternating graphs over the same caches).
        self.cold_resets = 0
        # the previous call's cache tensors (weakly) and their keys: the same objects again (the usual
        # case: module buffers) skip computing the keys; a view that died never matches
        self._last_caches: list = []
        self._last_keys: Optional[tuple] = None
        # calls in a row that found new, empty pools (caches that are new tensors at every call)
        self.fresh_streak = 0
        self.frontend = "recipe"  # whose advice its warnings give (set by the backend: "recipe" | "hf")

    def caches(self, args: Sequence[Any]) -> list[list[torch.Tensor]]:
        return [[args[v] if kind == "arg" else v for kind, v in refs] for refs in self.cache_refs]

    def _keys(self, caches: list[list[torch.Tensor]]) -> tuple:
        flat = [t for cs in caches for t in cs]
        last = self._last_caches
        keys = self._last_keys
        if (keys is not None and len(last) == len(flat)
                and all(r() is t and k[1] == _ptr(t) for (r, k), t in zip(last, flat))):
            return keys  # the same objects on the same memory (``.data =`` swaps memory under an object)
        keys = cache_keys(caches)
        self._last_caches = list(zip([weakref.ref(t) for t in flat], [k for ks in keys for k in ks]))
        self._last_keys = keys
        return keys

    def state_for(self, args: Sequence[Any]) -> OffloadState:
        caches = self.caches(args)
        keys = self._keys(caches)
        if self.input_names is None:
            st = self._initial
        else:
            st = self.registry.bind(self.graph_id, self.layouts, caches, keys)
        _check_announced_batch(st, self.graph_id)
        self._note_fresh(st)
        if self.registry.activate(st, caches, keys):
            self.cold_resets += 1
            if self.cold_resets == 2:
                log.warning("%s: its offload pools were reset again because other offload state served the same "
                            "caches in between (graphs with another pool geometry: pool size, id range, paged or "
                            "not; or a graph with private state, the NPU modes), alternating over one set of "
                            "caches: the pools stay cold, every step pays the offload and gains nothing. The "
                            "report's 'cold_resets' counts it (docs/new-requests.md, 'Graphs that share caches').",
                            self.graph_id)
        if not caches:  # caches the binder cannot name: writes outside the graph cannot be seen
            for g in st.groups:  # so every step starts cold (correct; docs/new-requests.md)
                g.shared.external_write.fill_(1)
                g.shared.flagged = True
        self._last = weakref.ref(st)
        self.calls += 1
        return st

    #: calls in a row on new, empty pools after which the binder says the pools never warm up
    FRESH_WARN_AFTER = 3

    def _note_fresh(self, st: OffloadState) -> None:
        """Say once when the caches are new tensors at every call: their state is new and empty each time,
        so every step is cold (a cache that replaces its tensors between steps; beam search in a transformers
        cache whose reorder ``hf_reorder`` does not see)."""
        fresh = self.calls > 0 and any(not g.shared.ran for g in st.groups)
        self.fresh_streak = self.fresh_streak + 1 if fresh else 0
        if self.fresh_streak != self.FRESH_WARN_AFTER:
            return
        advice = ("A Hugging Face cache whose tensors transformers replaces between steps cannot be followed, except "
                  "the StaticCache's beam-search reorder (docs/hf.md)." if self.frontend == "hf" else
                  "Hand the compiled model the same cache tensors (or views of them) every step, and tell it how "
                  "rows moved with OffloadState.move_rows (docs/new-requests.md).")
        log.warning("%s: its full caches were new tensors on each of the last %d calls, so their offload pools "
                    "started empty every time: correct, but the offload gains nothing. %s", self.graph_id,
                    self.fresh_streak, advice)

    def extra_inputs(self, args: Sequence[Any]) -> list[torch.Tensor]:
        st = self.state_for(args)
        return st.flat(self.input_names) if self.input_names is not None else []

    def after_call(self, args: Sequence[Any]) -> None:
        """After the graph ran on ``args``: record its caches' versions (see :func:`after_step`)."""
        st = self.last_state
        if st is None:
            return
        caches = self.caches(args)
        for i, g in enumerate(st.groups):
            after_step(g.shared, caches[i] if i < len(caches) else ())

    @property
    def last_state(self) -> Optional[OffloadState]:
        return self._last() if self._last is not None else None

    def states(self) -> list[OffloadState]:
        if self.input_names is None:
            return [self._initial]
        return self.registry.bindings([self.graph_id])

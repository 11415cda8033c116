"""``OffloadState``: the public face of the pools and metadata one compiled graph uses on one set of full
caches (the tensors: ``pools.py``; found by the caches: ``registry.py``). Inspection (tensors, bytes,
counters), the engine's announcements (``begin_request`` / ``move_rows`` / ``reset``: every argument is
checked before anything changes, docs/new-requests.md) and the recording hook (``recording.py``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch

from ..custom_ops.plan_kind import NUM_PLAN_KINDS, PlanKind
from .checks import batch_text, check_flag, row_indices
from .pools import GroupLayout, GroupPools, GroupState, reset_shared
from .recording import Recorder, Recording, TraceRecorder, new_trace_recorder


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
    # per group, per cache ref: the graph output a cache grown by concatenation becomes (its ref is the past
    # input); None: no grown cache
    grown: Optional[list] = field(default=None, repr=False, compare=False)
    shared: bool = field(default=False, repr=False, compare=False)
    # the model's batch (module_state): how many rows an announcement may name before a graph of that batch
    # has run on a shared state (a larger bucket); None: the rows held
    batch_limit: Optional[int] = field(default=None, repr=False, compare=False)
    _recording: Optional[Recording] = field(default=None, repr=False, compare=False)
    _trace_recorder: Optional[TraceRecorder] = field(default=None, repr=False, compare=False)

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
                kind = "stats" if nm.startswith("stats") else "group"
                rows.append({"name": nm, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                             "bytes": t.numel() * t.element_size(), "kind": kind, "group_id": g.group_id})
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
                reset_shared(sg)
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

    # -- recording (recording.py) -------------------------------------------------------------
    def add_recorder(self, recorder: Recorder) -> None:
        """Call ``recorder(group, topk, lengths)`` with the inputs of every ``dsa_plan`` call of this state's
        groups from now on (``recording.Recorder``), until :meth:`remove_recorder`."""
        if self._recording is None:
            self._recording = Recording(self)
        self._recording.add(recorder, "OffloadState.add_recorder")

    def remove_recorder(self, recorder: Recorder) -> None:
        """Stop calling ``recorder`` (ValueError naming the call when it is not attached)."""
        if self._recording is None:
            raise ValueError("OffloadState.remove_recorder: this recorder is not attached")
        self._recording.remove(recorder, "OffloadState.remove_recorder")

    def record_trace(self, enable: bool = True) -> None:
        """Start (``enable=False``: stop) recording the top-k and lengths every ``dsa_plan`` of this state's
        groups receives, step by step; ``trace()`` returns them. Recording stays on until stopped. The
        recorder is the trace package's (``offload_passes.trace`` registers it when imported)."""
        check_flag(enable, "OffloadState.record_trace", "enable")
        rec = self._trace_recorder
        attached = rec is not None and self._recording is not None and self._recording.has(rec)
        if enable and not attached:
            if rec is None:
                rec = self._trace_recorder = new_trace_recorder()
            self.add_recorder(rec)
        elif not enable and attached:
            self.remove_recorder(rec)

    def trace(self, model: str = "unknown") -> Any:
        """The recorded steps as the trace package's trace (``offload_passes.trace.Trace``; ``save_trace``
        writes the npz)."""
        if not isinstance(model, str):
            raise TypeError(f"OffloadState.trace: model must be a str (the trace's model name), got "
                            f"{type(model).__name__}")
        if self._trace_recorder is None:
            raise RuntimeError("OffloadState.trace: call record_trace() before running decode steps")
        return self._trace_recorder.trace(self, model)

"""Which state serves which full caches: the caches' keys (:func:`cache_key`, by the storage that owns them),
the process-wide :class:`StateRegistry` (:data:`REGISTRY`: shared group tensors per caches and pool
geometry, the graphs' bindings, the stale-state rule, beam-search reorders followed) and
:func:`module_state` (one :class:`~.api.OffloadState` over every graph that serves a module)."""
from __future__ import annotations

import logging
import weakref
from typing import Any, Iterable, Optional, Sequence

import torch

from . import writes
from .api import OffloadState
from .pools import GroupLayout, GroupPools, reset_shared

log = logging.getLogger("offload_passes.state.registry")


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
    return (id(root), address(t), tuple(t.shape), tuple(t.stride()), t.dtype)


def address(t: torch.Tensor) -> Any:
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
                reset_shared(sg)
            sg.ran = True
            writes.check_outside_writes(sg, cs, state.graph_id)
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
            new_t = self._reordered(sg, keys, by_key, len(src))
            if new_t is None:
                continue
            for t in sg.per_row():
                t.copy_(t[idx.to(t.device)])
            self._rekey(sg, keys, new_t)
            sg.versions = writes.cache_versions(new_t)
            moved += 1
        return moved

    def follow_growth(self, sg: GroupPools, old: Sequence[torch.Tensor], new: Sequence[torch.Tensor]) -> bool:
        """Group ``sg`` ran on caches ``old``; the step returned ``new[i]``, ``old[i]`` with rows appended
        (``torch.cat``, a ``DynamicCache``): from now on ``sg`` is found by ``new``. Only when ``sg`` still
        holds ``old`` (nothing else served them since); returns whether it followed."""
        keys = cache_keys([old])[0]
        claim = self._claims.get(keys[0]) if keys else None
        if claim is None or claim() is not sg or self._seen.get(sg) != keys:
            return False
        self._rekey(sg, keys, new)
        return True

    def _reordered(self, sg: GroupPools, keys: tuple, by_key: dict, n: int) -> Optional[list[torch.Tensor]]:
        """The new caches of group ``sg`` (which ran last on caches ``keys``) when it follows a reorder: every
        cache among the old ones, ``n`` rows, still its own (not superseded), the new tensors of the same
        shapes. None: it does not follow (its new caches start cold)."""
        if not keys or not all(k in by_key for k in keys) or sg.rows != n:
            return None
        claim = self._claims.get(keys[0])
        if claim is None or claim() is not sg:
            return None  # superseded: another state served these caches since
        new_t = [by_key[k] for k in keys]
        if any(tuple(t.shape) != k[2] for t, k in zip(new_t, keys)):
            return None
        return new_t

    def _rekey(self, sg: GroupPools, keys: tuple, new_t: Sequence[torch.Tensor]) -> None:
        """From now on ``sg`` is found by the caches ``new_t`` (it was by ``keys``): its shared entries, the
        graphs' bindings, the claims, what it last ran on."""
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


REGISTRY = StateRegistry()


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
    st = _module_groups(module, registry or REGISTRY)
    st.batch_limit = _model_batch(module, batch_size)
    return st


def _model_batch(module: Any, batch_size: Any) -> Optional[int]:
    """``module_state``'s ``batch_size`` checked, or the module's own ``batch_size`` (None: not an int)."""
    if batch_size is None:
        own = getattr(module, "batch_size", None)
        return own if isinstance(own, int) and not isinstance(own, bool) and own >= 1 else None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"module_state: batch_size must be an int >= 1 (the model's batch) or None, got "
                        f"{type(batch_size).__name__} {batch_size!r}")
    if batch_size < 1:
        raise ValueError(f"module_state: batch_size must be an int >= 1 (the model's batch) or None, got "
                         f"{batch_size}")
    return batch_size


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

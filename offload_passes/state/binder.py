"""The per-call binding every mode's compiled graph runs first (:class:`StateBinder`): the state of the
call's caches (shared, from the registry, or the graph's private one), the stale-state rule and the
outside-write check (``registry.StateRegistry.activate``), the engine's announced batch compared with
the graph's, and the versions recorded after the call (``writes.after_step``)."""
from __future__ import annotations

import logging
import weakref
from typing import Any, Optional, Sequence

import torch

from .api import OffloadState
from .pools import GroupLayout
from .registry import REGISTRY, StateRegistry, address, cache_keys
from .writes import after_step

log = logging.getLogger("offload_passes.state.binder")


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


class StateBinder:
    """The piece every mode's compiled graph calls first (``backend._Compiled``, one core for all modes).

    ``cache_refs``: per group, per layer the full caches as ``("arg", i)`` (graph input i) or
    ``("const", tensor)`` (a buffer the graph holds). ``input_names`` set: the state is passed as extra
    graph inputs and chosen per call by the caches' storage (:func:`cache_key`); None: the graph holds ``initial``
    as buffers (one private state). Either way :meth:`StateRegistry.activate` runs before the graph.
    """

    def __init__(self, graph_id: str, layouts: Sequence[GroupLayout], cache_refs: Sequence[Sequence[tuple]],
                 input_names: Optional[Sequence[str]], initial: OffloadState,
                 registry: Optional[StateRegistry] = None, grown: Optional[Sequence[Sequence]] = None) -> None:
        self.graph_id = graph_id
        # per group, per cache ref: the graph output a cache grown by concatenation becomes (None: not grown)
        self.grown = [list(g) for g in grown] if grown is not None else None
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
                and all(r() is t and k[1] == address(t) for (r, k), t in zip(last, flat))):
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

    def after_call(self, args: Sequence[Any], outputs: Sequence[Any] = ()) -> None:
        """After the graph ran on ``args``: record its caches' versions (see :func:`after_step`). Caches grown
        by concatenation: the pools follow the graph's ``outputs`` that extend them (the next step's past)."""
        st = self.last_state
        if st is None:
            return
        caches = self.caches(args)
        if self.grown is not None and self.input_names is not None:
            caches = self._follow(st, caches, outputs)
        for i, g in enumerate(st.groups):
            after_step(g.shared, caches[i] if i < len(caches) else ())

    def _follow(self, st: OffloadState, caches: list[list[torch.Tensor]], outputs: Sequence[Any]
                ) -> list[list[torch.Tensor]]:
        """Each group's pools are found, from now on, by the outputs its grown caches became: the same rows
        and this step's (which its installs put in the pools), as a new tensor. Proven by identity: the next
        step finds them only when it is handed exactly those tensors, unwritten since (their versions)."""
        new = [[outputs[j] if j is not None else t for t, j in zip(cs, gr)] for cs, gr in zip(caches, self.grown)]
        for g, old, nw in zip(st.groups, caches, new):
            self.registry.follow_growth(g.shared, old, nw)
        self._last_caches, self._last_keys = [], None
        return new

    @property
    def last_state(self) -> Optional[OffloadState]:
        return self._last() if self._last is not None else None

    def states(self) -> list[OffloadState]:
        if self.input_names is None:
            return [self._initial]
        return self.registry.bindings([self.graph_id])

"""Writes outside the graph, seen by the full caches' version counters: before a group's step
(:func:`check_outside_writes` sets ``external_write``, the graph then invalidates every row unless the
engine announced the interval) and after it (:func:`after_step` records the counters, the graph's own
writes included). docs/new-requests.md, "The rule"."""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from .pools import GroupPools

log = logging.getLogger("offload_passes.state.writes")


def cache_versions(caches: Sequence[torch.Tensor]) -> Optional[tuple]:
    """The version counters of ``caches`` (an in-place write outside autograd's view of them, e.g.
    through ``.data``, does not move them); None when one is an inference tensor (no counter)."""
    try:
        return tuple(t._version for t in caches)
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


_warned_inference: set = set()


@torch.no_grad()
def check_outside_writes(sg: GroupPools, caches: Sequence[torch.Tensor], graph_id: str) -> None:
    """Set ``external_write`` for the coming step when the full caches were written since this group's last step by
    anything but its own graph (docs/new-requests.md): their version counters moved (an eager prefill or step,
    ``StaticCache.reset()``, a graph compiled by any AOT-based backend). Caches without version counters
    (inference tensors) are treated as written before every step: cold, never stale. A counter is per tensor,
    not per row: an announcement (``reset(rows=...)``, the ledger) cannot prove the other rows untouched, so it
    does not suppress the flag (a soak with one announced and one unannounced re-fill in the same step was
    served stale when it did). ``begin_request`` / ``move_rows`` do: they are the engine's complete account of
    the rows it wrote (``GroupPools.announced``)."""
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

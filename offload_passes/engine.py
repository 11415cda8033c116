"""The engine adapter: what a serving engine calls around a decode model compiled with the offload backend.

An online engine shaped like the reference's (cann-recipes-infer ``executor/online``: a decode scheduler,
a block pool with null block 0, up to the per-rank batch of running requests, KV received by transfer)
knows, before every decode step, which request runs in each batch row and which requests' KV it wrote
outside the decode graph (admitted with a prefill or a transfer, re-admitted after a retraction). That is
all the offload needs (docs/new-requests.md, "The engine's contract"); :class:`EngineAdapter` turns it
into the two things the unmodified model and the offload need when the batch changes:

* the model's per-row buffers follow their request: the selection buffers and the gather ledger move
  with it, and a new request's ledger is reset to -1 (the unmodified model's own requirement, whatever
  the offload: its gather reuses what the ledger says a row holds);
* the offload state follows its requests: ``OffloadState.move_rows(src)``, ``src[b]`` the row the request
  at ``b`` held at the previous step, -1 for a new one (pool rows move on the device, new rows start cold).

Per step the engine also writes its block table into the model (``model.block_table`` in
``models/glm``): the adapter does not, the table is the engine's own. Nothing is called on a step whose
batch is the previous one's. docs/engine.md shows the loop; ``benchmarks/engine_example.py`` runs it.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Hashable, Iterable, Mapping, Optional, Sequence

import torch

from .models.glm.serve import follow_requests, request_rows
from .state import OffloadState, module_state

log = logging.getLogger("offload_passes.engine")

__all__ = ["EngineAdapter"]


class EngineAdapter:
    """Keep a compiled decode model's rows with their requests, from what the engine knows.

    ``model``: the decode model of the largest batch (its batch buckets' buffers are views of its first
    rows, ``models/glm/serve.py::bucket_model``). ``row_tensors`` / ``ledgers``: its per-row buffers
    (selection buffers; gather ledgers), each viewed ``[batch_size, -1, ...]``; default: those of the
    project's recipe model (``serve.request_rows``); pass ``()`` for a model whose engine moves them
    itself. ``batch_size``: default the ledgers' first dimension. ``state``: how to get the offload state
    (default ``module_state(model)``, which covers every graph serving the model, buckets included)."""

    def __init__(self, model: Any, *, row_tensors: Optional[Sequence[torch.Tensor]] = None,
                 ledgers: Optional[Sequence[torch.Tensor]] = None, batch_size: Optional[int] = None,
                 state: Optional[Callable[[], OffloadState]] = None) -> None:
        where = "EngineAdapter"
        if row_tensors is None and ledgers is None:
            row_tensors, ledgers = request_rows(model)
        self.row_tensors = _tensors(row_tensors, where, "row_tensors")
        self.ledgers = _tensors(ledgers, where, "ledgers")
        if batch_size is None:
            if not self.ledgers:
                raise ValueError("EngineAdapter: batch_size is needed when no ledgers are given (it is their first "
                                 "dimension otherwise)")
            batch_size = int(self.ledgers[0].size(0))
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"EngineAdapter: batch_size must be an int >= 1, got {batch_size!r}")
        for t in self.row_tensors + self.ledgers:
            if t.dim() == 0 or t.size(0) % batch_size:
                raise ValueError(f"EngineAdapter: every row tensor and ledger needs a first dimension divisible by "
                                 f"batch_size={batch_size} (one block of rows per batch row), got {list(t.shape)}")
        if state is not None and not callable(state):
            raise TypeError(f"EngineAdapter: state must be a callable returning the OffloadState (e.g. "
                            f"lambda: module_state(model)), got {type(state).__name__}")
        self.model = model
        self.batch_size = batch_size
        self._state = state if state is not None else (lambda: module_state(model, batch_size=batch_size))
        self._rows: list = []  # request id per row at the previous step (None: padding)
        self.batch_changes = 0

    @property
    def state(self) -> OffloadState:
        """The offload state the adapter announces to (empty before the first compiled call)."""
        return self._state()

    def step(self, rows: Sequence[Optional[Hashable]], written: Iterable[Hashable] = ()) -> list[int]:
        """Before each decode step. ``rows[b]``: the id of the request in batch row ``b`` of this step (None:
        a padding row), as many as the step's batch (a bucket may be smaller than ``batch_size``).
        ``written``: the ids whose KV the engine wrote outside the decode graph since the previous step (a
        prefill, a KV transfer, a re-admission after a retraction): they are new wherever they sit. Returns
        ``src`` (-1: a new request or a padding row); when it differs from the previous step's batch, the
        model's rows and the offload state follow it.

        Everything is checked before anything changes, the offload state's own checks included (it is
        told first): a refused call leaves the model's rows, the offload state and the adapter's account
        of the previous step as they were, so a corrected call is the only one applied."""
        rows = _checked_rows(rows, self.batch_size)
        new = _checked_written(written)
        prev = {rid: b for b, rid in enumerate(self._rows) if rid is not None}
        src = [prev.get(r, -1) if r is not None and r not in new else -1 for r in rows]
        old = self._rows
        # a padding row that was padding before is no change (it holds no request either way)
        changed = len(rows) != len(old) or any(
            (r is not None and x != b) or (r is None and old[b] is not None) for b, (r, x) in enumerate(zip(rows, src)))
        if changed:
            self.state.move_rows(src)  # first: it refuses what it cannot hold before anything moved
            follow_requests(self.row_tensors, self.ledgers, src, self.batch_size)
            self.batch_changes += 1
        self._rows = rows
        return src


def _tensors(value: Any, where: str, arg: str) -> list[torch.Tensor]:
    """``value`` (None: none) as a list of tensors, each named when it is not one."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor) or not isinstance(value, Iterable):
        raise TypeError(f"{where}: {arg} must be a list or tuple of tensors (one per buffer), got "
                        f"{type(value).__name__}")
    out = list(value)
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {arg}[{i}] must be a tensor, got {type(t).__name__}")
    return out


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _checked_rows(rows: Any, batch_size: int) -> list:
    """``EngineAdapter.step``'s ``rows`` as a list, after every check."""
    where = "EngineAdapter.step"
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise TypeError(f"{where}: rows must be a list or tuple of request ids (None: a padding row), one per "
                        f"batch row, got {type(rows).__name__}")
    if not 1 <= len(rows) <= batch_size:
        raise ValueError(f"{where}: rows must have 1 to {batch_size} entries (the batch), got {len(rows)}")
    for b, r in enumerate(rows):
        if not _hashable(r):
            raise TypeError(f"{where}: rows[{b}] is {type(r).__name__} {r!r}, not a request id (ids must be "
                            f"hashable; None: a padding row)")
    ids = [r for r in rows if r is not None]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: a request runs in one row only, got rows={list(rows)}")
    return list(rows)


def _checked_written(written: Any) -> set:
    """``EngineAdapter.step``'s ``written`` as a set, after every check."""
    where = "EngineAdapter.step"
    if written is None or isinstance(written, (str, bytes, Mapping)) or not isinstance(written, Iterable):
        what = "None" if written is None else f"{type(written).__name__}"
        if isinstance(written, (int, float, str, bytes)) and not isinstance(written, bool):
            what += f" {written!r}"
        raise TypeError(f"{where}: written must be a collection of request ids (a set, list or tuple; empty: "
                        f"none written), got {what}")
    items = list(written)
    for i, x in enumerate(items):
        if not _hashable(x):
            raise TypeError(f"{where}: written[{i}] is {type(x).__name__} {x!r}, not a request id (ids must be "
                            f"hashable)")
    return set(items)

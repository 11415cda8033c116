"""The GraphReport: what the backend did to one compiled graph (docs/ARCHITECTURE.md §5).

A dataclass, filled by the pipeline (``pipeline.py``) and the lowerings, which set fields; ``to_dict()``
is the JSON form (``report.json`` in a dump, ``offload-demo --json``). It is also a read-only
``Mapping`` over that form (``report["rewritten"]``), so callers that read reports as dicts — tests,
``offload-inspect`` on a dump — see one schema.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Iterator, Optional

#: fields dropped from ``to_dict()`` while they are None (they apply to some graphs / modes only)
_OPTIONAL = ("frontend", "dense", "specialised", "dynamo", "state_bytes", "buffers", "guards", "hf", "reinplace",
             "state_per_caches", "side_stream", "bookkeeping", "joins_before", "bookkeeping_nodes_removed", "cold_resets")


@dataclass(eq=False)
class GraphReport(Mapping):
    graph_id: str
    mode: str
    options: dict
    rewritten: bool = False
    frontend: Optional[str] = None  # "recipe" | "hf": which front-end detected the sites
    groups: list = field(default_factory=list)
    sites: list = field(default_factory=list)
    layer_nodes: dict = field(default_factory=lambda: {"before": {}, "after": {}})
    ops: dict = field(default_factory=lambda: {"before": {}, "after": {}})
    state: list = field(default_factory=list)
    refusals: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    passes: list = field(default_factory=list)
    detect: dict = field(default_factory=dict)
    state_bytes: Optional[int] = None
    buffers: Optional[dict] = None
    guards: Optional[list] = None
    dense: Optional[dict] = None  # {"reason", "detail"}: left dense by design (a prefill), not a refusal
    specialised: Optional[dict] = None  # symbolic site sizes made concrete with guards: {dim: {symbol, value}}
    dynamo: Optional[dict] = None  # Dynamo's compile id for the frame and its recompile limit
    hf: Optional[dict] = None  # HF front-end facts (form, sites, offload, erased nodes, masks left)
    reinplace: Optional[dict] = None  # CPU lowerings: the reinplace pass's report ({"cached": True} on a warm cache)
    state_per_caches: Optional[bool] = None  # state chosen per call by the caches (True) or graph buffers
    side_stream: Optional[bool] = None  # NPU / CUDA lowerings
    bookkeeping: Optional[bool] = None
    joins_before: Optional[list] = None
    bookkeeping_nodes_removed: Optional[int] = None
    # rewritten graphs: how often the stale-state rule reset the pools before a call (state.StateBinder)
    cold_resets: Optional[int] = None

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None and f.name in _OPTIONAL:
                continue
            out[f.name] = v
        return out

    # -- read-only Mapping over to_dict() ---------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        if key in _FIELD_NAMES:
            v = getattr(self, key)
            if v is None and key in _OPTIONAL:
                raise KeyError(key)
            return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


_FIELD_NAMES = frozenset(f.name for f in fields(GraphReport))

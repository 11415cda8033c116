"""Pass 1 — detect DSA sites from data flow: top-k producer → (views) → gather → SFA.

A site is one ``custom.npu_gather_selection_kv_cache`` call whose ``selection_topk_indices`` comes
(through views only) from output 0 of a lightning indexer, and whose result and selection buffers feed
one sparse-flash-attention call (``actual_seq_lengths_kv`` = the gather's result, ``key`` / ``key_rope``
/ ``block_table`` = the gather's selection buffers). Anything else touching the gather is a refusal.
Layers are numbered by the order of sites in the graph; module names are never read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import fx

from ._fx import ancestors, bind, getitem_of, is_op, op_name, strip_views, view_users

GATHER = "npu_gather_selection_kv_cache"
INDEXER = "npu_lightning_indexer"
SFA = "npu_sparse_flash_attention"


@dataclass
class Refusal:
    reason: str
    detail: str
    layer: Optional[int] = None

    def to_dict(self) -> dict:
        return {"reason": self.reason, "detail": self.detail, "layer": self.layer}


@dataclass
class Site:
    layer: int
    gather: fx.Node
    sfa: fx.Node
    producer: fx.Node  # the indexer call
    topk: fx.Node  # the tensor the gather received (e.g. topk.view(B, S, 1, K))
    args: dict[str, Any] = field(repr=False)  # bound gather arguments
    sfa_args: dict[str, Any] = field(repr=False)


@dataclass
class DetectReport:
    sites: list[Site]
    gathers: int  # gather calls seen (sites + refused)
    indexers: list[str]  # names of lightning-indexer nodes
    other_topk: list[str]  # other top-k producers (torch.topk ...), never DSA producers
    refusals: list[Refusal]

    @property
    def has_dsa(self) -> bool:
        return self.gathers > 0


def _is_topk_other(n: fx.Node) -> bool:
    if n.op == "call_method" and n.target == "topk":
        return True
    if n.op == "call_function" and getattr(n.target, "__name__", "") == "topk":
        return True
    name = op_name(n)
    return name is not None and name.endswith("::topk")


def _find_sfa(gather: fx.Node, b: dict[str, Any]) -> tuple[Optional[fx.Node], str]:
    sel_kv, sel_rope, sel_table = b["selection_kv_cache"], b["selection_k_rope"], b["selection_kv_block_table"]
    candidates = [u for u in view_users(gather) if is_op(u, SFA)]
    why = "no sparse-flash-attention consumes the gather's actual_seq"
    for u in candidates:
        s = bind(u)
        if strip_views(s["actual_seq_lengths_kv"]) is not gather:
            why = f"{u.name}: actual_seq_lengths_kv is not the gather's result"
            continue
        if strip_views(s["key"]) is not sel_kv or strip_views(s["key_rope"]) is not sel_rope:
            why = f"{u.name}: key/key_rope are not the gather's selection buffers"
            continue
        if strip_views(s["block_table"]) is not sel_table:
            why = f"{u.name}: block_table is not the gather's selection block table"
            continue
        si = s["sparse_indices"]
        if not isinstance(si, fx.Node) or gather not in ancestors(si):
            why = f"{u.name}: sparse_indices are not derived from the gather's result"
            continue
        return u, ""
    if len(candidates) > 1:
        why = f"{len(candidates)} attention calls read the gather's result"
    return None, why


def detect(gm: fx.GraphModule) -> DetectReport:
    sites: list[Site] = []
    refusals: list[Refusal] = []
    gathers = 0
    indexers: list[str] = []
    other: list[str] = []
    # one walk over the graph; per site only its local neighbourhood is visited (linear in graph size)
    for n in gm.graph.nodes:
        if is_op(n, INDEXER):
            indexers.append(n.name)
            continue
        if _is_topk_other(n):
            other.append(n.name)
            continue
        if not is_op(n, GATHER, ("custom",)):
            continue
        layer = gathers
        gathers += 1
        b = bind(n)
        topk = b["selection_topk_indices"]
        root = strip_views(topk)
        gi = getitem_of(root)
        if gi is None or gi[1] != 0 or not is_op(gi[0], INDEXER):
            what = op_name(root) or getattr(root, "target", root)
            refusals.append(Refusal("unknown_topk_producer",
                                    f"{n.name}: top-k indices come from {what!s}, not a lightning indexer", layer))
            continue
        sfa, why = _find_sfa(n, b)
        if sfa is None:
            refusals.append(Refusal("site_not_verified", f"{n.name}: {why}", layer))
            continue
        sites.append(Site(layer, n, sfa, gi[0], topk, b, bind(sfa)))
    return DetectReport(sites, gathers, indexers, other, refusals)

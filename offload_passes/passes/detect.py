"""Pass 1 — detect DSA sites from data flow: top-k producer → (views) → gather → SFA.

A site is one ``custom.npu_gather_selection_kv_cache`` call whose ``selection_topk_indices`` comes
(through views only) from the ids of a top-k producer of ``producers.TOPK_PRODUCERS`` (output 0 of
``npu_lightning_indexer``, the single output of ``npu_quant_lightning_indexer``; any namespace), and
whose result and selection buffers feed one sparse-flash-attention call (``actual_seq_lengths_kv`` =
the gather's result, ``key`` / ``key_rope`` / ``block_table`` = the gather's selection buffers). Anything else touching the gather is a refusal.
Layers are numbered by the order of sites in the graph; module names are never read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import fx

from ._fx import ancestors, bind, example, is_op, op_name, strip_views, view_users
from .producers import PRODUCER_NAMES, producer_of_call, topk_source

GATHER = "npu_gather_selection_kv_cache"
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
    producer: fx.Node  # the top-k producer call (an indexer op of producers.TOPK_PRODUCERS)
    topk: fx.Node  # the tensor the gather received (e.g. topk.view(B, S, 1, K))
    args: dict[str, Any] = field(repr=False)  # bound gather arguments
    sfa_args: dict[str, Any] = field(repr=False)


@dataclass
class DetectReport:
    sites: list[Site]
    gathers: int  # gather calls seen (sites + refused)
    indexers: list[str]  # names of top-k producer (indexer) nodes, any kind of producers.TOPK_PRODUCERS
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


def _same(a: Any, b: Any) -> bool:
    """``a`` (through views) is the tensor ``b``: the same node, or two reads of the same module attribute
    (FX and Dynamo without inlined nn modules emit one ``get_attr`` node per read)."""
    a, b = strip_views(a), strip_views(b)
    if a is b:
        return True
    return (isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.op == b.op == "get_attr"
            and a.target == b.target)


def _find_sfa(gather: fx.Node, b: dict[str, Any]) -> tuple[Optional[fx.Node], str]:
    sel_kv, sel_rope, sel_table = b["selection_kv_cache"], b["selection_k_rope"], b["selection_kv_block_table"]
    candidates = [u for u in view_users(gather) if is_op(u, SFA)]
    why = "no sparse-flash-attention consumes the gather's actual_seq"
    for u in candidates:
        s = bind(u)
        if strip_views(s["actual_seq_lengths_kv"]) is not gather:
            why = f"{u.name}: actual_seq_lengths_kv is not the gather's result"
            continue
        sr = example(sel_rope)
        no_rope = s["key_rope"] is None and sr is not None and sr.dim() == 1  # the gather's no-rope mode
        if not _same(s["key"], sel_kv) or (not no_rope and not _same(s["key_rope"], sel_rope)):
            why = f"{u.name}: key/key_rope are not the gather's selection buffers"
            continue
        if not _same(s["block_table"], sel_table):
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
        if producer_of_call(n) is not None:
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
        producer = topk_source(root)
        if producer is None:
            what = op_name(root) or getattr(root, "target", root)
            refusals.append(Refusal("unknown_topk_producer",
                                    f"{n.name}: top-k indices come from {what!s}, not a lightning indexer "
                                    f"({', '.join(sorted(PRODUCER_NAMES))})", layer))
            continue
        kv = example(b["full_kv_cache"])
        if kv is not None and kv.dtype not in (torch.float16, torch.bfloat16):
            # checked before the attention: a quantised cache is dequantised (or read by a quantised
            # attention op) on its way to attention, and that is not what makes the site unfit
            refusals.append(Refusal("quantised_kv", f"{n.name}: full_kv_cache dtype {kv.dtype}: only unquantised "
                                    f"float16/bfloat16 KV is offloaded (int8 KV keeps the gather path)", layer))
            continue
        sfa, why = _find_sfa(n, b)
        if sfa is None:
            refusals.append(Refusal("site_not_verified", f"{n.name}: {why}", layer))
            continue
        sites.append(Site(layer, n, sfa, producer, topk, b, bind(sfa)))
    return DetectReport(sites, gathers, indexers, other, refusals)

"""What the Hugging Face detection verifies a site with: the site record and the small checks every mask
form's walk uses (an argument by position or name, casts and views stripped, a failed check).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import fx

from ..._fx import calls, example, is_cast, is_view
from ...refusal import Refusal

__all__ = ["HfSite", "NotVerified", "Refused", "need", "arg", "strip_casts", "shape", "device_move", "input_root",
           "concatenated_cache", "past_input"]


@dataclass
class HfSite:
    layer: int
    producer: fx.Node  # getitem(topk, 1): the shared top-k node (group key)
    topk: fx.Node  # the index tensor the scatter received, before ``.long()`` (int32 [B, S, K])
    scatter: fx.Node
    combine: fx.Node  # masked_fill (eager) / and_ (sdpa): the dense combined mask
    attn: fx.Node  # dense attention output [B, H, S, v]
    kind: str  # "eager" | "sdpa"
    query: fx.Node  # [B, H, S, n + r]
    latent: fx.Node  # latent cache graph input [B, 1, T, C]
    rope: fx.Node  # rope key cache graph input [B, 1, T, r]
    weight: fx.Node  # kv_b_proj weight [H * (n + v), C]
    base_mask: Optional[fx.Node]  # causal / padding mask before the top-k mask, [B|1, 1, S, T]; None: the
    # selection is the whole mask (count-mask form: the indexer already applied causality and padding)
    scaling: float
    dims: dict[str, int] = field(default_factory=dict)  # B S T K H C R n v
    dtype: Optional[torch.dtype] = None
    sinks: Optional[fx.Node] = None  # eager attention with one sink logit per head ([H] parameter)
    softmax_dtype: Optional[torch.dtype] = None  # the dtype the model's eager softmax runs in (None: its input's)
    dedup: bool = False  # count-mask form: ids are not proven distinct, a repeated id counts once (set semantics)
    #: a cache grown by concatenation (a ``DynamicCache``): ``latent`` / ``rope`` are this step's ``cat`` nodes
    grown: bool = False
    #: a grown cache's past: the graph inputs (latent, rope) the ``cat`` nodes extend; None when it grows from
    #: an empty tensor (the first update) or is not grown
    past: Optional[tuple[Any, Any]] = None

    @property
    def anchor(self) -> fx.Node:
        """The dense attention: the sparse one replaces it, the group's plan goes before the owner's."""
        return self.attn

    def to_dict(self) -> dict:
        return {"layer": self.layer, "kind": self.kind, "topk_node": self.producer.name, "attn_node": self.attn.name,
                "latent": self.latent.name, "rope": self.rope.name, "sinks": self.sinks is not None,
                "mask": "selection" if self.base_mask is None else "base",
                **({"cache": "grown"} if self.grown else {}), **{k: _plain(v) for k, v in self.dims.items()}}


def _plain(v: Any) -> Any:
    """A size as a report shows it: an int, or a symbolic size as its expression."""
    return v if isinstance(v, int) else str(v)


def arg(n: fx.Node, i: int, name: str, default: Any = None) -> Any:
    if name in n.kwargs:
        return n.kwargs[name]
    return n.args[i] if len(n.args) > i else default


def strip_casts(n: Any) -> Any:
    while isinstance(n, fx.Node) and is_cast(n):
        n = n.args[0]
    return n


def shape(n: Any) -> Optional[tuple]:
    ex = example(n)
    return tuple(ex.shape) if ex is not None else None


def device_move(n: Any) -> bool:
    """``x.to(device)``: same shape, dtype and values on another device (a host-KV cache's update hands the
    dense attention device copies of its host caches, ``offload_passes/hf_cache.py``)."""
    if not (isinstance(n, fx.Node) and (calls(n, "to") or calls(n, "_to_copy")) and n.args):
        return False
    a, b = example(n.args[0]), example(n)
    return (a is not None and b is not None and a.device != b.device and a.dtype == b.dtype
            and tuple(a.shape) == tuple(b.shape))


def input_root(n: Any) -> Any:
    """The graph input behind views / expands / device copies (the cache tensors are Dynamo placeholders)."""
    while isinstance(n, fx.Node) and (is_view(n) or calls(n, "expand") or device_move(n)):
        n = n.args[0]
    return n


def concatenated_cache(n: Any) -> Optional[fx.Node]:
    """The ``cat`` that makes the cache ``n`` reads, when ``n`` is a cache grown by concatenation this step:
    ``torch.cat([past, new rows], dim=-2)`` with ``past`` a graph input or an empty tensor (the first update);
    what a ``DynamicCache`` layer's ``update`` traces to. None for anything else (a ``StaticCache`` input)."""
    n = input_root(n)
    if not (calls(n, "cat") and n.args and isinstance(n.args[0], (list, tuple)) and len(n.args[0]) == 2):
        return None
    dim = arg(n, 1, "dim", 0)
    past = n.args[0][0]
    rank = len(shape(n) or ())
    if rank < 2 or dim not in (-2, rank - 2) or not isinstance(past, fx.Node):
        return None
    root, ex = input_root(past), example(past)
    return n if root.op in ("placeholder", "get_attr") or (ex is not None and ex.numel() == 0) else None


def past_input(cat: fx.Node) -> Optional[fx.Node]:
    """The graph input a concatenated cache (:func:`concatenated_cache`) extends; None for an empty start."""
    root = input_root(cat.args[0][0])
    return root if isinstance(root, fx.Node) and root.op in ("placeholder", "get_attr") else None


class NotVerified(Exception):
    pass


class Refused(NotVerified):
    """A verified DSA form the offload cannot apply to: refused with a named reason, not ``hf_site_not_verified``."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.detail)
        self.refusal = refusal


def need(cond: bool, why: str) -> None:
    if not cond:
        raise NotVerified(why)

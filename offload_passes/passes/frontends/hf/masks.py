"""The top-k mask forms of transformers' DSA families, each verified from its scatter to the attention it
feeds: the bool scatter mask (``GlmMoeDsa``), the count mask (``glm5_next``)
and the block bias over computed entries (``deepseek_v4``, refused by name).
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch import fx

from ..._fx import calls, example, getitem_of, is_cast, is_view, strip_views, view_users
from ...refusal import Refusal
from .dense import finish_site
from .verify import HfSite, NotVerified, Refused, arg, need, shape, strip_casts

__all__ = ["scatter_mask_site", "count_mask_site", "block_bias_site", "is_block_bias", "is_int_fresh"]


def scatter_mask_site(layer: int, sc: fx.Node) -> HfSite:
    base_ones, dim, index = sc.args[0], arg(sc, 1, "dim"), arg(sc, 2, "index")
    value = arg(sc, 3, "value", arg(sc, 3, "src"))
    need(dim in (-1, 2) and value in (False, 0), f"{sc.name}: not scatter(-1, idx, False)")
    need(calls(base_ones, "new_ones") or calls(base_ones, "ones"),
          f"{sc.name}: scatter target is not a ones mask")
    ex = example(base_ones)
    need(ex is not None and ex.dtype == torch.bool, f"{sc.name}: scatter target is not boolean")
    need(isinstance(index, fx.Node), f"{sc.name}: scatter index is not a tensor")
    producer = strip_casts(index)
    topk = index  # the int32 top-k the model hands between layers (else the raw indices)
    while topk is not producer and not (example(topk) is not None and example(topk).dtype == torch.int32):
        topk = topk.args[0]
    gi = getitem_of(producer)
    need(gi is not None and gi[1] == 1 and calls(gi[0], "topk"),
          f"{sc.name}: scatter indices do not come from topk(...)[1] (got {producer})")
    tk = topk
    # index_mask users: masked_fill(base, index_mask, min) | base & ~index_mask
    users = view_users(sc)
    need(len(users) == 1, f"{sc.name}: the index mask has {len(users)} consumers, expected 1")
    u = users[0]
    if calls(u, "masked_fill"):
        base = u.args[0]
        need(strip_views(u.args[1]) is sc, f"{u.name}: index mask is not the fill mask")
        need(isinstance(u.args[2], float) and u.args[2] < -1e30, f"{u.name}: fill value is not the dtype minimum")
        combine, kind_mask = u, "additive"
    elif u.op == "call_function" and u.target in (operator.invert, torch.bitwise_not, torch.logical_not):
        us = list(u.users)
        need(len(us) == 1 and us[0].op == "call_function" and us[0].target in (operator.and_, torch.logical_and,
                                                                               torch.bitwise_and),
              f"{u.name}: inverted index mask is not and-ed into the attention mask")
        combine = us[0]
        base = combine.args[0] if combine.args[1] is u else combine.args[1]
        kind_mask = "bool"
    else:
        raise NotVerified(f"{u.name}: index mask is consumed by {u.target}, not masked_fill / and")
    need(isinstance(base, fx.Node), f"{combine.name}: base mask is not a tensor")
    return finish_site(layer, producer, tk, sc, combine, base, kind_mask, False)


def is_int_fresh(n: Any) -> bool:
    ex = example(n)
    return ((calls(n, "zeros") or calls(n, "new_zeros")) and ex is not None
            and not ex.dtype.is_floating_point and ex.dtype != torch.bool)


def has_topk_ancestor(n: fx.Node, limit: int = 400) -> bool:
    """A ``topk`` among the first ``limit`` ancestors (breadth first): the ids are a top-k selection."""
    seen, todo, i = {n}, [n], 0
    while i < len(todo) and i < limit:
        x = todo[i]
        i += 1
        if calls(x, "topk"):
            return True
        for a in x.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return False


def _is_cmp(n: Any, names: tuple[str, ...], ops: tuple) -> bool:
    return isinstance(n, fx.Node) and (any(calls(n, m) for m in names)
                                       or (n.op == "call_function" and n.target in ops))


def count_mask_site(layer: int, sa: fx.Node) -> HfSite:
    """The count-mask form (glm5_next): ``counts = zeros(B, S, T, int).scatter_add_(-1, ids.clamp(0, T-1),
    ((ids >= 0) & (ids < T)).int())``; ``mask = counts.ne(0).unsqueeze(1)`` is the whole attention mask
    (sdpa) or becomes ``where(mask, 0, min)`` (eager). The mask is the set of valid ids; nothing proves the
    ids distinct, so the sparse attention counts a repeated id once."""
    counts, dim, index = sa.args[0], arg(sa, 1, "dim"), arg(sa, 2, "index")
    need(dim in (-1, 2), f"{sa.name}: not a scatter_add over the key axis")
    need(isinstance(index, fx.Node) and calls(index, "clamp"), f"{sa.name}: index is not ids.clamp(0, T-1)")
    ids = index.args[0]
    T = shape(counts)[-1] if shape(counts) else None
    lo, hi = arg(index, 1, "min"), arg(index, 2, "max")
    need(T is not None and lo == 0 and hi == T - 1, f"{index.name}: clamp({lo}, {hi}) is not clamp(0, T - 1)")
    _added_validity(sa, ids, T)
    combine, kind_mask = _count_mask_use(_counts_read_once(counts, sa))
    ex = example(ids)
    need(ex is not None and not ex.dtype.is_floating_point, f"{sa.name}: ids are not integers")
    need(has_topk_ancestor(ids), f"{sa.name}: ids do not descend from a topk")
    return finish_site(layer, ids, ids, sa, combine, None, kind_mask, True)


def _added_validity(sa: fx.Node, ids: fx.Node, T: int) -> None:
    """The values ``sa`` adds are the ids' validity ``(ids >= 0) & (ids < T)`` as integers: each valid id
    adds one, an invalid one nothing."""
    va = strip_casts(arg(sa, 3, "src"))
    need(_is_cmp(va, ("and_", "logical_and", "bitwise_and", "__and__"), (operator.and_, torch.logical_and)),
         f"{sa.name}: added values are not the ids' validity")
    a, b = va.args[0], va.args[1]
    ge = a if _is_cmp(a, ("ge",), (operator.ge, torch.ge)) else b
    lt = b if ge is a else a
    need(_is_cmp(ge, ("ge",), (operator.ge, torch.ge)) and ge.args[0] is ids and ge.args[1] == 0
         and _is_cmp(lt, ("lt",), (operator.lt, torch.lt)) and lt.args[0] is ids and lt.args[1] == T,
         f"{va.name}: added values are not (ids >= 0) & (ids < T)")


def _counts_read_once(counts: fx.Node, sa: fx.Node) -> fx.Node:
    """The counts are written only by ``sa`` and read by one ``ne(0)`` after it; returns that read."""
    readers = [u for u in counts.users if u is not sa]
    need(len(readers) == 1 and calls(readers[0], "ne") and readers[0].args[1] == 0,
         f"{counts.name}: the counts are read by {[u.name for u in readers]}, expected one ne(0)")
    ne = readers[0]
    after = sa.next  # the read comes after the write (a walk forward over the nodes in between)
    while after is not ne and after.op != "root":
        after = after.next
    need(after is ne, f"{ne.name}: reads the counts before they are written")
    return ne


def _count_mask_use(ne: fx.Node) -> tuple[fx.Node, str]:
    """What the selection mask ``ne`` becomes: the bool mask itself (sdpa), or ``where(mask, 0, min)``
    (eager, additive); returns the combined mask and its kind."""
    users = view_users(ne)
    need(len(users) == 1, f"{ne.name}: the selection mask has {len(users)} consumers, expected 1")
    u = users[0]
    if not calls(u, "where"):
        return ne, "bool"
    need(strip_views(u.args[0]) is ne, f"{u.name}: the selection mask is not the where condition")
    zero, fill = u.args[1], u.args[2]
    zex = example(zero) if isinstance(zero, fx.Node) else None
    need((zero == 0 if not isinstance(zero, fx.Node) else (calls(zero, "full") and zero.args[1] == 0.0
                                                             and zex is not None and zex.numel() == 1)),
         f"{u.name}: selected positions do not get 0")
    need(isinstance(fill, float) and fill < -1e30, f"{u.name}: other positions do not get the dtype minimum")
    return u, "additive"


def is_block_bias(n: fx.Node) -> bool:
    """``x.new_full(shape, -inf).scatter_(-1, ids, 0.0)``: an additive float mask opened at the selected ids."""
    if not n.args or len(n.args) < 4 and "value" not in n.kwargs:
        return False
    tgt, value = n.args[0], arg(n, 3, "value", arg(n, 3, "src"))
    if not (isinstance(tgt, fx.Node) and (calls(tgt, "new_full") or calls(tgt, "full"))):
        return False
    fill = arg(tgt, 2 if tgt.op == "call_method" else 1, "fill_value")
    ex = example(tgt)
    return (ex is not None and ex.dtype.is_floating_point and isinstance(fill, float) and fill < -1e30
            and value == 0.0)


def _block_expansion(u: fx.Node) -> Optional[int]:
    """``(bias == 0).repeat_interleave(block_size, dim=-1)``: the block mask compared back to a bool and
    widened to token positions (minimax_m3_vl's block top-k); the block size, else None."""
    # torch 2.8 / 2.10 trace ``bias == 0`` as ``Tensor.__eq__``, later ones as ``eq``
    if not (calls(u, "eq") or calls(u, "__eq__") or (u.op == "call_function" and u.target in (operator.eq, torch.eq))):
        return None
    for w in u.users:
        while w is not None and (is_view(w) or is_cast(w)) and len(w.users) == 1:
            w = next(iter(w.users))
        if w is not None and calls(w, "repeat_interleave"):
            reps = arg(w, 1, "repeats")
            return reps if isinstance(reps, int) else None
    return None


def block_bias_site(layer: int, sc: fx.Node) -> HfSite:
    """The block-bias form (deepseek_v4's compressed sparse attention): the indexer's top-k picks among
    compressed KV entries that the graph itself computes and concatenates after the sliding-window cache.
    Verified up to the key the scores are taken against; then refused by name: no cache graph input holds
    the selected rows, so there is nothing to serve from a host copy."""
    index = arg(sc, 2, "index")
    need(isinstance(index, fx.Node) and has_topk_ancestor(index), f"{sc.name}: ids do not descend from a topk")
    mask, hops = sc.args[0], 0
    while True:  # slices / casts / the concatenation with the window's mask, then the scores' add
        users = [u for u in mask.users if u is not sc]
        need(len(users) == 1 and hops < 6, f"{mask.name}: the block mask has {len(users)} consumers")
        u = users[0]
        hops += 1
        if u.op == "call_function" and u.target in (operator.add, torch.add):
            break
        blocks = _block_expansion(u)
        if blocks is not None:
            raise Refused(Refusal("block_topk", f"the indexer selects blocks of {blocks} keys per indexer head "
                                  "(a top-k over key blocks, widened to a per-head token mask): the offload serves "
                                  "one selection of single key rows per query, shared by every head, from a latent "
                                  "(MLA) cache; this model would need a block-granular plan with one selection per "
                                  "KV head over its K / V caches. The dense attention stays", layer))
        need(is_view(u) or is_cast(u) or calls(u, "to") or calls(u, "cat")
              or (u.op == "call_function" and u.target is operator.getitem),
              f"{u.name}: the block mask is consumed by {getattr(u.target, '__name__', u.target)}")
        mask = u
    other = u.args[0] if u.args[1] is mask else u.args[1]
    need(isinstance(other, fx.Node) and other.op == "call_function" and other.target in (operator.mul, torch.mul)
          and calls(other.args[0], "matmul"), f"{u.name}: scores are not matmul * scaling")
    kt = other.args[0].args[1]
    need(calls(kt, "transpose"), f"{other.name}: key is not transposed")
    key = kt.args[0]
    while isinstance(key, fx.Node) and (is_view(key) or calls(key, "expand")
                                        or (key.op == "call_function" and key.target is operator.getitem)):
        key = key.args[0]
    if calls(key, "cat"):
        raise Refused(Refusal("hf_compressed_kv", f"{sc.name}: the top-k selects among KV entries computed in this "
                              f"graph ({key.name} = cat of the cache and compressed entries), not rows of a cache "
                              "graph input: there is no host copy to serve them from; the dense attention stays",
                              layer))
    raise NotVerified(f"{sc.name}: block-bias top-k mask over {key}: form not verified")

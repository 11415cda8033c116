"""Pass 1 (Hugging Face form, ``frontends/hf/``) — detect the dense DSA patterns of ``transformers``' DSA families.

``GlmMoeDsaForCausalLM`` (transformers 5.23) writes DSA densely, per layer:

    topk = index_scores.topk(K, dim=-1)[1].to(int32)                 # full layers; shared layers reuse the node
    index_mask = ones(B, S, T, bool).scatter(-1, topk.long(), False).unsqueeze(1)
    mask = base.masked_fill(index_mask, min)      (eager)  |  base & ~index_mask   (sdpa)
    kv = kv_b_proj(latent_cache[B,1,T,C]).view(B,T,H,n+v).transpose(1,2); k_nope, v = kv.split([n, v])
    key = new_empty(B,H,T,n+r); key[..., :n] = k_nope; key[..., n:] = rope_cache[B,1,T,r].expand(...)
    out = softmax(q @ keyᵀ * scale + mask) @ v    (eager)  |  sdpa(q, key, v, attn_mask=mask, scale=scale)

A site is one such layer, verified end to end on the Dynamo graph (data flow only; module names are
never read): the scatter's index comes from output 1 of a ``topk`` through integer casts, the
combined mask feeds exactly one attention whose key / value are the ``kv_b_proj`` expansion of a
latent cache graph input and whose rope key is a rope cache graph input. Sites are numbered in graph
order; the grouping key (``producer``) is the top-k node itself, so ``group.group`` applies as is.
Anything that looks like the pattern but fails a check is a ``Refusal`` naming the node and why.

The other DSA families of transformers 5.23 (docs/hf.md, "Model families") vary this in ways the same
walk verifies:

* **sinks** (``hy_v4``): the eager scores get one learnt logit per head as an extra column,
  ``cat([scores, sinks]) - max -> softmax -> [..., :-1]``; the site records the sink parameter.
* **count mask** (``glm5_next``'s pooled indexer): ``zeros(B, S, T, int).scatter_add_(-1, ids.clamp(0,
  T-1), valid(ids)).ne(0)`` is the whole mask (the indexer applied causality itself; no base mask), the
  ids descend from a ``topk`` through the pool expansion and are the grouping key.
* **block bias over computed entries** (``deepseek_v4``): ``new_full(-inf).scatter_(-1, ids, 0.0)`` added
  to scores against a key concatenated in the graph (cache + compressed entries): no cache input holds
  the selected rows, refused as ``hf_compressed_kv``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import fx

from ..._fx import calls, example, getitem_of, is_cast, is_graph_input_or_attr, is_view, strip_views, view_users
from ...refusal import Refusal

__all__ = ["HfSite", "HfDetectReport", "detect_hf"]


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

    def to_dict(self) -> dict:
        return {"layer": self.layer, "kind": self.kind, "topk_node": self.producer.name, "attn_node": self.attn.name,
                "latent": self.latent.name, "rope": self.rope.name, "sinks": self.sinks is not None,
                "mask": "selection" if self.base_mask is None else "base", **self.dims}


@dataclass
class HfDetectReport:
    sites: list[HfSite]
    candidates: int  # scatter-masks seen (sites + refused)
    topk_nodes: list[str]
    refusals: list[Refusal]

    @property
    def has_dsa(self) -> bool:
        return self.candidates > 0

    @property
    def gathers(self) -> int:  # the backend's "has DSA" counter
        return self.candidates


def _arg(n: fx.Node, i: int, name: str, default: Any = None) -> Any:
    if name in n.kwargs:
        return n.kwargs[name]
    return n.args[i] if len(n.args) > i else default


def _strip_casts(n: Any) -> Any:
    while isinstance(n, fx.Node) and is_cast(n):
        n = n.args[0]
    return n


def _shape(n: Any) -> Optional[tuple]:
    ex = example(n)
    return tuple(ex.shape) if ex is not None else None


def _device_move(n: Any) -> bool:
    """``x.to(device)``: same shape, dtype and values on another device (a host-KV cache's update hands the
    dense attention device copies of its host caches, ``offload_passes/hf_cache.py``)."""
    if not (isinstance(n, fx.Node) and (calls(n, "to") or calls(n, "_to_copy")) and n.args):
        return False
    a, b = example(n.args[0]), example(n)
    return (a is not None and b is not None and a.device != b.device and a.dtype == b.dtype
            and tuple(a.shape) == tuple(b.shape))


def _input_root(n: Any) -> Any:
    """The graph input behind views / expands / device copies (the cache tensors are Dynamo placeholders)."""
    while isinstance(n, fx.Node) and (is_view(n) or calls(n, "expand") or _device_move(n)):
        n = n.args[0]
    return n


class _Fail(Exception):
    pass


class _Refuse(_Fail):
    """A verified DSA form the offload cannot apply to: refused with a named reason, not ``hf_site_not_verified``."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.detail)
        self.refusal = refusal


def _need(cond: bool, why: str) -> None:
    if not cond:
        raise _Fail(why)


def _split_parts(split_node: fx.Node) -> tuple[fx.Node, list[int]]:
    src = split_node.args[0]
    sizes = _arg(split_node, 1, "split_size_or_sections", None)
    if sizes is None:
        sizes = _arg(split_node, 1, "split_size", None)
    dim = _arg(split_node, 2, "dim", 0)
    _need(isinstance(sizes, (list, tuple)) and len(sizes) == 2 and dim in (-1, 3),
          f"{split_node.name}: expected a 2-way split on the last dim")
    return src, list(sizes)


def _expansion(key: fx.Node, value: fx.Node) -> dict:
    """Verify key / value are ``expand_kv(latent, rope)``; return latent, rope, weight, n, v."""
    gi_v = getitem_of(value)
    _need(gi_v is not None and gi_v[1] == 1 and calls(gi_v[0], "split"),
          f"value {value.name} is not split(kv_b_proj(latent))[1]")
    split_n = gi_v[0]
    kv, (n_nope, n_v) = _split_parts(split_n)
    _need(calls(kv, "transpose"), f"{kv} is not a transpose of the kv_b_proj output")
    lin = strip_views(kv.args[0])
    _need(calls(lin, "linear") and len(lin.args) >= 2, f"{lin} is not the kv_b_proj linear")
    bias = _arg(lin, 2, "bias", None)
    _need(bias is None, f"{lin.name}: kv_b_proj with a bias is not supported")
    latent, weight = lin.args[0], lin.args[1]
    if _device_move(latent):  # host KV: the site reads (and the offload serves from) the host cache itself
        latent = latent.args[0]
    _need(isinstance(latent, fx.Node) and is_graph_input_or_attr(_input_root(latent)),
          f"{lin.name}: kv_b_proj input {latent} is not the latent cache (a graph input)")
    _need(isinstance(weight, fx.Node) and weight.op in ("placeholder", "get_attr"),
          f"{lin.name}: kv_b_proj weight is not a parameter")
    # key = new_empty(...) whose two slices are filled with k_nope (split[0]) and the expanded rope cache
    _need(calls(key, "new_empty") or calls(key, "empty"), f"key {key.name} is not new_empty(...)")
    nope_src = rope_src = None
    for u in key.users:
        if not (u.op == "call_function" and u.target is operator.getitem):
            continue
        idx = u.args[1]
        sl = idx[-1] if isinstance(idx, tuple) else idx
        _need(isinstance(sl, slice) and sl.step is None, f"{u.name}: unexpected key slice {idx}")
        for w in u.users:
            _need(calls(w, "copy_") and w.args[0] is u, f"{w.name}: unexpected write into the key")
            if sl.start in (None, 0) and sl.stop == n_nope:
                nope_src = w.args[1]
            elif sl.start == n_nope and sl.stop is None:
                rope_src = w.args[1]
    gi_k = getitem_of(nope_src)
    _need(gi_k is not None and gi_k[0] is split_n and gi_k[1] == 0, f"key[..., :{n_nope}] is not split(...)[0]")
    _need(isinstance(rope_src, fx.Node), f"key[..., {n_nope}:] is not written from the rope cache")
    rope = _input_root(rope_src)
    _need(is_graph_input_or_attr(rope), f"rope key {rope_src} is not a graph input")
    return {"latent": latent, "rope": rope, "weight": weight, "n": n_nope, "v": n_v}


def _drops_last(idx: Any) -> bool:
    sl = idx[-1] if isinstance(idx, tuple) else idx
    lead = idx[:-1] if isinstance(idx, tuple) else ()
    return (isinstance(sl, slice) and sl.start is None and sl.stop == -1 and sl.step is None
            and all(x is Ellipsis or x == slice(None) for x in lead))


def _sink_softmax(scores: fx.Node, cat: fx.Node) -> tuple[fx.Node, fx.Node]:
    """Attention sinks (one learnt logit per head, a column the softmax normalises over and that is then
    dropped): ``cat([scores, sinks.reshape(1, H, 1, 1).expand(B, H, S, 1)], -1)``, minus its row max,
    softmax. Returns (the sink parameter ``[H]``, the softmax)."""
    parts = _arg(cat, 0, "tensors")
    _need(isinstance(parts, (list, tuple)) and len(parts) == 2 and parts[0] is scores
          and _arg(cat, 1, "dim", 0) in (-1, 3), f"{cat.name}: not cat([scores, sinks], -1)")
    sink = _input_root(parts[1])
    _need(is_graph_input_or_attr(sink), f"{cat.name}: the extra logit column is not a parameter (sinks)")
    ex = example(sink)
    H = _shape(scores)[1] if _shape(scores) is not None else None
    _need(ex is not None and ex.numel() == H, f"{cat.name}: sinks {None if ex is None else tuple(ex.shape)} "
          f"are not one logit per head ({H})")
    users = list(cat.users)
    subs = [x for x in users if x.op == "call_function" and x.target in (operator.sub, torch.sub)]
    _need(len(users) == 2 and len(subs) == 1 and subs[0].args[0] is cat,
          f"{cat.name}: the logits with sinks are not (x - max) normalised")
    sub = subs[0]
    # x - x.max(-1, keepdim=True).values: a row-constant shift, which the softmax does not see
    mx = [x for x in users if x is not sub][0]
    gi = getitem_of(sub.args[1])
    _need(calls(mx, "max") and gi is not None and gi[0] is mx and gi[1] == 0
          and _arg(mx, 1, "dim", None) in (-1, 3) and _arg(mx, 2, "keepdim", False) is True,
          f"{sub.name}: subtrahend is not the row max")
    us = list(sub.users)
    _need(len(us) == 1 and calls(us[0], "softmax"), f"{sub.name}: expected softmax")
    return sink, us[0]


def _attention(combine: fx.Node) -> tuple:
    """The one attention consuming the combined mask: (kind, out, query, key, value, scaling, sinks,
    softmax dtype)."""
    users = view_users(combine)
    _need(len(users) == 1, f"{combine.name}: the combined mask has {len(users)} consumers, expected 1")
    u = users[0]
    if calls(u, "scaled_dot_product_attention"):
        q, k, v = u.args[:3]
        _need(strip_views(_arg(u, 3, "attn_mask")) is combine, f"{u.name}: attn_mask is not the combined mask")
        _need(_arg(u, 4, "dropout_p", 0.0) == 0.0 and not _arg(u, 5, "is_causal", False),
              f"{u.name}: dropout / is_causal set")
        scale = _arg(u, 6, "scale", None)
        _need(isinstance(scale, float), f"{u.name}: no explicit scale")
        _need(not u.kwargs.get("enable_gqa", False), f"{u.name}: enable_gqa")
        return "sdpa", u, q, k, v, scale, None, None
    # eager: add(mul(matmul(q, key.transpose(2, 3)), s), mask) -> softmax -> to -> dropout -> matmul(., v)
    _need(u.op == "call_function" and u.target in (operator.add, torch.add), f"{u.name}: not an attention")
    other = u.args[0] if u.args[1] is combine else u.args[1]
    _need(isinstance(other, fx.Node) and other.op == "call_function" and other.target in (operator.mul, torch.mul),
          f"{u.name}: scores are not matmul * scaling")
    mm, scale = other.args
    _need(calls(mm, "matmul") and isinstance(scale, float), f"{other.name}: scores are not matmul * scaling")
    q, kt = mm.args
    _need(calls(kt, "transpose") and tuple(kt.args[1:]) in ((2, 3), (-1, -2), (-2, -1), (3, 2)),
          f"{mm.name}: key is not transposed")
    k = kt.args[0]
    us = list(u.users)
    _need(len(us) == 1, f"{u.name}: attention scores have {len(us)} users")
    sinks = None
    if calls(us[0], "cat"):
        sinks, sm = _sink_softmax(u, us[0])
    else:
        sm = us[0]
        _need(calls(sm, "softmax"), f"{sm.name}: expected softmax")
    _need(_arg(sm, 1, "dim", None) in (-1, 3), f"{sm.name}: softmax not over keys")
    sm_dtype = _arg(sm, 2 if sm.op == "call_method" else 3, "dtype", None)
    nxt = sm
    if sinks is not None:  # the sink column is dropped right after the softmax: probs[..., :-1]
        us = list(sm.users)
        _need(len(us) == 1 and us[0].op == "call_function" and us[0].target is operator.getitem
              and _drops_last(us[0].args[1]), f"{sm.name}: the sink column is not dropped after the softmax")
        nxt = us[0]
    while True:  # any order of dtype casts and inactive dropouts, then the value product
        us = list(nxt.users)
        _need(len(us) == 1, f"{nxt.name}: attention weights have {len(us)} users")
        cand = us[0]
        if calls(cand, "to") or calls(cand, "type"):
            nxt = cand
            continue
        if calls(cand, "dropout"):
            _need(_arg(cand, 1, "p", 0.0) == 0.0 or _arg(cand, 2, "training", True) is False,
                  f"{cand.name}: dropout active")
            nxt = cand
            continue
        break
    _need(calls(cand, "matmul") and cand.args[0] is nxt,
          f"{nxt.name}: attention weights are not multiplied by the values")
    out = cand
    return "eager", out, q, k, out.args[1], scale, sinks, sm_dtype


def _site(layer: int, sc: fx.Node) -> HfSite:
    base_ones, dim, index = sc.args[0], _arg(sc, 1, "dim"), _arg(sc, 2, "index")
    value = _arg(sc, 3, "value", _arg(sc, 3, "src"))
    _need(dim in (-1, 2) and value in (False, 0), f"{sc.name}: not scatter(-1, idx, False)")
    _need(calls(base_ones, "new_ones") or calls(base_ones, "ones"),
          f"{sc.name}: scatter target is not a ones mask")
    ex = example(base_ones)
    _need(ex is not None and ex.dtype == torch.bool, f"{sc.name}: scatter target is not boolean")
    _need(isinstance(index, fx.Node), f"{sc.name}: scatter index is not a tensor")
    producer = _strip_casts(index)
    topk = index  # the int32 top-k the model hands between layers (else the raw indices)
    while topk is not producer and not (example(topk) is not None and example(topk).dtype == torch.int32):
        topk = topk.args[0]
    gi = getitem_of(producer)
    _need(gi is not None and gi[1] == 1 and calls(gi[0], "topk"),
          f"{sc.name}: scatter indices do not come from topk(...)[1] (got {producer})")
    tk = topk
    # index_mask users: masked_fill(base, index_mask, min) | base & ~index_mask
    users = view_users(sc)
    _need(len(users) == 1, f"{sc.name}: the index mask has {len(users)} consumers, expected 1")
    u = users[0]
    if calls(u, "masked_fill"):
        base = u.args[0]
        _need(strip_views(u.args[1]) is sc, f"{u.name}: index mask is not the fill mask")
        _need(isinstance(u.args[2], float) and u.args[2] < -1e30, f"{u.name}: fill value is not the dtype minimum")
        combine, kind_mask = u, "additive"
    elif u.op == "call_function" and u.target in (operator.invert, torch.bitwise_not, torch.logical_not):
        us = list(u.users)
        _need(len(us) == 1 and us[0].op == "call_function" and us[0].target in (operator.and_, torch.logical_and,
                                                                               torch.bitwise_and),
              f"{u.name}: inverted index mask is not and-ed into the attention mask")
        combine = us[0]
        base = combine.args[0] if combine.args[1] is u else combine.args[1]
        kind_mask = "bool"
    else:
        raise _Fail(f"{u.name}: index mask is consumed by {u.target}, not masked_fill / and")
    _need(isinstance(base, fx.Node), f"{combine.name}: base mask is not a tensor")
    return _finish(layer, producer, tk, sc, combine, base, kind_mask, False)


def _finish(layer: int, producer: fx.Node, tk: fx.Node, sc: fx.Node, combine: fx.Node, base: Optional[fx.Node],
            kind_mask: str, dedup: bool) -> HfSite:
    """The attention consuming the combined mask and its key / value expansion, checked shape by shape."""
    kind, out, q, k, v, scale, sinks, sm_dtype = _attention(combine)
    _need((kind == "eager") == (kind_mask == "additive"), f"{out.name}: {kind} attention with a {kind_mask} mask")
    e = _expansion(k, v)
    shapes = {nm: _shape(x) for nm, x in (("q", q), ("lat", e["latent"]), ("rope", e["rope"]), ("w", e["weight"]),
                                           ("tk", tk), ("out", out))}
    _need(all(s is not None for s in shapes.values()), f"{out.name}: tensor shapes unknown")
    B, H, S, D = shapes["q"]
    _need(len(shapes["lat"]) == 4 and shapes["lat"][1] == 1, f"latent cache {shapes['lat']} is not [B, 1, T, C]")
    _, _, T, C = shapes["lat"]
    R = shapes["rope"][-1]
    K = shapes["tk"][-1]
    n, vd = e["n"], e["v"]
    _need(shapes["rope"] == (B, 1, T, R), f"rope cache {shapes['rope']} is not [B, 1, T, r] = {(B, 1, T, R)}")
    _need(shapes["w"] == (H * (n + vd), C), f"kv_b_proj weight {shapes['w']} != {(H * (n + vd), C)}")
    _need(D == n + R, f"query head dim {D} != qk_nope {n} + rope {R}")
    _need(shapes["tk"] == (B, S, K) and K <= T, f"top-k {shapes['tk']} is not [B, S, K<=T] for {(B, S, T)}")
    _need(shapes["out"] == (B, H, S, vd), f"attention output {shapes['out']} != {(B, H, S, vd)}")
    if base is not None:
        bs = _shape(base)
        _need(bs is not None and len(bs) == 4 and bs[1] == 1 and bs[2] == S and bs[3] == T and bs[0] in (1, B),
              f"base mask {bs} is not [B|1, 1, S, T]")
    dt = example(e["latent"]).dtype
    return HfSite(layer, producer, tk, sc, combine, out, kind, q, e["latent"], e["rope"], e["weight"], base,
                  float(scale), {"B": B, "S": S, "T": T, "K": K, "H": H, "C": C, "R": R, "n": n, "v": vd}, dt,
                  sinks, sm_dtype, dedup)


def _is_int_fresh(n: Any) -> bool:
    ex = example(n)
    return ((calls(n, "zeros") or calls(n, "new_zeros")) and ex is not None
            and not ex.dtype.is_floating_point and ex.dtype != torch.bool)


def _has_topk_ancestor(n: fx.Node, limit: int = 400) -> bool:
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


def _count_site(layer: int, sa: fx.Node) -> HfSite:
    """The count-mask form (glm5_next): ``counts = zeros(B, S, T, int).scatter_add_(-1, ids.clamp(0, T-1),
    ((ids >= 0) & (ids < T)).int())``; ``mask = counts.ne(0).unsqueeze(1)`` is the whole attention mask
    (sdpa) or becomes ``where(mask, 0, min)`` (eager). The mask is the set of valid ids; nothing proves the
    ids distinct, so the sparse attention counts a repeated id once."""
    counts, dim, index = sa.args[0], _arg(sa, 1, "dim"), _arg(sa, 2, "index")
    src = _arg(sa, 3, "src")
    _need(dim in (-1, 2), f"{sa.name}: not a scatter_add over the key axis")
    _need(isinstance(index, fx.Node) and calls(index, "clamp"), f"{sa.name}: index is not ids.clamp(0, T-1)")
    ids = index.args[0]
    T = _shape(counts)[-1] if _shape(counts) else None
    lo, hi = _arg(index, 1, "min"), _arg(index, 2, "max")
    _need(T is not None and lo == 0 and hi == T - 1, f"{index.name}: clamp({lo}, {hi}) is not clamp(0, T - 1)")
    # src: the ids' validity (ids >= 0) & (ids < T) as integers: each valid id adds one, an invalid one nothing
    va = _strip_casts(src)
    _need(_is_cmp(va, ("and_", "logical_and", "bitwise_and", "__and__"), (operator.and_, torch.logical_and)),
          f"{sa.name}: added values are not the ids' validity")
    a, b = va.args[0], va.args[1]
    ge = a if _is_cmp(a, ("ge",), (operator.ge, torch.ge)) else b
    lt = b if ge is a else a
    _need(_is_cmp(ge, ("ge",), (operator.ge, torch.ge)) and ge.args[0] is ids and ge.args[1] == 0
          and _is_cmp(lt, ("lt",), (operator.lt, torch.lt)) and lt.args[0] is ids and lt.args[1] == T,
          f"{va.name}: added values are not (ids >= 0) & (ids < T)")
    # the counts tensor: written only by this scatter_add_, read only by ne(0) after it
    readers = [u for u in counts.users if u is not sa]
    _need(len(readers) == 1 and calls(readers[0], "ne") and readers[0].args[1] == 0,
          f"{counts.name}: the counts are read by {[u.name for u in readers]}, expected one ne(0)")
    ne = readers[0]
    after = sa.next  # the read comes after the write (a walk forward over the nodes in between)
    while after is not ne and after.op != "root":
        after = after.next
    _need(after is ne, f"{ne.name}: reads the counts before they are written")
    users = view_users(ne)
    _need(len(users) == 1, f"{ne.name}: the selection mask has {len(users)} consumers, expected 1")
    u = users[0]
    if calls(u, "where"):
        _need(strip_views(u.args[0]) is ne, f"{u.name}: the selection mask is not the where condition")
        zero, fill = u.args[1], u.args[2]
        zex = example(zero) if isinstance(zero, fx.Node) else None
        _need((zero == 0 if not isinstance(zero, fx.Node) else (calls(zero, "full") and zero.args[1] == 0.0
                                                                  and zex is not None and zex.numel() == 1)),
              f"{u.name}: selected positions do not get 0")
        _need(isinstance(fill, float) and fill < -1e30, f"{u.name}: other positions do not get the dtype minimum")
        combine, kind_mask = u, "additive"
    else:
        combine, kind_mask = ne, "bool"
    ex = example(ids)
    _need(ex is not None and not ex.dtype.is_floating_point, f"{sa.name}: ids are not integers")
    _need(_has_topk_ancestor(ids), f"{sa.name}: ids do not descend from a topk")
    return _finish(layer, ids, ids, sa, combine, None, kind_mask, True)


def _is_block_bias(n: fx.Node) -> bool:
    """``x.new_full(shape, -inf).scatter_(-1, ids, 0.0)``: an additive float mask opened at the selected ids."""
    if not n.args or len(n.args) < 4 and "value" not in n.kwargs:
        return False
    tgt, value = n.args[0], _arg(n, 3, "value", _arg(n, 3, "src"))
    if not (isinstance(tgt, fx.Node) and (calls(tgt, "new_full") or calls(tgt, "full"))):
        return False
    fill = _arg(tgt, 2 if tgt.op == "call_method" else 1, "fill_value")
    ex = example(tgt)
    return (ex is not None and ex.dtype.is_floating_point and isinstance(fill, float) and fill < -1e30
            and value == 0.0)


def _block_expansion(u: fx.Node) -> Optional[int]:
    """``(bias == 0).repeat_interleave(block_size, dim=-1)``: the block mask compared back to a bool and
    widened to token positions (minimax_m3_vl's block top-k); the block size, else None."""
    if not (calls(u, "eq") or (u.op == "call_function" and u.target in (operator.eq, torch.eq))):
        return None
    for w in u.users:
        while w is not None and (is_view(w) or is_cast(w)) and len(w.users) == 1:
            w = next(iter(w.users))
        if w is not None and calls(w, "repeat_interleave"):
            reps = _arg(w, 1, "repeats")
            return reps if isinstance(reps, int) else None
    return None


def _block_bias_site(layer: int, sc: fx.Node) -> HfSite:
    """The block-bias form (deepseek_v4's compressed sparse attention): the indexer's top-k picks among
    compressed KV entries that the graph itself computes and concatenates after the sliding-window cache.
    Verified up to the key the scores are taken against; then refused by name: no cache graph input holds
    the selected rows, so there is nothing to serve from a host copy (docs/hf.md, "DSA families")."""
    index = _arg(sc, 2, "index")
    _need(isinstance(index, fx.Node) and _has_topk_ancestor(index), f"{sc.name}: ids do not descend from a topk")
    mask, hops = sc.args[0], 0
    while True:  # slices / casts / the concatenation with the window's mask, then the scores' add
        users = [u for u in mask.users if u is not sc]
        _need(len(users) == 1 and hops < 6, f"{mask.name}: the block mask has {len(users)} consumers")
        u = users[0]
        hops += 1
        if u.op == "call_function" and u.target in (operator.add, torch.add):
            break
        blocks = _block_expansion(u)
        if blocks is not None:
            raise _Refuse(Refusal("block_topk", f"the indexer selects blocks of {blocks} keys per indexer head "
                                  "(a top-k over key blocks, widened to a per-head token mask): the offload serves "
                                  "one selection of single key rows per query, shared by every head, from a latent "
                                  "(MLA) cache; this model would need a block-granular plan with one selection per "
                                  "KV head over its K / V caches. The dense attention stays", layer))
        _need(is_view(u) or is_cast(u) or calls(u, "to") or calls(u, "cat")
              or (u.op == "call_function" and u.target is operator.getitem),
              f"{u.name}: the block mask is consumed by {getattr(u.target, '__name__', u.target)}")
        mask = u
    other = u.args[0] if u.args[1] is mask else u.args[1]
    _need(isinstance(other, fx.Node) and other.op == "call_function" and other.target in (operator.mul, torch.mul)
          and calls(other.args[0], "matmul"), f"{u.name}: scores are not matmul * scaling")
    kt = other.args[0].args[1]
    _need(calls(kt, "transpose"), f"{other.name}: key is not transposed")
    key = kt.args[0]
    while isinstance(key, fx.Node) and (is_view(key) or calls(key, "expand")
                                        or (key.op == "call_function" and key.target is operator.getitem)):
        key = key.args[0]
    if calls(key, "cat"):
        raise _Refuse(Refusal("hf_compressed_kv", f"{sc.name}: the top-k selects among KV entries computed in this "
                              f"graph ({key.name} = cat of the cache and compressed entries), not rows of a cache "
                              "graph input: there is no host copy to serve them from; the dense attention stays",
                              layer))
    raise _Fail(f"{sc.name}: block-bias top-k mask over {key}: form not verified")


def detect_hf(gm: fx.GraphModule) -> HfDetectReport:
    """One walk over the graph; per scatter-mask only its neighbourhood is visited."""
    sites: list[HfSite] = []
    refusals: list[Refusal] = []
    topks: list[str] = []
    cand = 0
    for n in gm.graph.nodes:
        if calls(n, "topk"):
            topks.append(n.name)
            continue
        if calls(n, "scatter_add_") or calls(n, "scatter_add"):
            # counts of selected ids over the key axis: an integer zeros tensor (the MoE router adds floats)
            if not (n.args and _is_int_fresh(n.args[0])):
                continue
            which = _count_site
        elif calls(n, "scatter_") and _is_block_bias(n):
            which = _block_bias_site
        elif calls(n, "scatter"):
            # only bool ones-masks scattered with top-k indices are candidates (the MoE router scatters floats)
            tgt = n.args[0] if n.args else None
            ex = example(tgt)
            if ex is None or ex.dtype != torch.bool:
                continue
            which = _site
        else:
            continue
        layer = cand
        cand += 1
        try:
            sites.append(which(layer, n))
        except _Refuse as e:
            refusals.append(e.refusal)
        except _Fail as e:
            refusals.append(Refusal("hf_site_not_verified", f"{n.name}: {e}", layer))
    return HfDetectReport(sites, cand, topks, refusals)

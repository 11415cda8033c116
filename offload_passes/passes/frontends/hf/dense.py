"""The dense attention a top-k mask feeds, verified node by node: sdpa or eager (scores, optional sinks,
softmax, casts, the value product), its key / value the ``kv_b_proj`` expansion of a latent cache graph
input and a rope cache graph input, then the site's sizes checked shape by shape (:func:`finish_site`).
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch import fx

from ..._fx import calls, example, getitem_of, is_graph_input_or_attr, strip_views, view_users
from .verify import HfSite, arg, concatenated_cache, device_move, input_root, need, past_input, shape

__all__ = ["expansion", "dense_attention", "finish_site"]


def _split_parts(split_node: fx.Node) -> tuple[fx.Node, list[int]]:
    src = split_node.args[0]
    sizes = arg(split_node, 1, "split_size_or_sections", None)
    if sizes is None:
        sizes = arg(split_node, 1, "split_size", None)
    dim = arg(split_node, 2, "dim", 0)
    need(isinstance(sizes, (list, tuple)) and len(sizes) == 2 and dim in (-1, 3),
          f"{split_node.name}: expected a 2-way split on the last dim")
    return src, list(sizes)


def expansion(key: fx.Node, value: fx.Node, layer: Optional[int] = None) -> dict:
    """Verify key / value are ``expand_kv(latent, rope)``; return latent, rope, weight, n, v, and for caches
    grown by concatenation (a ``DynamicCache``: ``latent`` / ``rope`` are then this step's ``cat``) ``grown``
    and ``past``, the graph inputs they extend (None when they start from an empty tensor)."""
    gi_v = getitem_of(value)
    need(gi_v is not None and gi_v[1] == 1 and calls(gi_v[0], "split"),
          f"value {value.name} is not split(kv_b_proj(latent))[1]")
    split_n = gi_v[0]
    kv, (n_nope, n_v) = _split_parts(split_n)
    need(calls(kv, "transpose"), f"{kv} is not a transpose of the kv_b_proj output")
    lin = strip_views(kv.args[0])
    need(calls(lin, "linear") and len(lin.args) >= 2, f"{lin} is not the kv_b_proj linear")
    bias = arg(lin, 2, "bias", None)
    need(bias is None, f"{lin.name}: kv_b_proj with a bias is not supported")
    latent, weight = lin.args[0], lin.args[1]
    if device_move(latent):  # host KV: the site reads (and the offload serves from) the host cache itself
        latent = latent.args[0]
    grown = concatenated_cache(latent)
    if grown is not None:  # a DynamicCache: the cache is this step's cat (past + this step's rows)
        latent = grown
    else:
        need(isinstance(latent, fx.Node) and is_graph_input_or_attr(input_root(latent)),
             f"{lin.name}: kv_b_proj input {latent} is not the latent cache (a graph input)")
    need(isinstance(weight, fx.Node) and weight.op in ("placeholder", "get_attr"),
          f"{lin.name}: kv_b_proj weight is not a parameter")
    # key = new_empty(...) whose two slices are filled with k_nope (split[0]) and the expanded rope cache
    need(calls(key, "new_empty") or calls(key, "empty"), f"key {key.name} is not new_empty(...)")
    nope_src = rope_src = None
    for u in key.users:
        if not (u.op == "call_function" and u.target is operator.getitem):
            continue
        idx = u.args[1]
        sl = idx[-1] if isinstance(idx, tuple) else idx
        need(isinstance(sl, slice) and sl.step is None, f"{u.name}: unexpected key slice {idx}")
        for w in u.users:
            need(calls(w, "copy_") and w.args[0] is u, f"{w.name}: unexpected write into the key")
            if sl.start in (None, 0) and sl.stop == n_nope:
                nope_src = w.args[1]
            elif sl.start == n_nope and sl.stop is None:
                rope_src = w.args[1]
    gi_k = getitem_of(nope_src)
    need(gi_k is not None and gi_k[0] is split_n and gi_k[1] == 0, f"key[..., :{n_nope}] is not split(...)[0]")
    need(isinstance(rope_src, fx.Node), f"key[..., {n_nope}:] is not written from the rope cache")
    rope = input_root(rope_src)
    return {"latent": latent, "rope": rope, "weight": weight, "n": n_nope, "v": n_v, "grown": grown is not None,
            "past": _past_inputs(grown, rope, rope_src)}


def _past_inputs(grown: Optional[fx.Node], rope: Any, rope_src: fx.Node) -> Optional[tuple]:
    """Latent and rope caches grown by concatenation (``grown``: the latent's ``cat``) extend these graph
    inputs; None when they are graph inputs themselves or start from an empty tensor. Both grow, or neither."""
    rope_grown = concatenated_cache(rope)
    need((rope_grown is not None) == (grown is not None),
         f"rope key {rope_src} and latent {grown} are not both caches grown by concatenation, or both inputs")
    need(rope_grown is not None or is_graph_input_or_attr(rope), f"rope key {rope_src} is not a graph input")
    if grown is None:
        return None
    past = past_input(grown), past_input(rope_grown)
    return None if None in past else past


def _drops_last(idx: Any) -> bool:
    sl = idx[-1] if isinstance(idx, tuple) else idx
    lead = idx[:-1] if isinstance(idx, tuple) else ()
    return (isinstance(sl, slice) and sl.start is None and sl.stop == -1 and sl.step is None
            and all(x is Ellipsis or x == slice(None) for x in lead))


def _sink_softmax(scores: fx.Node, cat: fx.Node) -> tuple[fx.Node, fx.Node]:
    """Attention sinks (one learnt logit per head, a column the softmax normalises over and that is then
    dropped): ``cat([scores, sinks.reshape(1, H, 1, 1).expand(B, H, S, 1)], -1)``, minus its row max,
    softmax. Returns (the sink parameter ``[H]``, the softmax)."""
    parts = arg(cat, 0, "tensors")
    need(isinstance(parts, (list, tuple)) and len(parts) == 2 and parts[0] is scores
          and arg(cat, 1, "dim", 0) in (-1, 3), f"{cat.name}: not cat([scores, sinks], -1)")
    sink = input_root(parts[1])
    need(is_graph_input_or_attr(sink), f"{cat.name}: the extra logit column is not a parameter (sinks)")
    ex = example(sink)
    H = shape(scores)[1] if shape(scores) is not None else None
    need(ex is not None and ex.numel() == H, f"{cat.name}: sinks {None if ex is None else tuple(ex.shape)} "
          f"are not one logit per head ({H})")
    users = list(cat.users)
    subs = [x for x in users if x.op == "call_function" and x.target in (operator.sub, torch.sub)]
    need(len(users) == 2 and len(subs) == 1 and subs[0].args[0] is cat,
          f"{cat.name}: the logits with sinks are not (x - max) normalised")
    sub = subs[0]
    # x - x.max(-1, keepdim=True).values: a row-constant shift, which the softmax does not see
    mx = [x for x in users if x is not sub][0]
    gi = getitem_of(sub.args[1])
    need(calls(mx, "max") and gi is not None and gi[0] is mx and gi[1] == 0
          and arg(mx, 1, "dim", None) in (-1, 3) and arg(mx, 2, "keepdim", False) is True,
          f"{sub.name}: subtrahend is not the row max")
    us = list(sub.users)
    need(len(us) == 1 and calls(us[0], "softmax"), f"{sub.name}: expected softmax")
    return sink, us[0]


def dense_attention(combine: fx.Node) -> tuple:
    """The one attention consuming the combined mask: (kind, out, query, key, value, scaling, sinks,
    softmax dtype)."""
    users = view_users(combine)
    need(len(users) == 1, f"{combine.name}: the combined mask has {len(users)} consumers, expected 1")
    u = users[0]
    if calls(u, "scaled_dot_product_attention"):
        q, k, v = u.args[:3]
        need(strip_views(arg(u, 3, "attn_mask")) is combine, f"{u.name}: attn_mask is not the combined mask")
        need(arg(u, 4, "dropout_p", 0.0) == 0.0 and not arg(u, 5, "is_causal", False),
              f"{u.name}: dropout / is_causal set")
        scale = arg(u, 6, "scale", None)
        need(isinstance(scale, float), f"{u.name}: no explicit scale")
        need(not u.kwargs.get("enable_gqa", False), f"{u.name}: enable_gqa")
        return "sdpa", u, q, k, v, scale, None, None
    # eager: add(mul(matmul(q, key.transpose(2, 3)), s), mask) -> softmax -> to -> dropout -> matmul(., v)
    need(u.op == "call_function" and u.target in (operator.add, torch.add), f"{u.name}: not an attention")
    other = u.args[0] if u.args[1] is combine else u.args[1]
    need(isinstance(other, fx.Node) and other.op == "call_function" and other.target in (operator.mul, torch.mul),
          f"{u.name}: scores are not matmul * scaling")
    mm, scale = other.args
    need(calls(mm, "matmul") and isinstance(scale, float), f"{other.name}: scores are not matmul * scaling")
    q, kt = mm.args
    need(calls(kt, "transpose") and tuple(kt.args[1:]) in ((2, 3), (-1, -2), (-2, -1), (3, 2)),
          f"{mm.name}: key is not transposed")
    k = kt.args[0]
    us = list(u.users)
    need(len(us) == 1, f"{u.name}: attention scores have {len(us)} users")
    sinks = None
    if calls(us[0], "cat"):
        sinks, sm = _sink_softmax(u, us[0])
    else:
        sm = us[0]
        need(calls(sm, "softmax"), f"{sm.name}: expected softmax")
    need(arg(sm, 1, "dim", None) in (-1, 3), f"{sm.name}: softmax not over keys")
    sm_dtype = arg(sm, 2 if sm.op == "call_method" else 3, "dtype", None)
    nxt = sm
    if sinks is not None:  # the sink column is dropped right after the softmax: probs[..., :-1]
        us = list(sm.users)
        need(len(us) == 1 and us[0].op == "call_function" and us[0].target is operator.getitem
              and _drops_last(us[0].args[1]), f"{sm.name}: the sink column is not dropped after the softmax")
        nxt = us[0]
    while True:  # any order of dtype casts and inactive dropouts, then the value product
        us = list(nxt.users)
        need(len(us) == 1, f"{nxt.name}: attention weights have {len(us)} users")
        cand = us[0]
        if calls(cand, "to") or calls(cand, "type"):
            nxt = cand
            continue
        if calls(cand, "dropout"):
            need(arg(cand, 1, "p", 0.0) == 0.0 or arg(cand, 2, "training", True) is False,
                  f"{cand.name}: dropout active")
            nxt = cand
            continue
        break
    need(calls(cand, "matmul") and cand.args[0] is nxt,
          f"{nxt.name}: attention weights are not multiplied by the values")
    out = cand
    return "eager", out, q, k, out.args[1], scale, sinks, sm_dtype


def finish_site(layer: int, producer: fx.Node, tk: fx.Node, sc: fx.Node, combine: fx.Node, base: Optional[fx.Node],
            kind_mask: str, dedup: bool) -> HfSite:
    """The attention consuming the combined mask and its key / value expansion, checked shape by shape."""
    kind, out, q, k, v, scale, sinks, sm_dtype = dense_attention(combine)
    need((kind == "eager") == (kind_mask == "additive"), f"{out.name}: {kind} attention with a {kind_mask} mask")
    e = expansion(k, v, layer)
    shapes = {nm: shape(x) for nm, x in (("q", q), ("lat", e["latent"]), ("rope", e["rope"]), ("w", e["weight"]),
                                           ("tk", tk), ("out", out))}
    need(all(s is not None for s in shapes.values()), f"{out.name}: tensor shapes unknown")
    B, H, S, D = shapes["q"]
    need(len(shapes["lat"]) == 4 and shapes["lat"][1] == 1, f"latent cache {shapes['lat']} is not [B, 1, T, C]")
    _, _, T, C = shapes["lat"]
    R = shapes["rope"][-1]
    K = shapes["tk"][-1]
    n, vd = e["n"], e["v"]
    need(shapes["rope"] == (B, 1, T, R), f"rope cache {shapes['rope']} is not [B, 1, T, r] = {(B, 1, T, R)}")
    need(shapes["w"] == (H * (n + vd), C), f"kv_b_proj weight {shapes['w']} != {(H * (n + vd), C)}")
    need(D == n + R, f"query head dim {D} != qk_nope {n} + rope {R}")
    need(shapes["tk"] == (B, S, K) and K <= T, f"top-k {shapes['tk']} is not [B, S, K<=T] for {(B, S, T)}")
    need(shapes["out"] == (B, H, S, vd), f"attention output {shapes['out']} != {(B, H, S, vd)}")
    if base is not None:
        bs = shape(base)
        need(bs is not None and len(bs) == 4 and bs[1] == 1 and bs[2] == S and bs[3] == T and bs[0] in (1, B),
              f"base mask {bs} is not [B|1, 1, S, T]")
    dt = example(e["latent"]).dtype
    return HfSite(layer, producer, tk, sc, combine, out, kind, q, e["latent"], e["rope"], e["weight"], base,
                  float(scale), {"B": B, "S": S, "T": T, "K": K, "H": H, "C": C, "R": R, "n": n, "v": vd}, dt,
                  sinks, sm_dtype, dedup, e["grown"], e["past"])

"""Pass 1 (Hugging Face form) — detect the dense DSA pattern of ``transformers``' ``glm_moe_dsa``.

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
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import fx

from ._fx import example, getitem_of, is_cast, is_graph_input_or_attr, is_view, op_name, strip_views, view_users
from .detect import Refusal

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
    base_mask: fx.Node  # causal / padding mask before the top-k mask, [B|1, 1, S, T]
    scaling: float
    dims: dict[str, int] = field(default_factory=dict)  # B S T K H C R n v
    dtype: Optional[torch.dtype] = None

    def to_dict(self) -> dict:
        return {"layer": self.layer, "kind": self.kind, "topk_node": self.producer.name, "attn_node": self.attn.name,
                "latent": self.latent.name, "rope": self.rope.name, **self.dims}


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


def _method_or_fn(n: Any, name: str) -> bool:
    if not isinstance(n, fx.Node):
        return False
    if n.op == "call_method":
        return n.target == name
    if n.op == "call_function":
        if getattr(n.target, "__name__", None) == name:
            return True
        on = op_name(n)
        return on is not None and on.split("::")[-1] == name
    return False


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


def _input_root(n: Any) -> Any:
    """The graph input behind views / expands (the cache tensors are Dynamo placeholders)."""
    while isinstance(n, fx.Node) and (is_view(n) or _method_or_fn(n, "expand")):
        n = n.args[0]
    return n


class _Fail(Exception):
    pass


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
    _need(gi_v is not None and gi_v[1] == 1 and _method_or_fn(gi_v[0], "split"),
          f"value {value.name} is not split(kv_b_proj(latent))[1]")
    split_n = gi_v[0]
    kv, (n_nope, n_v) = _split_parts(split_n)
    _need(_method_or_fn(kv, "transpose"), f"{kv} is not a transpose of the kv_b_proj output")
    lin = strip_views(kv.args[0])
    _need(_method_or_fn(lin, "linear") and len(lin.args) >= 2, f"{lin} is not the kv_b_proj linear")
    bias = _arg(lin, 2, "bias", None)
    _need(bias is None, f"{lin.name}: kv_b_proj with a bias is not supported")
    latent, weight = lin.args[0], lin.args[1]
    _need(isinstance(latent, fx.Node) and is_graph_input_or_attr(_input_root(latent)),
          f"{lin.name}: kv_b_proj input {latent} is not the latent cache (a graph input)")
    _need(isinstance(weight, fx.Node) and weight.op in ("placeholder", "get_attr"),
          f"{lin.name}: kv_b_proj weight is not a parameter")
    # key = new_empty(...) whose two slices are filled with k_nope (split[0]) and the expanded rope cache
    _need(_method_or_fn(key, "new_empty") or _method_or_fn(key, "empty"), f"key {key.name} is not new_empty(...)")
    nope_src = rope_src = None
    for u in key.users:
        if not (u.op == "call_function" and u.target is operator.getitem):
            continue
        idx = u.args[1]
        sl = idx[-1] if isinstance(idx, tuple) else idx
        _need(isinstance(sl, slice) and sl.step is None, f"{u.name}: unexpected key slice {idx}")
        for w in u.users:
            _need(_method_or_fn(w, "copy_") and w.args[0] is u, f"{w.name}: unexpected write into the key")
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


def _attention(combine: fx.Node) -> tuple[str, fx.Node, fx.Node, fx.Node, fx.Node, float]:
    """The one attention consuming the combined mask: (kind, out, query, key, value, scaling)."""
    users = view_users(combine)
    _need(len(users) == 1, f"{combine.name}: the combined mask has {len(users)} consumers, expected 1")
    u = users[0]
    if _method_or_fn(u, "scaled_dot_product_attention"):
        q, k, v = u.args[:3]
        _need(strip_views(_arg(u, 3, "attn_mask")) is combine, f"{u.name}: attn_mask is not the combined mask")
        _need(_arg(u, 4, "dropout_p", 0.0) == 0.0 and not _arg(u, 5, "is_causal", False),
              f"{u.name}: dropout / is_causal set")
        scale = _arg(u, 6, "scale", None)
        _need(isinstance(scale, float), f"{u.name}: no explicit scale")
        _need(not u.kwargs.get("enable_gqa", False), f"{u.name}: enable_gqa")
        return "sdpa", u, q, k, v, scale
    # eager: add(mul(matmul(q, key.transpose(2, 3)), s), mask) -> softmax -> to -> dropout -> matmul(., v)
    _need(u.op == "call_function" and u.target in (operator.add, torch.add), f"{u.name}: not an attention")
    other = u.args[0] if u.args[1] is combine else u.args[1]
    _need(isinstance(other, fx.Node) and other.op == "call_function" and other.target in (operator.mul, torch.mul),
          f"{u.name}: scores are not matmul * scaling")
    mm, scale = other.args
    _need(_method_or_fn(mm, "matmul") and isinstance(scale, float), f"{other.name}: scores are not matmul * scaling")
    q, kt = mm.args
    _need(_method_or_fn(kt, "transpose") and tuple(kt.args[1:]) in ((2, 3), (-1, -2), (-2, -1), (3, 2)),
          f"{mm.name}: key is not transposed")
    k = kt.args[0]
    nxt = u
    for step in ("softmax", "to", "dropout"):
        us = list(nxt.users)
        _need(len(us) == 1, f"{nxt.name}: attention weights have {len(us)} users")
        cand = us[0]
        if step == "to" and not _method_or_fn(cand, "to"):
            continue
        _need(_method_or_fn(cand, step), f"{cand.name}: expected {step}")
        if step == "softmax":
            _need(_arg(cand, 1, "dim", None) in (-1, 3), f"{cand.name}: softmax not over keys")
        if step == "dropout":
            _need(_arg(cand, 1, "p", 0.0) == 0.0 or _arg(cand, 2, "training", True) is False,
                  f"{cand.name}: dropout active")
        nxt = cand
    us = list(nxt.users)
    _need(len(us) == 1 and _method_or_fn(us[0], "matmul") and us[0].args[0] is nxt,
          f"{nxt.name}: attention weights are not multiplied by the values")
    out = us[0]
    return "eager", out, q, k, out.args[1], scale


def _site(layer: int, sc: fx.Node) -> HfSite:
    base_ones, dim, index = sc.args[0], _arg(sc, 1, "dim"), _arg(sc, 2, "index")
    value = _arg(sc, 3, "value", _arg(sc, 3, "src"))
    _need(dim in (-1, 2) and value in (False, 0), f"{sc.name}: not scatter(-1, idx, False)")
    _need(_method_or_fn(base_ones, "new_ones") or _method_or_fn(base_ones, "ones"),
          f"{sc.name}: scatter target is not a ones mask")
    ex = example(base_ones)
    _need(ex is not None and ex.dtype == torch.bool, f"{sc.name}: scatter target is not boolean")
    _need(isinstance(index, fx.Node), f"{sc.name}: scatter index is not a tensor")
    producer = _strip_casts(index)
    topk = index  # the int32 top-k the model hands between layers (else the raw indices)
    while topk is not producer and not (example(topk) is not None and example(topk).dtype == torch.int32):
        topk = topk.args[0]
    gi = getitem_of(producer)
    _need(gi is not None and gi[1] == 1 and _method_or_fn(gi[0], "topk"),
          f"{sc.name}: scatter indices do not come from topk(...)[1] (got {producer})")
    tk = topk
    # index_mask users: masked_fill(base, index_mask, min) | base & ~index_mask
    users = view_users(sc)
    _need(len(users) == 1, f"{sc.name}: the index mask has {len(users)} consumers, expected 1")
    u = users[0]
    if _method_or_fn(u, "masked_fill"):
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
    kind, out, q, k, v, scale = _attention(combine)
    _need((kind == "eager") == (kind_mask == "additive"), f"{out.name}: {kind} attention with a {kind_mask} mask")
    e = _expansion(k, v)
    shapes = {nm: _shape(x) for nm, x in (("q", q), ("lat", e["latent"]), ("rope", e["rope"]), ("w", e["weight"]),
                                           ("tk", tk), ("out", out), ("base", base))}
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
    bs = shapes["base"]
    _need(len(bs) == 4 and bs[1] == 1 and bs[2] == S and bs[3] == T and bs[0] in (1, B),
          f"base mask {bs} is not [B|1, 1, S, T]")
    dt = example(e["latent"]).dtype
    return HfSite(layer, producer, tk, sc, combine, out, kind, q, e["latent"], e["rope"], e["weight"], base,
                  float(scale), {"B": B, "S": S, "T": T, "K": K, "H": H, "C": C, "R": R, "n": n, "v": vd}, dt)


def detect_hf(gm: fx.GraphModule) -> HfDetectReport:
    """One walk over the graph; per scatter-mask only its neighbourhood is visited."""
    sites: list[HfSite] = []
    refusals: list[Refusal] = []
    topks: list[str] = []
    cand = 0
    for n in gm.graph.nodes:
        if _method_or_fn(n, "topk"):
            topks.append(n.name)
            continue
        if not _method_or_fn(n, "scatter"):
            continue
        # only bool ones-masks scattered with top-k indices are candidates (the MoE router scatters floats)
        tgt = n.args[0] if n.args else None
        ex = example(tgt)
        if ex is None or ex.dtype != torch.bool:
            continue
        layer = cand
        cand += 1
        try:
            sites.append(_site(layer, n))
        except _Fail as e:
            refusals.append(Refusal("hf_site_not_verified", f"{n.name}: {e}", layer))
    return HfDetectReport(sites, cand, topks, refusals)

"""The Hugging Face front-end: dense DSA attention → sparse attention, then (optionally) the offload.

For every site found by ``detect_hf`` the dense attention over all T cached positions is replaced by
one call that attends over the K selected positions only:

* **sparse** (always): gather the K selected latent rows ``[B, S, K, C]`` and rope rows ``[B, S, K, r]``
  from the caches, expand only those through ``kv_b_proj``, attend. The mask is the model's own base
  mask (causal limit, padding) gathered at the selected ids, and an id outside ``[0, T)`` (``-1``
  padding) is masked: the same terms the dense softmax keeps, so the result is the same attention
  (only the summation order differs). K is the graph's top-k width, i.e. already ``min(index_topk, T)``.
  A model with attention sinks gets its sink logit in the softmax as the dense one does; a count-mask
  site (no base mask, ids not proven distinct) masks a repeated id after its first column.
* **offload** (``enable_offload`` and ``shared_indexer_offload``, f16/bf16 caches, the op limits of
  docs/ops.md): the shared core (``passes/rewrite.py``) emits plan / serve / install exactly as for the
  recipe graph (guards, new-request invalidation, ``replacement_policy``, ``install_hook``); this
  front-end only gives it the HF cache viewed ``[B, T, D]``, per-layer selection buffers (graph
  scratch) and the sparse attention reading them. An offload precondition that fails leaves the
  sparse rewrite in place (it is exact) and is reported / logged; ``strict`` raises.

The dense nodes (scatter-mask, full expansion, dense attention) are then removed by a local dead-code
walk from each replaced attention: only pure nodes and writes into dead fresh allocations
(``key_states = new_empty(...)``) are erased; cache writes and other in-place ops always stay.
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import fx

from ..options import OffloadOptions
from .. import _compat
from . import _fx
from .detect import Refusal
from .detect_hf import HfDetectReport, HfSite, detect_hf
from .group import GroupReport
from ..custom_ops._pool import id_range_for, pool_size_problem
from .preconditions import GroupPlan, SiteGeometry
from .preconditions import MAX_DKV, MAX_DR, MAX_RAW_SEQ, MAX_TOPK, TOPK_ALIGN  # the ops' specs

log = logging.getLogger("offload_passes.passes.rewrite_hf")
aten = torch.ops.aten
custom = torch.ops.custom

__all__ = ["hf_sparse_attention", "hf_sparse_attention_rows", "HfFrontEnd", "HF", "dense_masks_left"]

OFFLOAD_DTYPES = (torch.float16, torch.bfloat16)


# -- the sparse attention (traced into the graph by AOT / run directly in eager) ----------------------
def _attend(query: torch.Tensor, rows: torch.Tensor, rope_rows: torch.Tensor, weight: torch.Tensor,
            idx: torch.Tensor, base_mask: Optional[torch.Tensor], T: int, scaling: float, nope: int, vdim: int,
            kind: str, fill: float, sinks: Optional[torch.Tensor] = None,
            softmax_dtype: Optional[torch.dtype] = torch.float32, dedup: bool = False) -> torch.Tensor:
    B, H, S, D = query.shape
    K = idx.shape[-1]
    R = rope_rows.shape[-1]
    idx = idx.long()
    valid = (idx >= 0) & (idx < T)
    safe = idx.clamp(0, T - 1)
    if dedup:  # a position the ids name twice is one key of the dense mask: keep its first column only
        order, perm = torch.sort(torch.where(valid, safe, -1), dim=-1, stable=True)
        again = torch.cat([torch.zeros_like(order[..., :1], dtype=torch.bool), order[..., 1:] == order[..., :-1]], -1)
        valid = valid & ~torch.zeros_like(again).scatter(-1, perm, again)
    if base_mask is not None:  # the model's mask at the selected ids
        msel = torch.gather(base_mask.expand(B, 1, S, T)[:, 0], 2, safe)
    elif kind == "sdpa":  # the selection is the whole mask (the indexer already applied causality / padding)
        msel = torch.ones_like(safe, dtype=torch.bool)
    else:
        msel = torch.zeros_like(safe, dtype=query.dtype)
    kv = F.linear(rows, weight).view(B, S, K, H, nope + vdim)
    k_nope, v = kv.split([nope, vdim], dim=-1)
    # one copy (the concatenated key, as the model builds it); heads-first are views, not copies
    k = torch.cat([k_nope, rope_rows.view(B, S, K, 1, R).expand(B, S, K, H, R)], dim=-1)
    k = k.view(B * S, K, H, D).transpose(1, 2)
    v = v.reshape(B * S, K, H, vdim).transpose(1, 2)
    q = query.transpose(1, 2).reshape(B * S, H, 1, D)
    if kind == "sdpa":
        allowed = (msel & valid).view(B * S, 1, 1, K)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=0.0, scale=scaling)
    else:
        add = torch.where(valid, msel, torch.full_like(msel, fill)).view(B * S, 1, 1, K)
        w = torch.matmul(q, k.transpose(2, 3)) * scaling + add
        if sinks is None:
            w = F.softmax(w, dim=-1, dtype=softmax_dtype).to(query.dtype)
        else:  # one sink logit per head joins the normalisation, then its column is dropped (as the model does)
            w = torch.cat([w, sinks.reshape(1, H, 1, 1).expand(B * S, H, 1, 1).to(w.dtype)], dim=-1)
            w = w - w.max(dim=-1, keepdim=True).values
            w = F.softmax(w, dim=-1, dtype=softmax_dtype)[..., :-1].to(query.dtype)
        out = torch.matmul(w, v)
    return out.view(B, S, H, vdim).transpose(1, 2)


def hf_sparse_attention(query: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, weight: torch.Tensor,
                        topk: torch.Tensor, base_mask: Optional[torch.Tensor], scaling: float, nope: int, vdim: int,
                        kind: str, fill: float, sinks: Optional[torch.Tensor] = None,
                        softmax_dtype: Optional[torch.dtype] = torch.float32, dedup: bool = False) -> torch.Tensor:
    """Attention of ``query [B,H,S,n+r]`` over the ``topk [B,S,K]`` rows of the latent / rope caches
    ``[B,1,T,C]`` / ``[B,1,T,r]``, expanded through ``weight`` (kv_b_proj); returns ``[B,H,S,v]``."""
    B, _, T, C = latent.shape
    S, K = topk.shape[1], topk.shape[2]
    safe = topk.long().clamp(0, T - 1).reshape(B, S * K)
    bidx = torch.arange(B, device=topk.device).view(B, 1)
    rows = latent[:, 0][bidx, safe].view(B, S, K, C)  # row gather (indexing kernel: ~8x torch.gather here)
    rrows = rope[:, 0][bidx, safe].view(B, S, K, rope.shape[-1])
    return _attend(query, rows, rrows, weight, topk, base_mask, T, scaling, nope, vdim, kind, fill, sinks,
                   softmax_dtype, dedup)


def hf_sparse_attention_rows(query: torch.Tensor, sel_kv: torch.Tensor, sel_rope: torch.Tensor,
                             weight: torch.Tensor, topk: torch.Tensor, base_mask: Optional[torch.Tensor], T: int,
                             scaling: float, nope: int, vdim: int, kind: str, fill: float,
                             sinks: Optional[torch.Tensor] = None,
                             softmax_dtype: Optional[torch.dtype] = torch.float32, dedup: bool = False) -> torch.Tensor:
    """As :func:`hf_sparse_attention`, reading the rows ``dsa_serve`` placed in the selection buffers
    (top-k column k of query row r at flat row ``r*K + k``)."""
    B, S, K = topk.shape
    rows = sel_kv.reshape(B, S, K, sel_kv.shape[-1])
    rrows = sel_rope.reshape(B, S, K, sel_rope.shape[-1])
    return _attend(query, rows, rrows, weight, topk, base_mask, T, scaling, nope, vdim, kind, fill, sinks,
                   softmax_dtype, dedup)


# -- dead code removal, local to the replaced attentions ------------------------------------------------
_FRESH = {"new_empty", "new_zeros", "new_ones", "new_full", "empty", "zeros", "ones", "full", "empty_like",
          "zeros_like"}


def _name(n: fx.Node) -> str:
    if n.op == "call_method":
        return str(n.target)
    return getattr(n.target, "__name__", "") or ""


_OPERATOR_INPLACE = {operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
                     operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                     operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}


def _is_inplace(n: fx.Node) -> bool:
    if n.op == "call_function" and getattr(n.target, "__module__", None) == "_operator":
        return n.target in _OPERATOR_INPLACE  # operator.and_ / or_ are not in-place
    if isinstance(n.target, _compat.OpOverload):
        return n.target._schema.is_mutable
    nm = _name(n)
    return nm.endswith("_") and not nm.startswith("_")


def _write_only(u: fx.Node) -> bool:
    """A view / slice of a fresh allocation whose only users are unused in-place writes into it."""
    if not (_fx.is_view(u) or (u.op == "call_function" and u.target is operator.getitem)):
        return False
    return all(_is_inplace(w) and w.args and w.args[0] is u and not w.users for w in u.users)


def _dead_write(w: fx.Node, target: fx.Node) -> bool:
    """An in-place write straight into ``target`` whose result nobody reads."""
    return _is_inplace(w) and bool(w.args) and w.args[0] is target and not w.users


def _dce(g: fx.Graph, seeds: Sequence[fx.Node]) -> int:
    erased = 0
    todo = list(seeds)
    dead: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in dead or n.op not in ("call_function", "call_method"):
            continue
        if n.users and _name(n) in _FRESH and all(_write_only(u) or _dead_write(u, n) for u in n.users):
            for u in [u for u in n.users if _dead_write(u, n)]:  # in-place writes into it, results unused
                todo.extend(a for a in u.all_input_nodes if a is not n)
                g.erase_node(u)
                dead.add(u)
                erased += 1
            for u in list(n.users):
                for w in list(u.users):
                    todo.extend(a for a in w.all_input_nodes if a is not u)
                    g.erase_node(w)
                    dead.add(w)
                    erased += 1
                g.erase_node(u)
                dead.add(u)
                erased += 1
        if n.users or n.is_impure() or _is_inplace(n):
            continue
        inputs = n.all_input_nodes
        g.erase_node(n)
        dead.add(n)
        erased += 1
        todo.extend(inputs)
    return erased


# -- offload preconditions ----------------------------------------------------------------------------
def _cache_length(site: HfSite) -> Optional[fx.Node]:
    """The index the model writes this step's latent rows at (``index_copy_`` into the latent cache)."""
    for u in site.latent.users:
        if _name(u) in ("index_copy_", "index_copy") and u.args and u.args[0] is site.latent and len(u.args) >= 3:
            return u.args[2]
    return None


def _selection_block(K: int) -> int:
    sbs = 128
    while sbs > 16 and K % sbs:
        sbs //= 2
    return sbs


def offload_plan(gm: fx.GraphModule, grp: GroupReport, opts: OffloadOptions) -> tuple[list[GroupPlan], dict, list[Refusal]]:
    """GroupPlans (as the recipe graph's plan step) plus per group the cache-position node; refusals."""
    refusals: list[Refusal] = []
    plans: list[GroupPlan] = []
    positions: dict[int, fx.Node] = {}
    PS = opts.resolved_pool_size
    for g in grp.groups:
        def chk(cond: bool, reason: str, detail: str, layer: Optional[int] = None) -> bool:
            if not cond:
                refusals.append(Refusal(reason, detail, g.owner.layer if layer is None else layer))
            return cond

        d0 = g.owner.dims
        B, S, K = d0["B"], d0["S"], d0["K"]
        for s in g.sites:
            d = s.dims
            chk((d["B"], d["S"], d["K"]) == (B, S, K), "group_inconsistent",
                f"group {g.group_id}: layer {s.layer} has (B, S, K) {(d['B'], d['S'], d['K'])} != {(B, S, K)}", s.layer)
            chk(s.dtype in OFFLOAD_DTYPES, "kv_dtype",
                f"latent cache dtype {s.dtype}: the offload ops take float16/bfloat16 KV (sparse attention kept)", s.layer)
            chk(0 < d["C"] <= MAX_DKV and 0 < d["R"] <= MAX_DR, "dims",
                f"Dkv={d['C']} must be in (0, {MAX_DKV}], Dr={d['R']} in (0, {MAX_DR}]", s.layer)
            chk(_cache_length(s) is not None, "cache_layout",
                f"{s.latent.name}: no index_copy_ write into the latent cache (cache length unknown)", s.layer)
        chk(K % TOPK_ALIGN == 0 and 0 < K <= MAX_TOPK, "topk_alignment",
            f"top-k width K={K} must be a multiple of {TOPK_ALIGN} and <= {MAX_TOPK}")
        chk(1 <= S <= MAX_RAW_SEQ, "raw_seq", f"raw_seq S={S} must be in [1, {MAX_RAW_SEQ}]")
        if opts.next_n is not None:
            chk(S == opts.next_n + 1, "next_n", f"graph has raw_seq S={S}, config next_n={opts.next_n}")
        SBS = _selection_block(K)
        problem = pool_size_problem(PS, SBS)
        chk(problem is None, "pool_size", f"pool_size={PS} {problem[0]}" if problem else "")
        if refusals:
            continue
        T = max(s.dims["T"] for s in g.sites)
        IR = id_range_for(T, opts.id_range)
        geos = {s.layer: SiteGeometry(s.layer, s.latent, s.rope, None, None, None, None, s.dims["T"], s.dims["C"],
                                      s.dims["R"], s.dtype) for s in g.sites}
        plans.append(GroupPlan(g.group_id, g.owner.layer, g.last.layer, g.layers, B, S, K, SBS, PS, PS // 16, IR,
                               _cache_length(g.owner), g.owner.topk, g.producer.name, geos))
        positions[g.group_id] = _cache_length(g.owner)
    return plans, positions, refusals



# -- the front-end (the shared core, passes/rewrite.py, does plan / serve / install) -------------------
class HfFrontEnd:
    """The Hugging Face ``transformers`` form: a dense masked attention over every cached position whose
    mask keeps the indexer's top-k. Every site becomes a sparse attention; with offload it reads the
    selection buffers ``dsa_serve`` filled (state of the graph), else it gathers from the caches."""

    name = "hf"
    pass_files = {"detect": "passes/detect_hf.py", "plan": "passes/rewrite_hf.py", "emit": "passes/rewrite_hf.py"}
    #: an offload refusal keeps the sparse rewrite (it is exact); the recipe form is left unmodified instead
    partial_on_refusal = True

    def detect(self, gm: fx.GraphModule) -> HfDetectReport:
        return detect_hf(gm)

    def screen(self, det: HfDetectReport) -> tuple[list[Refusal], list[Refusal]]:
        """(refusals that leave the graph unmodified with a warning, notes that leave it so quietly)."""
        blocking = list(det.refusals)  # hf_site_not_verified, or a named form the offload cannot apply to
        dense = [s for s in det.sites if s.dims["S"] * s.dims["K"] >= s.dims["T"]]
        quiet = []
        if dense and not blocking:
            # e.g. a prefill graph (S = prompt length): S*K selected rows cost more than the T dense ones
            d = dense[0].dims
            quiet.append(Refusal("dense_cheaper", f"S*K = {d['S']}*{d['K']} >= T = {d['T']} cached positions: the "
                                 "dense attention reads fewer rows; graph left as it is", dense[0].layer))
        return blocking, quiet

    def plan(self, gm: fx.GraphModule, grp: GroupReport, example_inputs: Sequence[Any], opts: OffloadOptions):
        from .preconditions import PlanReport

        plans, _, refusals = offload_plan(gm, grp, opts)
        return PlanReport(plans if not refusals else [], refusals)

    def plan_anchor(self, grp: Any) -> fx.Node:
        return grp.owner.attn

    def lengths(self, b: Any, p: GroupPlan) -> fx.Node:
        # this step's cache positions [S] (StaticCache: the same for every row); L = last position + 1
        L = b(aten.add.Tensor, b(aten.amax.default, p.lengths, [0]), 1)
        return b(aten.repeat.default, b(aten.view.default, b(aten._to_copy.default, L, dtype=torch.int32), [1]), [p.B])

    def topk(self, b: Any, p: GroupPlan) -> fx.Node:
        tk = p.topk
        if _fx.example(tk) is None or _fx.example(tk).dtype != torch.int32:
            tk = b(aten._to_copy.default, tk, dtype=torch.int32)
        return b(aten.view.default, tk, [p.B, p.S, 1, p.K])

    def selection(self, ctx: Any, grp: Any, p: GroupPlan) -> dict:
        """Selection buffers and their identity block table: scratch of the graph (HF has none)."""
        B, S, K, SBS = p.B, p.S, p.K, p.BS
        dev = ctx.state.pools[grp.owner.layer][0].device
        nb = B * S * K // SBS
        table = ctx.attr(f"sel_table_g{grp.group_id}",
                         torch.arange(nb, dtype=torch.int32, device=dev).view(B * S, K // SBS))
        out = {}
        for s in grp.sites:
            geo = p.geometry[s.layer]
            out[s.layer] = (ctx.attr(f"sel_kv_l{s.layer}", torch.zeros(nb, SBS, geo.Dkv, dtype=geo.dtype, device=dev)),
                            ctx.attr(f"sel_rope_l{s.layer}", torch.zeros(nb, SBS, geo.Dr, dtype=geo.dtype, device=dev)),
                            table)
        return out

    def ledger(self, p: GroupPlan, layer: int) -> None:
        return None  # transformers keeps no gather ledger

    def layer_nodes_before(self, grp: GroupReport) -> dict[int, list[str]]:
        return {s.layer: [s.scatter.name, s.combine.name, s.attn.name] for g in grp.groups for s in g.sites}

    def add_guards(self, ctx: Any, groups: GroupReport, plans: dict) -> None:
        return None  # no block tables: the shared lengths guard is all the assumptions there are

    def emit_site(self, ctx: Any, grp: Any, gn: Any, s: HfSite) -> fx.Node:
        """The sparse attention (reading what ``dsa_serve`` placed when offloaded) replaces the dense one."""
        from .rewrite import SiteRewrite, emit_serve

        b, d = ctx.b, s.dims
        fill = float(s.combine.args[2]) if s.kind == "eager" else 0.0
        serve = None
        with ctx.g.inserting_before(s.attn):
            if gn is not None:
                serve = emit_serve(ctx, gn, s.layer, s.latent, s.rope)
                skv, srp, _ = gn.sel[s.layer]
                new_attn = b(hf_sparse_attention_rows, s.query, skv, srp, s.weight, s.topk, s.base_mask, d["T"],
                             s.scaling, d["n"], d["v"], s.kind, fill, s.sinks, s.softmax_dtype, s.dedup)
            else:
                new_attn = b(hf_sparse_attention, s.query, s.latent, s.rope, s.weight, s.topk, s.base_mask,
                             s.scaling, d["n"], d["v"], s.kind, fill, s.sinks, s.softmax_dtype, s.dedup)
        if "example_value" in s.attn.meta:  # Dynamo's key, as on the node it replaces
            new_attn.meta["example_value"] = s.attn.meta["example_value"]
        dense_name = s.attn.name
        s.attn.replace_all_uses_with(new_attn)
        ctx.scratch.setdefault("dead", []).append(s.attn)
        rw = SiteRewrite(s.layer, grp.group_id, dense_name, new_attn.name,
                         serve.name if serve is not None else None, kind=s.kind)
        ctx.sites.append(rw)
        if gn is not None:
            gn.by_layer[s.layer] = rw
        ctx.after[s.layer] = ([gn.plan.name] if gn is not None and s is grp.owner else []) + \
            ([serve.name] if serve is not None else []) + [new_attn.name]
        return new_attn

    def finish(self, ctx: Any) -> dict:
        erased = _dce(ctx.g, ctx.scratch.get("dead", []))
        return {"erased_nodes": erased, "dense_masks_left": dense_masks_left(ctx.g)}


def dense_masks_left(graph: fx.Graph) -> int:
    """Boolean scatter-masks and integer scatter-add count masks still in ``graph`` (0 after a complete rewrite)."""
    n_left = 0
    for n in graph.nodes:
        if _name(n) in ("scatter", "scatter_add", "scatter_add_") and n.args:
            ex = _fx.example(n.args[0])
            if ex is None:
                continue
            if (ex.dtype == torch.bool) if _name(n) == "scatter" else (
                    not ex.dtype.is_floating_point and ex.dtype != torch.bool and _name(n.args[0]) in _FRESH):
                n_left += 1
    return n_left


HF = HfFrontEnd()

"""The Hugging Face front-end's preconditions and emission: dense DSA attention → sparse attention,
then (with its preconditions) the offload. The form is described in ``frontends/hf/__init__.py``;
detection is ``frontends/hf/detect.py``, the sparse attention op ``frontends/hf/attention.py``.
"""
from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

import torch
from torch import fx

from .... import _compat
from ....custom_ops._pool import MIN_ID_RANGE
from ....modes import MODES
from ....options import MAX_ID_RANGE, OffloadOptions
from ... import _fx
from ...emit import GroupNodes, RewriteCtx, SiteEmission, emit_serve
from ...group import Group, GroupReport
from ...preconditions import (MAX_DKV, Checker, GroupGeometry, PreconditionReport, SiteGeometry,
                              check_pool_size, check_raw_seq, check_rope_width, check_topk_width, group_geometry,
                              padded_topk_width)
from ...refusal import Refusal
from ..protocol import PartialRefusal
from .attention import hf_sparse_attention, hf_sparse_attention_rows
from .detect import HfSite, allocated_caches, detect_hf

__all__ = ["HfFrontEnd", "HF", "check_hf_preconditions", "dense_masks_left", "allocated_caches"]

aten = torch.ops.aten

#: the latent cache dtypes the offload ops take (the sparse attention alone takes any)
OFFLOAD_DTYPES = (torch.float16, torch.bfloat16)


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
    """The index the model writes this step's latent rows at: ``index_copy_`` into the latent cache
    (``StaticCache``), or ``offload_ref::static_cache_write_``'s ``cache_position`` (the host-KV cache,
    ``offload_passes/hf_cache.py``)."""
    for u in site.latent.users:
        if _name(u) in ("index_copy_", "index_copy") and u.args and u.args[0] is site.latent and len(u.args) >= 3:
            return u.args[2]
        if _fx.op_name(u) == "offload_ref::static_cache_write_" and u.args and u.args[0] is site.latent:
            return u.args[2] if len(u.args) >= 3 else u.kwargs.get("cache_position")
    return None


def _width_bound(K: Any) -> int:
    """``K``, or the bound of a symbolic top-k width (``Min(64, s0 + 1)`` -> 64); 0 when unbounded (refused
    by the width check)."""
    if not isinstance(K, torch.SymInt):
        return int(K)
    node = K.node
    upper = node.shape_env.bound_sympy(node.expr).upper
    return int(upper) if upper.is_finite else 0


def _check_grown(chk: Checker, s: HfSite, opts: OffloadOptions) -> None:
    """A cache grown by concatenation (a ``DynamicCache``) is offloaded where the pools can follow it: its
    state is found by the step's past cache inputs and moves to the ``cat`` outputs after the step
    (``state.StateBinder``), which takes a lowering that binds the state per call (the CPU modes)."""
    plat = MODES[opts.exe_mode].platform
    chk(s.past is not None, "dynamic_cache", f"{s.latent.name}: the latent cache grows from an empty tensor (the "
        "first update of a DynamicCache): no cache input to find its pools by", s.layer)
    chk(plat == "cpu", "dynamic_cache", f"{s.latent.name}: the latent cache is torch.cat([cache, this step's rows], "
        f"dim=-2) (a DynamicCache, generate()'s default): exe_mode {opts.exe_mode!r} binds its offload state to "
        "the graph, which cannot follow a cache whose tensors are new at every step; the CPU modes follow it. "
        "Use offload(model).generate(...), which supplies a bucketed StaticCache, or generate(..., "
        "cache_implementation=\"static\", max_cache_len=N)", s.layer)
    ir, fits = _grown_id_range(s, opts)
    chk(fits, "id_range", f"{s.latent.name}: a cache of {s.dims['T']} positions is past the id range {ir} the "
        f"pools can hold (option id_range, at most {MAX_ID_RANGE})", s.layer)


def _grown_id_range(site: HfSite, opts: OffloadOptions) -> tuple[int, bool]:
    """The id range of a grown cache's pools, and whether this step's cache fits it. Fixed, as the cache
    length is symbolic and grows every step: the option's, else ``MIN_ID_RANGE`` doubled until it holds
    this step's cache (at most ``MAX_ID_RANGE``). Dynamo guards the length within it (``guard_bool``), so a
    longer cache compiles another graph."""
    from torch.fx.experimental.symbolic_shapes import guard_bool

    T = site.dims["T"]
    ir = opts.id_range or MIN_ID_RANGE
    fits = bool(guard_bool(T <= ir))
    while not fits and opts.id_range is None and ir < MAX_ID_RANGE:
        ir = min(2 * ir, MAX_ID_RANGE)
        fits = bool(guard_bool(T <= ir))
    return ir, fits


def _selection_block(K: int) -> int:
    sbs = 128
    while sbs > 16 and K % sbs:
        sbs //= 2
    return sbs


def check_hf_preconditions(gm: fx.GraphModule, grp: GroupReport, opts: OffloadOptions) -> PreconditionReport:
    """Each group's geometry (as the recipe form's, ``passes/frontends/recipe.py``) from the HF cache shapes;
    refusals. The group-level rules (top-k width, raw_seq / next_n, pool geometry, id range) are the shared
    ones (``passes/preconditions.py``); the per-site checks are this form's (latent cache dtype and widths,
    the cache-length write). Every group is checked; which of those that pass are offloaded is the
    pipeline's decision (``outcome.py``). Refusals that are only ``raw_seq`` are a prefill's design
    (``PreconditionReport.by_design``): the offload serves decode graphs, sparse attention is exact."""
    refusals: list[Refusal] = []
    plans: list[GroupGeometry] = []
    PS = opts.resolved_pool_size
    for g in grp.groups:
        chk = Checker(g.owner.layer)
        d0 = g.owner.dims
        B, S, K = d0["B"], d0["S"], d0["K"]
        for s in g.sites:
            d = s.dims
            chk((d["B"], d["S"], d["K"]) == (B, S, K), "group_inconsistent",
                f"group {g.group_id}: layer {s.layer} has (B, S, K) {(d['B'], d['S'], d['K'])} != {(B, S, K)}", s.layer)
            chk(s.dtype in OFFLOAD_DTYPES, "kv_dtype", f"latent cache dtype {s.dtype}: the offload ops take "
                "float16/bfloat16 KV (sparse attention kept)", s.layer)
            chk(0 < d["C"] <= MAX_DKV, "dims", f"Dkv={d['C']} must be in (0, {MAX_DKV}]", s.layer)
            check_rope_width(chk, d["R"], opts, s.layer)  # a NoPE layer's empty rope cache: Dr = 0
            if s.grown:
                _check_grown(chk, s, opts)
            else:
                chk(_cache_length(s) is not None, "cache_layout", f"{s.latent.name}: no index_copy_ / "
                    "static_cache_write_ into the latent cache (cache length unknown)", s.layer)
        # a top-k that is not a multiple of the ops' alignment (glm5_next: index_topk + index_kpool - 1) is
        # padded with -1 (GroupGeometry.ids_width); HF's topk() has no schema limit. A grown cache's top-k
        # width min(index_topk, length) is symbolic: the plan takes its bound
        Kp = padded_topk_width(_width_bound(K))
        check_topk_width(chk, Kp, bounded_by_producer=False)
        check_raw_seq(chk, S, opts)
        SBS = _selection_block(Kp)
        check_pool_size(chk, PS, SBS)
        refusals.extend(chk.refusals)
        if chk.refusals:
            continue
        geos = {s.layer: SiteGeometry(s.layer, s.latent, s.rope, None, None, None, None, s.dims["T"], s.dims["C"],
                                      s.dims["R"], s.dtype, past=s.past) for s in g.sites}
        if g.owner.grown:  # every site grows with the step: its length is the cache's own size
            p = group_geometry(g, B, S, Kp, SBS, _grown_id_range(g.owner, opts)[0], g.owner.latent, geos, opts)
            p.lengths_are_cache_size = True
        else:
            T = max(s.dims["T"] for s in g.sites)
            p = group_geometry(g, B, S, Kp, SBS, T, _cache_length(g.owner), geos, opts)
            p.lengths_are_positions = True  # the cache positions the model writes this step's rows at
        p.ids_width = K if isinstance(K, torch.SymInt) or Kp != K else None
        plans.append(p)
    by_design = None
    if refusals and {r.reason for r in refusals} == {"raw_seq"}:
        by_design = (f"a prefill of S = {grp.groups[0].owner.dims['S']} query tokens: sparse attention without the "
                     "offload (it serves decode graphs)")
    return PreconditionReport(plans, refusals, by_design)


# -- the front-end (the shared core, passes/rewrite.py, does plan / serve / install) -------------------
class HfFrontEnd:
    """The Hugging Face ``transformers`` form: a dense masked attention over every cached position whose
    mask keeps the indexer's top-k. Every site becomes a sparse attention; with offload it reads the
    selection buffers ``dsa_serve`` filled (state of the graph), else it gathers from the caches."""

    name = "hf"
    #: an offload refusal keeps the sparse rewrite (it is exact); the recipe form is left unmodified instead
    on_offload_refusal = PartialRefusal.SPARSE_WITHOUT_OFFLOAD
    detect = staticmethod(detect_hf)

    def check_preconditions(self, gm: fx.GraphModule, grp: GroupReport, example_inputs: Sequence[Any],
                            opts: OffloadOptions) -> PreconditionReport:
        return check_hf_preconditions(gm, grp, opts)

    def emit_site(self, ctx: RewriteCtx, grp: Group, gn: Optional[GroupNodes], s: HfSite) -> SiteEmission:
        """The sparse attention (reading what ``dsa_serve`` placed when offloaded) replaces the dense one."""
        b, d = ctx.b, s.dims
        fill = float(s.combine.args[2]) if s.kind == "eager" else 0.0
        before = [s.scatter.name, s.combine.name, s.attn.name]
        serve = None
        with ctx.g.inserting_before(s.attn):
            if gn is not None:
                # a layer reading an earlier layer's cache reads the rows that layer's serve placed
                if s.layer not in gn.p.pool_source:
                    serve = emit_serve(ctx, gn, s.layer, s.latent, s.rope)
                sel = gn.sel[s.layer]
                # padded ids (GroupGeometry.ids_width): attention reads the plan's ids, -1 masked
                ids = s.topk if gn.p.ids_width is None else b(aten.view.default, gn.tk2, [d["B"], d["S"], gn.p.K])
                T = b(aten.sym_size.int, s.latent, 2) if s.grown else d["T"]  # a grown cache: its own size
                new_attn = b(hf_sparse_attention_rows, s.query, sel.kv, sel.rope, s.weight, ids, s.base_mask,
                             T, s.scaling, d["n"], d["v"], s.kind, fill, s.sinks, s.softmax_dtype, s.dedup)
            else:
                new_attn = b(hf_sparse_attention, s.query, s.latent, s.rope, s.weight, s.topk, s.base_mask,
                             s.scaling, d["n"], d["v"], s.kind, fill, s.sinks, s.softmax_dtype, s.dedup)
        if "example_value" in s.attn.meta:  # Dynamo's key, as on the node it replaces
            new_attn.meta["example_value"] = s.attn.meta["example_value"]
        dense_name = s.attn.name
        s.attn.replace_all_uses_with(new_attn)
        ctx.scratch.setdefault("dead", []).append(s.attn)
        nodes = ([serve] if serve is not None else []) + [new_attn]
        return SiteEmission(dense_name, new_attn, serve, nodes, before, new_attn, kind=s.kind)

    def finish(self, ctx: RewriteCtx) -> dict[str, Any]:
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

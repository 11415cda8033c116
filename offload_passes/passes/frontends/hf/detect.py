"""Detection of the Hugging Face form: one walk over the graph, each scatter-mask verified from its top-k to
the dense attention it feeds (``masks.py``); data flow only, module names are never read. Per layer
(``GlmMoeDsaForCausalLM``)::

    topk = index_scores.topk(K)[1].to(int32)        # full layers; shared layers reuse the node
    index_mask = ones(B, S, T, bool).scatter(-1, topk.long(), False)
    mask = base.masked_fill(index_mask, min) | base & ~index_mask
    out = attention(q, kv_b_proj(latent_cache)..., rope_cache, mask)

The grouping key (``producer``) is the top-k node. A candidate that fails a check is a ``Refusal`` naming
the node and why; a verified form the offload cannot serve is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import fx

from ..._fx import calls, example, strip_views
from ...refusal import Refusal
from ..protocol import Screening, Summary
from .masks import block_bias_site, count_mask_site, is_block_bias, is_int_fresh, scatter_mask_site
from .verify import HfSite, NotVerified, Refused

__all__ = ["HfSite", "HfDetectReport", "detect_hf", "allocated_caches"]


@dataclass
class HfDetectReport:
    sites: list[HfSite]
    candidates: int  # scatter-masks seen (sites + refused)
    topk_nodes: list[str]
    refusals: list[Refusal]
    #: with refusals: the caches the graph allocates itself (a prefill on a new ``StaticCache``)
    allocated: list[str] = field(default_factory=list)

    @property
    def has_dsa(self) -> bool:
        return self.candidates > 0

    @property
    def gathers(self) -> int:  # the backend's "has DSA" counter
        return self.candidates

    def summary(self) -> Summary:
        return Summary({"gathers": self.candidates, "sites": len(self.sites), "indexers": self.topk_nodes,
                        "other_topk": []},
                       {"form": "transformers", "sites": [s.to_dict() for s in self.sites], "offload": False,
                        "offload_refusals": []})

    def screening(self) -> Screening:
        """Detection refusals block, unless the graph allocates the caches it writes (a prefill: dense by
        design); a graph where the dense attention reads fewer rows than the sparse one is left as it is,
        quietly."""
        if self.refusals:
            return Screening(tuple(self.refusals), dense_by_design=self._prefill())
        dense = [s for s in self.sites if not _one_grown_step(s) and s.dims["S"] * s.dims["K"] >= s.dims["T"]]
        if not dense:
            return Screening()
        # e.g. a prefill graph (S = prompt length): S*K selected rows cost more than the T dense ones
        d = dense[0].dims
        return Screening(quiet=(Refusal("dense_cheaper", f"S*K = {d['S']}*{d['K']} >= T = {d['T']} cached positions: "
                                        "the dense attention reads fewer rows; graph left as it is", dense[0].layer),))

    def _prefill(self) -> Optional[str]:
        # the first call on a new StaticCache allocates the cache inside the graph (HF's lazy
        # initialisation, i.e. generate()'s prefill): there is no cache to keep a pool of yet, and the
        # whole prompt attends densely anyway. Dense by design, not a refusal; strict does not apply.
        alloc = self.allocated
        if not alloc:
            return None
        return (f"the graph allocates the KV caches it writes ({', '.join(alloc[:2])}"
                f"{', ...' if len(alloc) > 2 else ''}): a prefill on a new cache runs dense by design; the decode "
                "graphs that read the cache are rewritten")


def _one_grown_step(s: HfSite) -> bool:
    """A decode step (one query token) on a cache grown by concatenation from a past input: one graph serves
    every length of that cache (its length is symbolic), so the screening compares no length: a cache no
    longer than the top-k is served whole, exactly, by the same graph. A one-token prefill (a cache grown
    from nothing) is compared as any prefill is."""
    return s.grown and s.past is not None and s.dims["S"] == 1


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
            if not (n.args and is_int_fresh(n.args[0])):
                continue
            which = count_mask_site
        elif calls(n, "scatter_") and is_block_bias(n):
            which = block_bias_site
        elif calls(n, "scatter"):
            # only bool ones-masks scattered with top-k indices are candidates (the MoE router scatters floats)
            tgt = n.args[0] if n.args else None
            ex = example(tgt)
            if ex is None or ex.dtype != torch.bool:
                continue
            which = scatter_mask_site
        else:
            continue
        layer = cand
        cand += 1
        try:
            sites.append(which(layer, n))
        except Refused as e:
            refusals.append(e.refusal)
        except NotVerified as e:
            refusals.append(Refusal("hf_site_not_verified", f"{n.name}: {e}", layer))
    return HfDetectReport(sites, cand, topks, refusals, allocated_caches(gm) if refusals else [])


_ALLOC = {"zeros", "empty", "full", "ones", "new_zeros", "new_empty", "new_full", "zeros_like", "empty_like"}


def allocated_caches(gm: fx.GraphModule) -> list[str]:
    """Tensors allocated inside the graph and written by ``index_copy_`` (a KV cache the graph creates:
    HF's ``StaticCache`` initialises its layers lazily on their first update)."""
    out = []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method") or not n.args:
            continue
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        if name not in ("index_copy_", "index_copy"):
            continue
        dst = strip_views(n.args[0]) if isinstance(n.args[0], fx.Node) else None
        if dst is not None and dst.op in ("call_function", "call_method"):
            dname = dst.target if dst.op == "call_method" else getattr(dst.target, "__name__", "")
            if str(dname).split(".")[0] in _ALLOC:
                out.append(dst.name)
    return out

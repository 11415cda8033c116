"""Hugging Face caches: the offload pools follow the rows transformers moves between decode steps.

Beam search reorders every cache row after every step (``Cache.reorder_cache(beam_idx)``: new tensors by
``index_select``), so the offload state, which belongs to the tensors it served (``state.REGISTRY``), would
start cold every step. :func:`follow_cache_reorders` wraps ``reorder_cache`` (once per process, from the first
offloaded Hugging Face graph) so the old tensors' state becomes the new ones', its rows gathered by
``beam_idx`` (a row may be taken twice). Exact: a pool row mirrors its cache row and both move together.
The modes that change the batch or cut the cache (a ``DynamicCache``'s ``crop``, ``batch_select_indices``) make
tensors of another shape, which no state is known by: those steps start cold.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from .state import REGISTRY

log = logging.getLogger("offload_passes.hf_reorder")

#: the per-layer tensors of a transformers cache layer the offload reads (the latent and rope caches,
#: ``keys`` / ``values``) and the indexer's keys
LAYER_TENSORS = ("keys", "values", "indexer_keys")
_installed = False


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """The tensors of a transformers cache, layer by layer (``LAYER_TENSORS`` that are tensors)."""
    out = []
    for layer in getattr(cache, "layers", ()):
        for name in LAYER_TENSORS:
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def follow_cache_reorders() -> bool:
    """Wrap transformers' ``Cache.reorder_cache`` once per process; False when transformers is not
    importable."""
    global _installed
    if _installed:
        return True
    try:
        from transformers import cache_utils
    except ImportError:
        return False
    cache_utils.Cache.reorder_cache = _wrap_reorder(cache_utils.Cache.reorder_cache)
    _installed = True
    return True


def _wrap_reorder(orig: Any) -> Any:
    @functools.wraps(orig)
    def reorder_cache(self: Any, beam_idx: torch.LongTensor) -> Any:
        before = cache_tensors(self)
        out = orig(self, beam_idx)
        if before and REGISTRY.serves(before):
            after = cache_tensors(self)
            if len(after) == len(before):
                n = REGISTRY.follow_rows(before, after, beam_idx.tolist())
                log.debug("reorder_cache: %d offload group(s) followed beam_idx", n)
        return out

    return reorder_cache

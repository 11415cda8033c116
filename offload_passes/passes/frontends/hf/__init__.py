"""The Hugging Face front-end (``name = "hf"``): dense DSA attention → sparse attention, then
(optionally) the offload.

For every site found by ``detect_hf`` (``frontends/hf/detect.py``) the dense attention over all T cached
positions is replaced by one call that attends over the K selected positions only
(``frontends/hf/attention.py``):

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

Preconditions and emission: ``frontends/hf/frontend.py``. The dense nodes (scatter-mask, full expansion,
dense attention) are then removed by a local dead-code walk from each replaced attention: only pure nodes
and writes into dead fresh allocations (``key_states = new_empty(...)``) are erased; cache writes and other
in-place ops always stay.
"""
from __future__ import annotations

from .attention import hf_sparse_attention, hf_sparse_attention_rows
from .detect import HfDetectReport, HfSite, detect_hf
from .frontend import HF, HfFrontEnd, dense_masks_left

__all__ = ["HF", "HfFrontEnd", "HfDetectReport", "HfSite", "detect_hf", "hf_sparse_attention",
           "hf_sparse_attention_rows", "dense_masks_left"]

"""The one place that decides which op namespace the model calls.

* ``torch.ops.npu.npu_lightning_indexer`` / ``npu_sparse_flash_attention`` when torch_npu imports, an
  NPU is available and those ops exist (the real recipe);
* else ``torch.ops.offload_ref.*``: the CPU references registered by ``offload_passes.custom_ops``.

The int8 indexer (``li_cache_quant_mode: int8``) calls ``npu_quant_lightning_indexer`` of the same
namespace and quantises with ``dynamic_quant`` (``npu_dynamic_quant`` on the NPU).

``OFFLOAD_PASSES_MODEL_OPS=ref|npu`` forces the choice (``npu`` raises if it is not usable). The
gather is always ``torch.ops.custom.npu_gather_selection_kv_cache`` (CANN's custom-op namespace; our
package registers CPU kernels for it).

The model calls the op *packets* directly, so a Dynamo graph shows e.g.
``torch.ops.offload_ref.npu_lightning_indexer.default`` nodes the offload pass can match.
"""
from __future__ import annotations

import importlib.util
import logging
import os

import torch

import offload_passes.custom_ops  # noqa: F401  (registers custom:: and offload_ref:: ops)

log = logging.getLogger("offload_passes.models.npu_ops")


def _npu_namespace_usable() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401

        if not torch.npu.is_available():  # type: ignore[attr-defined]
            return False
        ns = torch.ops.npu
        ns.npu_lightning_indexer  # noqa: B018 - attribute lookup raises if missing
        ns.npu_sparse_flash_attention  # noqa: B018
        return True
    except Exception as e:  # torch_npu without CANN / device: stay on the references
        log.debug("torch_npu not usable (%s); using offload_ref ops", e)
        return False


def _choose() -> str:
    forced = os.environ.get("OFFLOAD_PASSES_MODEL_OPS", "").strip().lower()
    if forced == "ref":
        return "offload_ref"
    if forced == "npu":
        if not _npu_namespace_usable():
            raise RuntimeError("OFFLOAD_PASSES_MODEL_OPS=npu but torch_npu / an NPU / its ops are not available")
        return "npu"
    if forced:
        raise RuntimeError(f"OFFLOAD_PASSES_MODEL_OPS must be 'ref' or 'npu', got {forced!r}")
    return "npu" if _npu_namespace_usable() else "offload_ref"


#: ``"npu"`` or ``"offload_ref"``.
OPS_NAMESPACE: str = _choose()
_ns = getattr(torch.ops, OPS_NAMESPACE)

lightning_indexer = _ns.npu_lightning_indexer
sparse_flash_attention = _ns.npu_sparse_flash_attention
gather_selection_kv_cache = torch.ops.custom.npu_gather_selection_kv_cache


try:  # a torch_npu without the int8 indexer still runs the unquantised model
    #: ``npu_quant_lightning_indexer`` of the chosen namespace (one output: the top-k ids), or None.
    quant_lightning_indexer = _ns.npu_quant_lightning_indexer
except (AttributeError, RuntimeError):
    quant_lightning_indexer = None


def dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 quantisation over the last dim: ``(int8 x, fp32 scale [...])`` with
    ``x ~= q * scale`` (``torch_npu.npu_dynamic_quant`` on the NPU; this torch form elsewhere).

    ``scale = max|x| / 127``; an all-zero row gets scale 0 and q 0 (no division by zero).
    """
    if OPS_NAMESPACE == "npu":
        return torch.ops.npu.npu_dynamic_quant(x)
    h = x.float()
    scale = h.abs().amax(dim=-1) / 127.0
    q = torch.round(h / scale.clamp_min(1e-30).unsqueeze(-1)).clamp(-128, 127).to(torch.int8)
    return q, scale


#: ``cache_write: inplace`` (the reference's graph: caches written by in-place ops, not ``index_put_``).
#: Always the ``offload_ref`` test doubles (custom_ops/cache_write.py): on the NPU the KV write is part
#: of the fused MLA prolog this model does not call, and torch_npu's ``npu_scatter_nd_update_`` returns
#: an alias of its input, which the double cannot.
mla_prolog_cache_write_ = torch.ops.offload_ref.npu_mla_prolog_cache_write_
scatter_nd_update_ = torch.ops.offload_ref.npu_scatter_nd_update_


log.debug("GLM model uses torch.ops.%s for the indexer and SFA", OPS_NAMESPACE)

"""CUDA run-time helpers: the full KV caches in pinned host memory, pools and selection on the device.

``dsa_serve``'s Triton kernel reads the rows a step misses straight from the pinned cache (zero-copy: under
UVA a pinned tensor's ``data_ptr()`` is also its device address). Writes of new rows go through
ops whose CUDA kernel stores through that address (``npu_mla_prolog_cache_write_``, HF's
``static_cache_write_``); a plain ``StaticCache`` writes with ``index_copy_`` and is refused.

* :func:`plan_placement` (pure): what moves to the host (recipe ``kv_cache`` / ``k_rope_cache``, HF
  ``keys`` / ``values``); everything else stays on the device. :func:`place_full_caches` applies it.
* :func:`kv_bytes`: device and host bytes of a plan. :func:`host_pinned`: pins without a transient copy or
  power-of-two rounding. :func:`raise_device_errors`: what the device-side guards flagged.
  :func:`before_host_write`: a host write into pinned caches ordered after the kernels that use them.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Iterable, List, Union

import torch

from .custom_ops.cuda._common import raise_device_errors  # noqa: E402  (re-exported: call it after the last step)

log = logging.getLogger("offload_passes.cuda")

__all__ = ["Placement", "plan_placement", "place_full_caches", "kv_bytes", "require_cuda", "raise_device_errors",
           "host_pinned", "release_host", "host_bytes_per_token", "before_host_write", "HOST", "DEVICE"]

HOST, DEVICE = "host", "device"
#: recipe-form attention buffers: the full caches (host) and what the offload adds beside them (device)
RECIPE_FULL = ("kv_cache", "k_rope_cache")
RECIPE_DEVICE = ("sel_kv", "sel_rope", "sel_block_table", "sel_status")
#: HF StaticCache layer tensors: latent and rope (host) and the indexer's keys (device)
HF_FULL = ("keys", "values")
HF_DEVICE = ("indexer_keys",)


@dataclass(frozen=True)
class Placement:
    """Where one cache tensor goes."""

    name: str            # ``layers.3.self_attn.kv_cache`` or ``cache.layers[3].keys``
    role: str            # full_latent, full_rope, selection, table, ledger, indexer
    where: str           # HOST (pinned) or DEVICE
    shape: tuple
    dtype: str
    nbytes: int

    def to_dict(self) -> dict:
        return asdict(self)


_ROLES = {"kv_cache": "full_latent", "k_rope_cache": "full_rope", "keys": "full_latent", "values": "full_rope",
          "sel_kv": "selection", "sel_rope": "selection", "sel_block_table": "table", "sel_status": "ledger",
          "indexer_keys": "indexer", "key_cache": "indexer", "key_scale_cache": "indexer"}


def _entry(name: str, attr: str, t: torch.Tensor, where: str) -> Placement:
    return Placement(name, _ROLES[attr], where, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                     t.numel() * t.element_size())


def _is_static_cache(obj: Any) -> bool:
    layers = getattr(obj, "layers", None)
    return isinstance(layers, (list, tuple)) and bool(layers) and all(hasattr(l, "keys") for l in layers)


def _targets(obj: Any) -> List[tuple]:
    """``(owner, attr, name, where)`` of every cache tensor the plan places."""
    out = []
    if isinstance(obj, torch.nn.Module):
        found = False
        for mname, mod in obj.named_modules():
            bufs = dict(mod.named_buffers(recurse=False))
            if not all(a in bufs for a in RECIPE_FULL):
                continue
            found = True
            if not getattr(mod, "enable_offload", False) or "sel_kv" not in bufs:
                raise ValueError(f"plan_placement: {mname or type(mod).__name__} was built without enable_offload "
                                 "(no selection buffers): host-resident caches need the offload model "
                                 "(models.build(..., enable_offload=True))")
            pre = f"{mname}." if mname else ""
            for a in RECIPE_FULL:
                out.append((mod, a, pre + a, HOST))
            for a in RECIPE_DEVICE:
                out.append((mod, a, pre + a, DEVICE))
            idx = getattr(mod, "indexer", None)
            if idx is not None:
                for a in ("key_cache", "key_scale_cache"):
                    if a in dict(idx.named_buffers(recurse=False)):
                        out.append((idx, a, f"{pre}indexer.{a}", DEVICE))
        if not found:
            raise ValueError(f"plan_placement: {type(obj).__name__} has no attention module with buffers "
                             f"{RECIPE_FULL} (a recipe-form GLM-5.2 model from offload_passes.models); for a "
                             "Hugging Face model pass its StaticCache")
        return out
    if _is_static_cache(obj):
        host_cache = _host_kv(obj)
        for i, layer in enumerate(obj.layers):
            if host_cache and not _host_kv(layer):
                continue  # a HostStaticCache's other layers (sliding windows, ...) stay as transformers made them
            for a in HF_FULL + HF_DEVICE:
                t = getattr(layer, a, None)
                if not isinstance(t, torch.Tensor):
                    if a in HF_FULL:
                        raise ValueError(f"plan_placement: cache.layers[{i}].{a} is not initialised "
                                         "(run one prefill step before placing a StaticCache)")
                    continue
                out.append((layer, a, f"cache.layers[{i}].{a}", HOST if a in HF_FULL else DEVICE))
        return out
    raise TypeError(f"plan_placement: expected a recipe-form model (torch.nn.Module) or a transformers "
                    f"StaticCache, got {type(obj).__name__}")


def _host_kv(obj: Any) -> bool:
    """``obj`` is an ``offload_passes.hf_cache`` host-KV cache or layer (they say so: ``host_kv = True``;
    ``hf_cache`` imports this module, not the other way round)."""
    return getattr(type(obj), "host_kv", False) is True


def plan_placement(obj: Any) -> List[Placement]:
    """What :func:`place_full_caches` would do with ``obj`` (no tensor is touched; CPU-safe)."""
    return [_entry(name, attr, getattr(owner, attr), where) for owner, attr, name, where in _targets(obj)]


def kv_bytes(plan: Iterable[Placement]) -> dict:
    """``{"host": bytes, "device": bytes, "device_kv": bytes}``: ``device_kv`` counts the latent / rope
    bytes the device holds (selection buffers here; the backend's pools come on top) and the indexer."""
    out = {HOST: 0, DEVICE: 0, "device_kv": 0}
    for p in plan:
        out[p.where] += p.nbytes
        if p.where == DEVICE and p.role in ("selection", "indexer"):
            out["device_kv"] += p.nbytes
    return out


def require_cuda(what: str) -> None:
    """Raise a clear error on a machine without a usable CUDA device."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"offload_passes.cuda.{what}: pinned host memory and CUDA kernels need a CUDA device "
                           f"(torch.cuda.is_available() is False, torch {torch.__version__}); on a CPU machine "
                           "use the CPU exe_modes (eager / inductor), whose full caches are ordinary host memory")


#: cudaHostRegister flags: portable (every context) | mapped (a device address; under UVA the host address)
HOST_REGISTER_FLAGS = 1 | 2
#: data_ptr -> the host tensor registered by :func:`host_pinned` (kept alive: registered memory must not be
#: freed while registered; :func:`release_host` unregisters it)
_REGISTERED: dict = {}


def host_bytes_per_token(latent: int, rope: int, layers: int, elem: int = 2) -> int:
    """Host bytes of the full caches per token of context and batch row: ``layers * (latent + rope) * elem``
    (GLM-5: 78 x (512 + 64) x 2 = 89,856 B, so 5.5 GiB per row at 64K and 754 GB for B = 128)."""
    return layers * (latent + rope) * elem


def _register(t: torch.Tensor) -> None:
    ptr, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, HOST_REGISTER_FLAGS))
    if err != 0:
        raise RuntimeError(f"offload_passes.cuda: cudaHostRegister of {nbytes} bytes failed with cudaError {err} "
                           "(locked-memory limit? `ulimit -l`)")
    _REGISTERED[ptr] = t


def host_pinned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s contents in page-locked host memory of exactly its size, with no transient copy:

    * a pinned host tensor is returned as it is;
    * a dense pageable host tensor is registered in place (``cudaHostRegister``; no copy at all);
    * anything else (a CUDA tensor, a strided view) is copied once into a new exact-size host tensor,
      registered before the copy (the device writes it directly).

    Why not ``Tensor.pin_memory()`` / ``torch.empty(pin_memory=True)``: torch's caching host allocator
    rounds every block up to a power of two (a cache of ``ctx + 7`` rows takes twice its size) and
    ``t.to("cpu").pin_memory()`` first makes a pageable copy of the whole cache.
    """
    require_cuda("host_pinned")
    if t.device.type == "cpu" and t.is_pinned():
        return t
    if t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0 \
            and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        _register(t)
        return t
    out = torch.empty(t.shape, dtype=t.dtype)  # pageable, exact size: registered below, then filled
    _register(out)
    out.copy_(t)
    return out


def release_host(t: torch.Tensor) -> None:
    """Unregister a tensor :func:`host_pinned` registered (before dropping the last reference to it)."""
    ptr = t.untyped_storage().data_ptr()
    if _REGISTERED.pop(ptr, None) is not None:
        err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if err != 0:
            raise RuntimeError(f"offload_passes.cuda: cudaHostUnregister failed with cudaError {err}")


def _set(owner: Any, attr: str, t: torch.Tensor) -> None:
    if isinstance(owner, torch.nn.Module) and attr in owner._buffers:
        owner._buffers[attr] = t
    else:
        setattr(owner, attr, t)


def place_full_caches(obj: Any, device: Union[str, torch.device, None] = None) -> List[Placement]:
    """Move ``obj``'s full latent / rope caches into pinned host memory and its selection buffers, tables,
    ledgers and indexer caches onto ``device`` (default: the current CUDA device). Contents are kept.

    Call it after ``model.to("cuda")`` (which moves every buffer, the full caches too) and before
    ``torch.compile``: the backend's state (pools, metadata) is then allocated beside the selection
    buffers, on the device. Returns the plan applied.
    """
    if _is_static_cache(obj) and not _host_kv(obj):
        raise TypeError(f"place_full_caches: a transformers {type(obj).__name__} writes its rows with index_copy_, "
                        "which torch (and Dynamo, tracing it) refuse for a host cache with device rows; build "
                        "offload_passes.hf_cache.HostStaticCache(model.config, max_cache_len, batch_size=..., "
                        "device=..., dtype=...) instead (docs/hf.md, Host KV)")
    require_cuda("place_full_caches")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        raise ValueError(f"place_full_caches: device must be a CUDA device, got {dev}")
    targets = _targets(obj)
    if _is_static_cache(obj):  # a HostStaticCache's layers: counters with the device tensors (their update reads them)
        for owner in {id(o): o for o, *_ in targets}.values():
            for a in ("cumulative_length", "indexer_cumulative_length"):
                if isinstance(getattr(owner, a, None), torch.Tensor):
                    setattr(owner, a, getattr(owner, a).to(dev))
            owner.device = dev
            if getattr(owner, "indexer_keys", None) is not None:
                owner.indexer_device = dev
    for owner, attr, name, where in targets:
        t = getattr(owner, attr)
        if where == HOST:
            new = host_pinned(t)
        else:
            new = t.to(dev)
        if new is not t:
            _set(owner, attr, new)
            log.debug("%s -> %s (%s)", name, "pinned host" if where == HOST else dev, tuple(new.shape))
    plan = [_entry(name, attr, getattr(owner, attr), where) for owner, attr, name, where in targets]
    b = kv_bytes(plan)
    log.info("full caches pinned on the host: %.1f MiB; device caches: %.1f MiB", b[HOST] / 2 ** 20, b[DEVICE] / 2 ** 20)
    return plan


def before_host_write(device: Union[str, torch.device]) -> None:
    """Wait until every kernel launched on ``device`` so far has finished, before the host itself writes into
    pinned caches those kernels read or write (a row reset, a reorder, a synthetic fill): ``dsa_serve`` reads
    missed rows and the cache-write kernels store rows through the same addresses, asynchronously, on any
    stream of the device. Nothing to wait for on a CPU device, without a CUDA driver or before the first
    CUDA call. Not for a captured region (a synchronisation); writes inside a step go through the
    cache-write kernels on the stream instead."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize(dev)
        log.debug("host write into pinned caches: waited for %s", dev)

"""FX pass (``exe_mode="cuda"``, ``CudaLowering.passes``, pre-AOT after the rewrite): an ATen in-place write
into a host-resident graph input gets host operands.

With host KV (``cuda.place_full_caches``) the full caches are pinned host tensors. The model's own writes
(``offload_ref::npu_mla_prolog_cache_write_``, ``static_cache_write_``) store through the pinned address and
are left alone (:func:`host_write_ops`). An ATen write with device operands (only an FX graph built without
Dynamo has one: Dynamo refuses mixed devices) gets each operand copied to the host, once while unwritten::

    before:  index_put_(host_cache, [slots_cuda], rows_cuda)
    after:   s = _to_copy(slots_cuda, device=cpu); r = _to_copy(rows_cuda, device=cpu)
             index_put_(host_cache, [s], r)          # synchronous copies: the host write sees the rows

Nothing changes when the devices agree, nor for writes into device tensors.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import fx

from . import _fx

log = logging.getLogger("offload_passes.passes.host_cache_writes")

__all__ = ["HostCacheWritesReport", "host_cache_writes", "host_write_ops", "HOST_DEVICE_TYPE"]

aten = torch.ops.aten
#: the device type of a host-resident cache (pinned memory is a ``cpu`` tensor)
HOST_DEVICE_TYPE = "cpu"


@dataclass
class HostCacheWritesReport:
    """What :func:`host_cache_writes` did to one graph."""

    rewritten: int = 0  # writes into a host graph input whose operands were moved to the host
    nodes: List[str] = field(default_factory=list)  # their node names, in graph order
    copies: List[str] = field(default_factory=list)  # the ``_to_copy`` nodes inserted, in graph order
    skipped: List[Tuple[str, str]] = field(default_factory=list)  # (node name, why) of writes left as they are

    def to_dict(self) -> dict:
        return asdict(self)


def _device(node: Any) -> Optional[torch.device]:
    """Device of a node's example value, else of the tensor it views (a view keeps the device)."""
    v = _fx.example(node)
    if v is None:
        v = _fx.example(_fx.strip_views(node))
    return v.device if v is not None else None


def _tensor_nodes(args: Any) -> List[fx.Node]:
    """Argument nodes (also inside tuples / lists / slices / dicts) in first-use order, each once."""
    out: List[fx.Node] = []
    fx.node.map_arg(args, lambda n: out.append(n) if n not in out else None)
    return out


def _host_destinations(node: fx.Node) -> Tuple[List[fx.Node], Optional[torch.device], Optional[str]]:
    """The written arguments of ``node`` rooted at a graph input, their one device, and why not when the
    write is one to leave alone (written arguments on several devices)."""
    written = [w for w in _fx.written_inputs(node) if isinstance(w, fx.Node)]
    if not written or not any(_fx.is_graph_input_or_attr(_fx.strip_views(w)) for w in written):
        return [], None, None
    # the tensor a view writes through is its root's: a view's own example value is not needed
    devices = {_device(_fx.strip_views(w)) or _device(w) for w in written}
    if None in devices:  # no example value: nothing to decide from (a symbolically traced graph)
        return [], None, None
    if len(devices) > 1:
        return written, None, f"writes tensors on several devices {sorted(str(d) for d in devices)}"
    return written, devices.pop(), None


def host_write_ops() -> frozenset:
    """Write ops whose CUDA kernel takes a pinned host destination with device operands (the stores go
    through the pinned address, ``custom_ops/cuda/cache_write.py``, ``custom_ops/cuda/static_cache_write.py``):
    left as they are."""
    packets = (torch.ops.offload_ref.npu_mla_prolog_cache_write_,  # Dynamo records the packet the model calls
               torch.ops.offload_ref.static_cache_write_)  # the HF host-KV cache's (offload_passes/hf_cache.py)
    return frozenset({p for packet in packets for p in (packet, packet.default)})


def host_cache_writes(gm: fx.GraphModule) -> HostCacheWritesReport:
    """Move the device operands of every in-place write into a host-resident graph input to the host
    (see the module doc); recompiles ``gm`` when it changed anything. Returns the report."""
    rep = HostCacheWritesReport()
    graph = gm.graph
    moved: Dict[Tuple[fx.Node, str], fx.Node] = {}  # (operand, host device) -> its host copy
    for node in list(graph.nodes):
        # a host copy is shared only while its source is unchanged: an in-place write to the source
        # (or to what it views) in between makes the next write copy it again
        changed = {_fx.strip_views(w) for w in _fx.written_inputs(node) if isinstance(w, fx.Node)}
        if changed:
            for key in [k for k in moved if _fx.strip_views(k[0]) in changed]:
                del moved[key]
        if node.target in host_write_ops():  # its CUDA kernel stores into the pinned cache itself
            continue
        written, dest, why = _host_destinations(node)
        if why is not None:
            rep.skipped.append((node.name, why))
            log.warning("%s: not rewritten: %s", node.name, why)
            continue
        if dest is None or dest.type != HOST_DEVICE_TYPE:
            continue
        operands = [a for a in _tensor_nodes((node.args, node.kwargs)) if a not in written]
        off = [a for a in operands if (d := _device(a)) is not None and d != dest]
        if not off:
            continue
        swap: Dict[fx.Node, fx.Node] = {}
        for a in off:
            key = (a, str(dest))
            if key not in moved:
                with graph.inserting_before(node):
                    # synchronous: the host write right after must see the rows (module doc)
                    c = graph.create_node("call_function", aten._to_copy.default, (a,), {"device": dest},
                                          name=f"{a.name}_host")
                _fx.set_fake_val(c)
                moved[key] = c
                rep.copies.append(c.name)
            swap[a] = moved[key]
        node.args, node.kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: swap.get(n, n))
        rep.rewritten += 1
        rep.nodes.append(node.name)
        log.debug("%s: %d operand(s) moved to %s before the write", node.name, len(off), dest)
    if rep.rewritten:
        graph.lint()
        gm.recompile()
        log.info("host cache writes: %d write(s) into host caches get host operands (%d copies)",
                 rep.rewritten, len(rep.copies))
    return rep

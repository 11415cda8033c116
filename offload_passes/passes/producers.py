"""The DSA top-k producers the passes recognise: the ONE table to extend for a new indexer op.

A top-k producer is an op whose output (or one output of it) is the ``[T, 1, K]`` int32 id tensor a
``custom.npu_gather_selection_kv_cache`` reads as ``selection_topk_indices``. Each entry says how to
reach those ids from the op's call node:

* ``output=0``: the op returns a tuple, the ids are ``getitem(call, 0)`` (``npu_lightning_indexer``
  returns ``(sparse_indices, sparse_values)``);
* ``output=None``: the op returns the ids tensor itself (``npu_quant_lightning_indexer``).

Ops are matched by their short name in any namespace (``npu::`` on the device, ``custom::`` from
CANN's extension, ``offload_ref::`` for our CPU references). Detection, op counts, the dump report
and ``offload-inspect`` all read this table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import fx

from ._targets import getitem_of, op_name


@dataclass(frozen=True)
class TopkProducer:
    name: str  # short op name (namespace-free)
    output: Optional[int]  # tuple index of the ids, or None when the op returns the ids tensor
    short: str  # short label used by the dump report / offload-inspect
    key_arg: str = "key"  # argument holding the indexer's (paged) key cache


TOPK_PRODUCERS: tuple[TopkProducer, ...] = (
    TopkProducer("npu_lightning_indexer", 0, "indexer"),
    TopkProducer("npu_quant_lightning_indexer", None, "qindexer"),
)
PRODUCER_NAMES: frozenset[str] = frozenset(p.name for p in TOPK_PRODUCERS)
_BY_NAME = {p.name: p for p in TOPK_PRODUCERS}


def producer_of_call(node: Any) -> Optional[TopkProducer]:
    """The table entry if ``node`` calls a known top-k producer op (any namespace), else None."""
    if not isinstance(node, fx.Node):
        return None
    name = op_name(node)
    if name is None:
        return None
    return _BY_NAME.get(name.partition("::")[2])


def topk_source(root: Any) -> Optional[fx.Node]:
    """The producer call whose ids ``root`` is (views already stripped), else None.

    ``root`` must be exactly the producer's ids: ``getitem(call, output)`` for tuple producers, the
    call itself for single-output producers; any other output (e.g. the values) is not a source.
    """
    gi = getitem_of(root)
    if gi is not None:
        p = producer_of_call(gi[0])
        return gi[0] if p is not None and p.output == gi[1] else None
    p = producer_of_call(root)
    return root if p is not None and p.output is None else None

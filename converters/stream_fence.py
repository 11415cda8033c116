"""Is an in-place write ordered against its users on other streams by tagged events?

npugraph_ex 2.13 answers this itself (``verify_cross_stream_event_protected``); the npugraph_ex and
TorchAir copies in torch-npu 2.8 (and TorchAir's in 2.13) only accept users that all sit on one
stream, so a side-stream install fenced by events, the topology :mod:`offload_passes.lowering.npu`
emits, would stay functional there (a full pool copy per layer and step). Where the package has no
event-aware check, :func:`register_reinplace` uses :func:`event_fenced` instead.

Ordering model (the one the runtime gives): nodes on one stream run in graph order; a
``tagged_event_wait(tag)`` on stream B orders everything after it on B after every
``tagged_event_record(tag)`` issued before it on stream A. Stream labels are the ``stream_label``
node meta npugraph_ex sets before its reinplace pass (``None`` = main stream).
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from torch import fx

log = logging.getLogger("offload_passes.converters")

_RECORDS = ("tagged_event_record", "tagged_event_record_on_stream")
_WAITS = ("tagged_event_wait", "tagged_event_wait_on_stream")
_UNLABELLED = object()


def _short_op_name(node: fx.Node) -> str:
    """``air.tagged_event_record.default`` -> ``tagged_event_record`` (any namespace: ``air`` in
    npu 2.8, ``npugraph_ex`` in 2.13)."""
    name = getattr(node.target, "__name__", str(node.target))
    parts = str(name).split(".")
    return parts[-2] if len(parts) >= 2 and parts[-1] == "default" else parts[-1]


def _stream(node: fx.Node):
    return node.meta.get("stream_label", _UNLABELLED)


def _events(graph: fx.Graph) -> Tuple[Dict[fx.Node, int], Dict[str, List[Tuple[object, int]]],
                                      Dict[str, List[Tuple[object, int]]]]:
    pos: Dict[fx.Node, int] = {}
    records: Dict[str, List[Tuple[object, int]]] = {}
    waits: Dict[str, List[Tuple[object, int]]] = {}
    for i, n in enumerate(graph.nodes):
        pos[n] = i
        if n.op != "call_function" or not n.args or not isinstance(n.args[0], str):
            continue
        name = _short_op_name(n)
        if name in _RECORDS:
            records.setdefault(n.args[0], []).append((_stream(n), i))
        elif name in _WAITS:
            waits.setdefault(n.args[0], []).append((_stream(n), i))
    return pos, records, waits


def _ordered_after(start_stream, start: int, records, waits) -> Dict[object, int]:
    """stream -> position p such that nodes on that stream after p run after the start node."""
    after = {start_stream: start}
    changed = True
    while changed:  # fixed point over event edges; graphs have a handful of tags per layer
        changed = False
        for tag, recs in records.items():
            for r_stream, r_pos in recs:
                if r_stream not in after or r_pos <= after[r_stream]:
                    continue  # this record is not ordered after the start node
                for w_stream, w_pos in waits.get(tag, ()):
                    if w_pos > r_pos and (w_stream not in after or w_pos < after[w_stream]):
                        after[w_stream] = w_pos
                        changed = True
    return after


def _ordered_before(start_stream, start: int, records, waits) -> Dict[object, int]:
    """stream -> position p such that nodes on that stream before p run before the start node."""
    before = {start_stream: start}
    changed = True
    while changed:
        changed = False
        for tag, ws in waits.items():
            for w_stream, w_pos in ws:
                if w_stream not in before or w_pos >= before[w_stream]:
                    continue  # this wait is not ordered before the start node
                for r_stream, r_pos in records.get(tag, ()):
                    if r_pos < w_pos and (r_stream not in before or r_pos >= before[r_stream]):
                        before[r_stream] = r_pos + 1
                        changed = True
    return before


def event_fenced(node: fx.Node, users: Iterable[fx.Node]) -> bool:
    """True when every user of ``node``'s mutated inputs either shares its stream or is ordered
    after (or before) it through tagged record/wait events. Unlabelled nodes are never accepted
    across streams."""
    return _fenced(node, [list(users)])


def _fenced(node: fx.Node, user_lists: List[List[fx.Node]]) -> bool:
    """:func:`event_fenced` for several user lists (one per mutated input), walking the graph once."""
    stream = _stream(node)
    if stream is _UNLABELLED:  # the package did not label this graph: same rule as its own check
        return all(len(us) < 2 or (len({_stream(u) for u in us}) == 1 and _stream(us[0]) is not _UNLABELLED)
                   for us in user_lists)
    cross = [u for us in user_lists for u in us if _stream(u) != stream]
    if not cross:
        return True
    pos, records, waits = _events(node.graph)
    after = _ordered_after(stream, pos[node], records, waits)
    before = _ordered_before(stream, pos[node], records, waits)
    for u in cross:
        s, p = _stream(u), pos.get(u, -1)
        if s is _UNLABELLED or not ((s in after and p > after[s]) or (s in before and p < before[s])):
            log.debug("%s: user %s on stream %r is not ordered by events", node.name, u.name, s)
            return False
    return True


def fenced_stream_check(users_of: Callable[[fx.Node, List[int]], List[List[fx.Node]]],
                        indices: List[int]) -> Callable[[fx.Node], bool]:
    """A ``stream_check(node)`` for the registry's ``extra_check``: :func:`event_fenced` over the
    users of each mutated input, found by the package's own ``get_inplace_op_mutated_input_users``."""

    def check(node: fx.Node) -> bool:
        return _fenced(node, [list(us) for us in users_of(node, indices)])

    return check

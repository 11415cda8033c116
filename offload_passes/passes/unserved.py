"""Graphs no front-end owns that still hold part of a DSA selection: refused by name, not passed through.

An indexer's cache or code without the attention that reads its top-k (a decode step split over graphs by
graph breaks: ``indexer_split``), or an attention module's own top-k of another shape (``attention_topk``).
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Any, Optional

from torch import fx

from . import _fx
from .refusal import Refusal

__all__ = ["unserved_selection", "indexer_without_site", "attention_topk_without_site"]


def unserved_selection(gm: fx.GraphModule) -> Optional[Refusal]:
    """The refusal of a graph without a DSA site that holds a selection no front-end serves; None if none."""
    return indexer_without_site(gm) or attention_topk_without_site(gm)


#: what names an indexer in a graph: a graph input named after one (Dynamo names inputs by their source:
#: transformers' DSA caches keep ``indexer_keys``, the models an ``indexer`` submodule), or a node traced
#: from code of a class named ``*Indexer`` (the classes models/hf/survey.py counts): its module in
#: ``nn_module_stack``, or (a frame resumed after a graph break has no module stack) the class around a
#: line of its ``stack_trace``
_INDEXER = "indexer"
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


@functools.lru_cache(maxsize=64)
def _class_spans(path: str) -> tuple[tuple[int, int, str], ...]:
    """``(first line, last line, class name)`` of every class in the source file ``path`` (none if unreadable)."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return ()
    return tuple((c.lineno, c.end_lineno or c.lineno, c.name) for c in ast.walk(tree) if isinstance(c, ast.ClassDef))


def _indexer_classes(gm: fx.GraphModule) -> list[str]:
    out: set[str] = set()
    frames: set[tuple[str, int]] = set()
    for n in gm.graph.nodes:
        out.update(name for name in map(_class_name, (n.meta.get("nn_module_stack") or {}).values())
                   if name.endswith("Indexer"))
        frames.update((f, int(line)) for f, line in _FRAME.findall(n.meta.get("stack_trace") or ""))
    for path, line in frames:
        out.update(name for lo, hi, name in _class_spans(path) if lo <= line <= hi and name.endswith("Indexer"))
    return sorted(out)


def indexer_without_site(gm: fx.GraphModule) -> Optional[Refusal]:
    """The ``indexer_split`` refusal of a graph that holds part of an indexer (its cache or its code) but
    no DSA site any front-end detects; None for any other graph."""
    names = [n.name for n in gm.graph.nodes if n.op in ("placeholder", "get_attr") and _INDEXER in n.name.lower()]
    classes = _indexer_classes(gm)
    if not names and not classes:
        return None
    what = f"the indexer's {'code (' + classes[0] + ')' if classes else 'cache ' + names[0]}"
    return Refusal("indexer_split", f"the graph holds {what} but no sparse attention that reads its top-k: the "
                   "decode step is split over several graphs (graph breaks: torch.compile without fullgraph=True, "
                   "or Python that Dynamo cannot trace in one graph), so the indexer and the attention it selects "
                   "for are never in one graph to rewrite; torch.compile(..., fullgraph=True) names the break")


def _class_name(entry: Any) -> str:
    """The class of an ``nn_module_stack`` entry (``(path, class or its qualified name)``)."""
    return entry[1].__name__ if isinstance(entry[1], type) else str(entry[1]).rsplit(".", 1)[-1]


def attention_topk_without_site(gm: fx.GraphModule) -> Optional[Refusal]:
    """The ``attention_topk`` refusal of a graph with no DSA site where an attention module ranks keys with a
    top-k of its own (the innermost module of the ``topk`` node is an ``*Attention`` class; an MoE router's
    top-k sits in its own module); None for any other graph."""
    for n in gm.graph.nodes:
        stack = list((n.meta.get("nn_module_stack") or {}).values())
        if _fx.calls(n, "topk") and stack and _class_name(stack[-1]).endswith("Attention"):
            owner = _class_name(stack[-1])
            return Refusal("attention_topk", f"{owner} selects keys with a top-k of its own ({n.name}), which no "
                           "front-end recognises as an indexer's selection feeding sparse attention: the offload "
                           "serves one indexer top-k per query row, shared by the heads of a group of layers; a "
                           "selection of another shape (per head, over scores the attention computes itself) "
                           "would need a plan per head over its KV heads' caches")
    return None

"""Which model families of the installed ``transformers`` select attention keys with an indexer: read from
the package's source files (nothing is imported from the model folders), so a release that adds a family
is noticed without anyone naming it.

A *family* is a folder ``transformers/models/<family>/``; its *decoding model types* are the model types
whose config class lives in that folder and that transformers maps to a causal-LM or image-text-to-text
class (what a decode loop with a KV cache runs; ``families.model_class``). A family **has an indexer**
when it has at least one decoding model type and at least one of these holds:

* **indexer class** — ``modeling_<family>.py`` defines a class whose name ends in ``Indexer``
  (``GlmMoeDsaIndexer``, ``Qwen4ExpTextQSAIndexer``, ...);
* **indexer config field** — a ``configuration_*.py`` of the folder declares a field (a class-level
  annotation, an ``__init__`` parameter or a ``self.<name> =`` assignment) named ``index_*`` or
  ``indexer_*`` (``index_topk``, ``indexer_types``, ``index_topk_blocks``, ``indexer_budget``, ...);
* **top-k into attention** — in one function of ``modeling_<family>.py``, a value derived from a
  ``topk(...)`` call (through assignments, in-place writes such as ``mask.scatter_(-1, ids, 0)``, or the
  return value of another function of that file that returns one) is an argument of a call whose
  callee's name contains ``attention`` (``eager_attention_forward``, ``attention_interface``,
  ``scaled_dot_product_attention``, ...). An MoE router's top-k feeds the experts, never an attention
  call, so routers alone do not count.

:func:`survey` returns the evidence per family; ``families.FAMILY_TABLE`` must account for every family it
finds (``tests/hf/test_zoo.py``).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

__all__ = ["FamilyEvidence", "config_fields", "indexer_classes", "survey", "topk_into_attention",
           "transformers_models_dir", "decoding_model_types"]

_INDEXER_CLASS = re.compile(r"Indexer$")
_INDEXER_FIELD = re.compile(r"^(index|indexer)_[a-z0-9_]+$")


@dataclass(frozen=True)
class FamilyEvidence:
    family: str  # the folder under transformers/models/
    model_types: tuple[str, ...]  # its decoding model types
    indexer_classes: tuple[str, ...]  # classes named *Indexer in modeling_<family>.py
    config_fields: tuple[str, ...]  # index_* / indexer_* fields of its configuration files
    topk_into_attention: tuple[str, ...]  # functions ("Class.method") where a top-k reaches an attention call

    @property
    def has_indexer(self) -> bool:
        return bool(self.model_types) and bool(self.indexer_classes or self.config_fields
                                               or self.topk_into_attention)

    def signals(self) -> list[str]:
        """The criteria that hold, by name (docs/hf.md's family table)."""
        return [name for name, hit in (("indexer class", self.indexer_classes), ("config field", self.config_fields),
                                       ("top-k into attention", self.topk_into_attention)) if hit]


def indexer_classes(tree: ast.Module) -> list[str]:
    """Classes defined in the module whose name ends in ``Indexer``."""
    return sorted(n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and _INDEXER_CLASS.search(n.name))


def config_fields(tree: ast.Module) -> list[str]:
    """``index_*`` / ``indexer_*`` fields declared by the config classes of a configuration module."""
    found: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for st in cls.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                found.add(st.target.id)
            elif isinstance(st, ast.Assign):
                found.update(t.id for t in st.targets if isinstance(t, ast.Name))
            elif isinstance(st, ast.FunctionDef) and st.name == "__init__":
                found.update(a.arg for a in st.args.args + st.args.kwonlyargs)
                for n in ast.walk(st):
                    if isinstance(n, (ast.Assign, ast.AnnAssign)):
                        targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                        found.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                                     and isinstance(t.value, ast.Name) and t.value.id == "self")
    return sorted(f for f in found if _INDEXER_FIELD.match(f))


def _callee(call: ast.Call) -> Optional[str]:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _local_callee(call: ast.Call) -> Optional[str]:
    """``name(...)`` or ``self.name(...)``: a function of this file, by name."""
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("self", "cls"):
        return f.attr
    return None


def _names(target: ast.AST) -> Iterable[str]:
    """The variables an assignment target binds or writes into (``x``, ``x, y``, ``x[...]``, ``x.attr``)."""
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for e in target.elts:
            yield from _names(e)
    elif isinstance(target, (ast.Subscript, ast.Attribute, ast.Starred)):
        yield from _names(target.value)


class _Flow:
    """Taint of one function: names whose value derives from a top-k."""

    def __init__(self, fn: ast.FunctionDef, returns_topk: set[str]):
        self.fn, self.returns_topk, self.tainted = fn, returns_topk, set()

    def selected(self, e: Optional[ast.AST]) -> bool:
        if e is None:
            return False
        for n in ast.walk(e):
            if isinstance(n, ast.Call) and (_callee(n) == "topk" or _local_callee(n) in self.returns_topk):
                return True
            if isinstance(n, ast.Name) and n.id in self.tainted:
                return True
        return False

    def run(self) -> tuple[bool, bool]:
        """(the function returns a top-k-derived value, a top-k-derived value reaches an attention call)."""
        returns = reaches = False
        for _ in range(3):  # a few passes: loops and writes before reads in source order
            before = set(self.tainted)
            for n in ast.walk(self.fn):
                if isinstance(n, ast.Assign) and self.selected(n.value):
                    for t in n.targets:
                        self.tainted.update(_names(t))
                elif isinstance(n, (ast.AugAssign, ast.AnnAssign)) and self.selected(n.value):
                    self.tainted.update(_names(n.target))
                elif isinstance(n, ast.NamedExpr) and self.selected(n.value):
                    self.tainted.add(n.target.id)
                elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                    # an in-place write (``mask.scatter_(-1, ids, 0)``, ``x.copy_(ids)``) taints its target
                    if n.func.attr.endswith("_") and any(self.selected(a) for a in n.args + [k.value for k in n.keywords]):
                        self.tainted.update(_names(n.func.value))
                elif isinstance(n, ast.Return) and self.selected(n.value):
                    returns = True
            if self.tainted == before:
                break
        for n in ast.walk(self.fn):
            if isinstance(n, ast.Call) and "attention" in (_callee(n) or "").lower():
                if any(self.selected(a) for a in n.args + [k.value for k in n.keywords]):
                    reaches = True
        return returns, reaches


def topk_into_attention(tree: ast.Module) -> list[str]:
    """Functions (``Class.method`` or ``function``) in which a top-k-derived value reaches an attention call."""
    fns: list[tuple[str, ast.FunctionDef]] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ClassDef):
            fns += [(f"{n.name}.{f.name}", f) for f in n.body if isinstance(f, ast.FunctionDef)]
    methods = {id(f) for _, f in fns}
    fns += [(f.name, f) for f in tree.body if isinstance(f, ast.FunctionDef) and id(f) not in methods]
    returns_topk: set[str] = set()
    while True:  # functions whose return value derives from a top-k, through each other
        grown = {q.rsplit(".", 1)[-1] for q, f in fns if _Flow(f, returns_topk).run()[0]}
        if grown <= returns_topk:
            break
        returns_topk |= grown
    return sorted(q for q, f in fns if _Flow(f, returns_topk).run()[1])


def _parse(path: Path, *needles: str) -> Optional[ast.Module]:
    """The module's syntax tree, or None when it cannot be read or contains none of ``needles`` (a text filter
    that skips parsing the hundreds of files no criterion can hold for)."""
    try:
        text = path.read_text(encoding="utf-8")
        return ast.parse(text, filename=str(path)) if any(n in text for n in needles) else None
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


def transformers_models_dir() -> Path:
    """``transformers/models`` of the installed release."""
    import transformers

    return Path(transformers.__file__).resolve().parent / "models"


def decoding_model_types() -> dict[str, tuple[str, ...]]:
    """Per family folder: its model types that have a causal-LM or image-text-to-text class."""
    from transformers.models.auto import configuration_auto, modeling_auto

    gen = set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    out: dict[str, list[str]] = {}
    for t in sorted(configuration_auto.CONFIG_MAPPING_NAMES):
        if t in gen:
            out.setdefault(configuration_auto.model_type_to_module_name(t), []).append(t)
    return {k: tuple(v) for k, v in out.items()}


def survey(models_dir: Optional[Path] = None,
           model_types: Optional[Callable[[], dict[str, tuple[str, ...]]]] = None) -> list[FamilyEvidence]:
    """The families with an indexer (the criterion above), sorted by folder. ``models_dir`` defaults to the
    installed release's ``transformers/models``, ``model_types`` to :func:`decoding_model_types`."""
    models_dir = transformers_models_dir() if models_dir is None else Path(models_dir)
    types = (decoding_model_types if model_types is None else model_types)()
    found = []
    for folder in sorted(p for p in models_dir.iterdir() if p.is_dir()):
        if folder.name not in types:
            continue  # no decoding model type: outside the criterion
        trees = [t for t in (_parse(p, "Indexer", "topk") for p in sorted(folder.glob(f"modeling_{folder.name}.py")))
                 if t is not None]
        confs = [t for t in (_parse(p, "index_", "indexer_") for p in sorted(folder.glob("configuration_*.py")))
                 if t is not None]
        ev = FamilyEvidence(folder.name, types.get(folder.name, ()),
                            tuple(sorted({c for t in trees for c in indexer_classes(t)})),
                            tuple(sorted({f for t in confs for f in config_fields(t)})),
                            tuple(sorted({f for t in trees for f in topk_into_attention(t)})))
        if ev.has_indexer:
            found.append(ev)
    return found

"""Every front-end implements the whole protocol; the pipeline and the rewrite core use nothing else.

The front-ends are reached through the registry only (``FRONT_ENDS``), checked member by member against
``FrontEnd``'s declaration, and the two modules that drive a front-end (``pipeline.py``,
``passes/rewrite.py``) are read with ``ast``: every ``fe.<name>`` / ``ctx.frontend.<name>`` they use is
declared (and every ``det.<name>`` / ``ctx.detection.<name>`` of a detection), and they probe no hook with
``hasattr`` / ``getattr``. A second check walks every module of ``offload_passes/``: no module
imports another module's private name (a ``_name`` that is not itself a module, such as ``_fx``).
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from torch import fx

from offload_passes.passes.frontends import FRONT_ENDS
from offload_passes.passes.frontends.protocol import (Detection, FrontEnd, PartialRefusal, PassFiles, Screening,
                                                      Summary, pass_files)

PKG = Path(__file__).resolve().parents[2] / "offload_passes"


def protocol_members(proto: type = FrontEnd) -> set[str]:
    """The names a protocol declares: its annotated attributes, its methods and properties."""
    names = set(proto.__annotations__)
    names |= {n for n, v in vars(proto).items()
              if (inspect.isfunction(v) or isinstance(v, property)) and not n.startswith("_")}
    return names


def test_the_protocol_declares_what_a_front_end_decides():
    """Six members: its name, what an offload refusal leaves, detection, preconditions, emission, clean-up.
    The rest is the core's (plan inputs, selection buffers, guards: from the geometry) or the detection's
    (its report rows, its screening)."""
    assert protocol_members() == {"name", "on_offload_refusal", "detect", "check_preconditions", "emit_site",
                                  "finish"}
    assert protocol_members(Detection) == {"sites", "refusals", "has_dsa", "summary", "screening"}


def test_the_report_names_each_front_end_pass_file():
    """``GraphReport.passes`` files, from the modules the front-end's members live in."""
    assert {fe.name: pass_files(fe) for fe in FRONT_ENDS} == {
        "recipe": PassFiles("passes/frontends/recipe.py", "passes/frontends/recipe.py", "passes/frontends/recipe.py"),
        "hf": PassFiles("passes/frontends/hf/detect.py", "passes/frontends/hf/frontend.py",
                        "passes/frontends/hf/frontend.py")}


def test_the_protocol_names_concrete_types():
    """Every member's parameters and return are annotated, and none with ``Any`` where a type of ours exists
    (graph inputs, ``example_inputs``, stay ``Any``: they are whatever Dynamo passes)."""
    for name in protocol_members() - set(FrontEnd.__annotations__):
        sig = inspect.signature(getattr(FrontEnd, name))
        assert sig.return_annotation is not inspect.Signature.empty, name
        for p in list(sig.parameters.values())[1:]:
            assert p.annotation is not inspect.Parameter.empty, (name, p.name)
            assert "Any" not in str(p.annotation) or p.name == "example_inputs", (name, p.name, p.annotation)
        assert str(sig.return_annotation) not in ("Any", "dict", "Optional[Any]"), (name, sig.return_annotation)


@pytest.mark.parametrize("fe", FRONT_ENDS, ids=lambda fe: fe.name)
def test_each_front_end_is_a_complete_front_end(fe):
    missing = sorted(m for m in protocol_members() if not hasattr(fe, m))
    assert missing == [], f"{fe.name} lacks {missing}"
    assert isinstance(fe, FrontEnd)
    for m in protocol_members():
        declared = getattr(FrontEnd, m, None)
        if inspect.isfunction(declared):  # callable with the declared arguments (the drivers pass them by position)
            assert len(inspect.signature(getattr(fe, m)).parameters) == \
                len(inspect.signature(declared).parameters) - 1, (fe.name, m)
    assert isinstance(fe.on_offload_refusal, PartialRefusal)
    for f in pass_files(fe):  # the report's pass files exist
        assert (PKG / f).is_file(), f


def test_registry_order_and_what_a_refusal_leaves():
    assert [fe.name for fe in FRONT_ENDS] == ["recipe", "hf"]
    assert {fe.name: fe.on_offload_refusal for fe in FRONT_ENDS} == {
        "recipe": PartialRefusal.NOTHING, "hf": PartialRefusal.SPARSE_WITHOUT_OFFLOAD}


def test_a_graph_without_dsa_belongs_to_no_front_end():
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.topk(x.relu(), 2, dim=-1)[1]

    gm = fx.symbolic_trace(f)
    for fe in FRONT_ENDS:
        det = fe.detect(gm)
        assert isinstance(det, Detection)
        assert not det.has_dsa and list(det.sites) == [] and det.refusals == []
        summary = det.summary()
        assert isinstance(summary, Summary)
        assert set(summary.detect) == {"gathers", "sites", "indexers", "other_topk"}
        assert (summary.detect["gathers"], summary.detect["sites"]) == (0, 0)
        assert det.screening() == Screening()


def _uses_of(path: Path, var: str, field: str = "") -> tuple[set[str], list[str]]:
    """Attributes read from the name ``var`` (or from ``<x>.<field>``) in ``path``, and ``hasattr`` /
    ``getattr`` probes of it."""
    attrs, probes = set(), []
    for node in ast.walk(ast.parse(path.read_text())):
        v = node.value if isinstance(node, ast.Attribute) else None
        if (isinstance(v, ast.Name) and v.id == var) or (field and isinstance(v, ast.Attribute) and v.attr == field):
            attrs.add(node.attr)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in (var, "det")):
            probes.append(f"{path.name}:{node.lineno}")
    return attrs, probes


@pytest.mark.parametrize("module", ["pipeline.py", "passes/rewrite.py"])
def test_drivers_use_only_declared_hooks(module):
    attrs, probes = _uses_of(PKG / module, "fe", "frontend")
    assert attrs, f"{module} reads no front-end hook: the check reads the wrong name"
    assert attrs <= protocol_members(), f"{module} uses undeclared hooks {sorted(attrs - protocol_members())}"
    assert probes == [], f"hasattr / getattr probes of a front-end or its detection: {probes}"


def test_the_pipeline_reads_only_declared_detection_members():
    attrs, _ = _uses_of(PKG / "pipeline.py", "det", "detection")
    assert attrs and attrs <= protocol_members(Detection), sorted(attrs - protocol_members(Detection))


def _resolve(path: Path, root: Path, node: ast.ImportFrom) -> Path | None:
    """The folder or module file (without ``.py``) an import names, when it is inside ``root``."""
    if node.level:
        base = path.parent
        for _ in range(node.level - 1):
            base = base.parent
    elif node.module and node.module.split(".")[0] == root.name:
        base = root.parent
    else:
        return None  # another distribution (torch, torchair ...)
    for part in node.module.split(".") if node.module else []:
        base = base / part
    return base


def private_imports(root: Path) -> list[str]:
    """``from m import _name`` in any module under ``root`` where ``_name`` is not a module of ``m``."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _resolve(path, root, node)
            if target is None:
                continue
            for alias in node.names:
                n = alias.name
                if not n.startswith("_") or n.startswith("__"):
                    continue
                if (target / f"{n}.py").is_file() or (target / n / "__init__.py").is_file():
                    continue  # a module (``from . import _fx``, ``from .. import _compat``)
                bad.append(f"{path.relative_to(root.parent)}:{node.lineno}: {n} from {node.module or '.'}")
    return bad


def test_no_module_imports_a_private_name_of_another():
    bad = private_imports(PKG)
    assert bad == [], "private names imported across modules (make them public):\n" + "\n".join(bad)


def test_the_private_import_check_catches_one(tmp_path):
    pkg = tmp_path / "offload_passes"
    (pkg / "passes").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_compat.py").write_text("")
    (pkg / "passes" / "__init__.py").write_text("")
    (pkg / "passes" / "_fx.py").write_text("")
    (pkg / "passes" / "rewrite.py").write_text("class _Builder: ...\n")
    (pkg / "passes" / "ok.py").write_text("from . import _fx\nfrom .. import _compat\nfrom torch import _C\n")
    (pkg / "passes" / "bad.py").write_text("from .rewrite import _Builder\n")
    (pkg / "passes" / "bad_abs.py").write_text("from offload_passes.passes.rewrite import _Builder\n")
    assert private_imports(pkg) == ["offload_passes/passes/bad.py:1: _Builder from rewrite",
                                    "offload_passes/passes/bad_abs.py:1: _Builder from offload_passes.passes.rewrite"]

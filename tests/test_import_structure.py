"""No import circles among the package's modules.

Read from the source with ``ast`` (nothing is imported): an edge ``a -> b`` for every import statement
of ``a``, wherever it stands. An import inside a function or under ``if TYPE_CHECKING:`` counts too:
deferring an import to call time or to the type checker hides a circle from Python, not from a reader,
who still cannot understand one module without the other. ``from p import m`` where ``p.m`` is a module
is an edge to ``p.m``; to ``p`` otherwise. An edge to one of the module's own parent packages does not
count (a package's registry read by its submodule: ``custom_ops/cuda`` reads ``custom_ops.OP_SPECS``):
importing a submodule runs its parents first anyway. Installed names follow setup.py (``custom_ops/`` is
``offload_passes.custom_ops``).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Installed package -> repository folder (setup.py's COMPONENTS).
PACKAGE_FOLDERS = {"offload_passes": "offload_passes", "offload_passes.custom_ops": "custom_ops",
                   "offload_passes.converters": "converters", "offload_passes.models": "models",
                   "offload_passes.tools": "tools"}


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package)."""
    out: dict[str, tuple[Path, bool]] = {}
    for pkg, folder in PACKAGE_FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            if any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
                continue
            is_pkg = rel.name == "__init__"
            parts = rel.parts[:-1] if is_pkg else rel.parts
            out[".".join((pkg,) + parts)] = (path, is_pkg)
    return out


def _imports(node: ast.AST):
    """Every import statement below ``node`` (module level, in functions, under ``if TYPE_CHECKING:``)."""
    for child in ast.walk(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            graph[name].update(t for t in targets if t in mods and t != name and not name.startswith(t + "."))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_reads_the_package():
    g = import_graph()
    assert len(g) > 80
    # edges the package certainly has: the backend reads the modes, an op module its registration helpers
    assert "offload_passes.modes" in g["offload_passes.backend"]
    assert "offload_passes.custom_ops._library" in g["offload_passes.custom_ops.dsa_serve"]


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_a_lazy_import_is_an_edge(tmp_path, monkeypatch):
    pkg = tmp_path / "offload_passes"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__), "PACKAGE_FOLDERS", {"offload_passes": "offload_passes"})
    g = import_graph()
    assert g["offload_passes.b"] == {"offload_passes.a"}
    assert cycles(g) == [["offload_passes.a", "offload_passes.b"]]


def test_a_type_level_import_is_an_edge(tmp_path, monkeypatch):
    """A circle closed only under ``if TYPE_CHECKING:`` (a protocol module naming a type of a module that
    imports it) is a circle: the checker finds it."""
    pkg = tmp_path / "offload_passes"
    (pkg / "passes").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "passes" / "__init__.py").write_text("")
    (pkg / "passes" / "protocol.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                "    from .core import Ctx\n")
    (pkg / "passes" / "core.py").write_text("from .protocol import FrontEnd\n")
    (pkg / "passes" / "leaf.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from . import core\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__), "PACKAGE_FOLDERS", {"offload_passes": "offload_passes"})
    g = import_graph()
    assert g["offload_passes.passes.protocol"] == {"offload_passes.passes.core"}
    assert g["offload_passes.passes.leaf"] == {"offload_passes.passes.core"}
    assert cycles(g) == [["offload_passes.passes.core", "offload_passes.passes.protocol"]]


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, "import circles (move the shared piece into a module both import):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


#: What the passes and the backend are built from, each kind in one package (docs/ARCHITECTURE.md).
SEAM_PACKAGES = {"offload_passes.passes.frontends": "front-ends (one module per graph form, FRONT_ENDS)",
                 "offload_passes.lowering": "lowerings (one module per platform, modes.MODES)"}


def test_front_ends_and_lowerings_are_packages():
    mods = modules()
    for pkg, what in SEAM_PACKAGES.items():
        assert pkg in mods and mods[pkg][1], f"{pkg}: the {what} are a package"
    # every lowering modes.MODES names, and every front-end the registry imports, lives in its package
    modes = ast.parse((ROOT / "offload_passes" / "modes.py").read_text())
    lowerings = {n.value.split(":")[0] for n in ast.walk(modes)
                 if isinstance(n, ast.Constant) and isinstance(n.value, str) and ":" in n.value
                 and n.value.startswith("offload_passes.")}
    assert lowerings and all(m.startswith("offload_passes.lowering.") and m in mods for m in lowerings), lowerings
    g = import_graph()
    front_ends = {m for m in g["offload_passes.passes.frontends"] if m.startswith("offload_passes.passes.frontends.")}
    assert {"offload_passes.passes.frontends.recipe", "offload_passes.passes.frontends.hf"} <= front_ends


def test_the_seam_between_front_ends_and_the_core():
    """The front-end registry imports only the front-ends and their protocol; the protocol and the emission
    helpers import no front-end; the shared passes import nothing from ``passes/frontends/``."""
    g = import_graph()
    fe = "offload_passes.passes.frontends"
    assert g[fe] == {f"{fe}.recipe", f"{fe}.hf", f"{fe}.protocol"}, g[fe]
    for mod in (f"{fe}.protocol", "offload_passes.passes.emit", "offload_passes.passes.preconditions",
                "offload_passes.passes.group", "offload_passes.passes.refusal"):
        assert not {m for m in g[mod] if m == fe or m.startswith(fe + ".")}, (mod, g[mod])


def test_the_top_level_holds_entry_points_and_the_core():
    """No front-end or lowering module outside its package: the top level of ``offload_passes/`` and of
    ``passes/`` keep the entry points, the core and the shared passes."""
    stray = []
    for name, (path, is_pkg) in modules().items():
        parts = name.split(".")
        if parts[0] != "offload_passes" or len(parts) > 3 or is_pkg:
            continue
        if len(parts) == 2 or parts[1] == "passes":
            leaf = parts[-1]
            if leaf.startswith(("lowering", "frontend", "detect", "rewrite_")) or leaf == "npu_modes":
                stray.append(name)
    assert stray == [], f"front-end / lowering modules outside offload_passes.passes.frontends / .lowering: {stray}"


#: The applications (``offload-demo`` and its forms); the core package is the backend and never imports them.
APPS = "offload_passes.apps"
#: Packages that may import the applications: the applications themselves, the trace tools and the console tools.
MAY_IMPORT_APPS = (APPS, "offload_passes.trace", "offload_passes.tools")


def core_imports_of_apps() -> list[str]:
    """``module -> target`` for every import of ``offload_passes.apps`` by a module outside
    ``MAY_IMPORT_APPS``, and every string naming it there (``importlib.import_module`` / a lazy table)."""
    def outside(m: str) -> bool:
        return not any(m == p or m.startswith(p + ".") for p in MAY_IMPORT_APPS)

    found = []
    for name, targets in import_graph().items():
        if outside(name):
            found += [f"{name} -> {t}" for t in sorted(targets) if not outside(t) and t.startswith(APPS)]
    for name, (path, _) in modules().items():
        if outside(name):
            found += [f"{name} -> {n.value!r}" for n in ast.walk(ast.parse(path.read_text()))
                      if isinstance(n, ast.Constant) and isinstance(n.value, str)
                      and (n.value == APPS or n.value.startswith(APPS + "."))]
    return found


def test_the_core_never_imports_the_apps():
    """The demos use the package as a user does; nothing of the core (``offload_passes/`` but ``apps/`` and
    ``trace/``), the models, the ops or the converters imports them, at module level, in a function or by name."""
    mods = modules()
    assert APPS in mods and mods[APPS][1] and f"{APPS}.demo" in mods  # the demos are a package
    assert f"{APPS}.common" in import_graph()[f"{APPS}.demo"]
    assert core_imports_of_apps() == []


def test_a_core_import_of_the_apps_is_found(tmp_path, monkeypatch):
    pkg = tmp_path / "offload_passes"
    (pkg / "apps").mkdir(parents=True)
    (pkg / "__init__.py").write_text("_LAZY = {'run': 'offload_passes.apps.demo'}\n")
    (pkg / "apps" / "__init__.py").write_text("")
    (pkg / "apps" / "demo.py").write_text("from .. import backend\n")
    (pkg / "backend.py").write_text("def f():\n    from .apps import demo\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__), "PACKAGE_FOLDERS", {"offload_passes": "offload_passes"})
    assert core_imports_of_apps() == ["offload_passes.backend -> offload_passes.apps.demo",
                                      "offload_passes -> 'offload_passes.apps.demo'"]


#: Not the core: the trace research and the applications (``offload-demo``), which may import it.
NOT_CORE = ("offload_passes.trace", "offload_passes.apps", "offload_passes.demo")


def test_the_core_does_not_import_the_trace_research():
    """The trace research (``offload_passes/trace/``) plugs into the core through the state's recording hook
    (``offload_passes/state/recording.py``): no module of the core (``offload_passes/`` outside the trace
    package and the applications) imports it, even lazily."""
    g = import_graph()
    core = [m for m, (path, _) in modules().items()
            if (ROOT / "offload_passes") in path.parents and not m.startswith(NOT_CORE)]
    assert "offload_passes.state.api" in core and "offload_passes.backend" in core, core
    bad = {m: sorted(t for t in g[m] if t == NOT_CORE[0] or t.startswith(NOT_CORE[0] + "."))
           for m in core}
    assert not {m: t for m, t in bad.items() if t}, bad

"""The repository documents itself: README.md is an entry point into docs/, every reference points inside
the repository, citations name sections that exist, and the op reference says what the code does.

(The snippets of README.md and docs/ are run by ``tests/test_readme.py``.)
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from offload_passes.custom_ops import OP_SPECS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".cfg", ".txt", ".cpp", ".h", ".json", ""}

# References to material that is not in the repository (written so that this file does not match itself).
OUTSIDE = [
    (re.compile(r"\.\./" + "shared"), "a path outside the repository"),
    (re.compile("/work/" + "shared"), "a path outside the repository"),
    (re.compile(r"\bDESIGN" + r"\.md"), "a design brief that is not in the repository (cite docs/design.md)"),
    (re.compile(r"\bspec/[\w-]+" + r"\.md"), "a spec file that is not in the repository (cite docs/ops.md / docs/platform.md)"),
    (re.compile(r"\bspec " + "\u00a7" + r"\d"), "an unnamed spec section (cite docs/ops.md \u00a7N)"),
]


def _repo_files() -> list[Path]:
    """Tracked files plus untracked ones git does not ignore (a new file is checked before its commit)."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        names = [n for n in out.splitlines() if n]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an sdist): walk the tree
        skip = {".git", "build", "__pycache__", ".pytest_cache", ".hypothesis"}
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                 if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)]
    return [ROOT / n for n in names if (ROOT / n).is_file() and (ROOT / n).suffix in TEXT_SUFFIXES]


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError:
        return ""


def test_nothing_refers_outside_the_repository():
    bad = []
    for path in _repo_files():
        for n, line in enumerate(_text(path).splitlines(), 1):
            for pattern, why in OUTSIDE:
                if pattern.search(line):
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {why}: {line.strip()[:120]}")
    assert not bad, "references outside the repository:\n" + "\n".join(bad)


def test_readme_is_an_entry_point():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move details into docs/"
    # the two commands, exactly as .ci/run and users rely on them
    assert "bash scripts/setup.sh && offload-demo --config tiny --steps 64" in text
    (test_cmd,) = [ln.split("#")[0].strip() for ln in lines if ln.startswith("python -m pytest")]
    assert test_cmd.endswith(" tests"), test_cmd
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd in ci, f".ci/run does not run the README's test command {test_cmd!r}"
    # every page of docs/ is reachable from the README
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if f"docs/{p.name}" not in text]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


# Sections that moved out of the README: (former README heading, the docs page that holds it now).
MOVED = [
    ("Using it", "usage.md"),
    ("Inspecting what happened", "usage.md"),
    ("Never silently wrong", "design.md"),
    ("Decisions and why", "design.md"),
    ("Where reality differed", "design.md"),
    ("The production graph: GLM-5.2-W8A8C16", "models.md"),
    ("Supported torch versions", "verification.md"),
    ("What is verified where", "verification.md"),
    ("Hugging Face models", "hf.md"),
    ("CANN's custom-op package and its torch extension", "atlas.md"),
    ("The NPU schedule", "atlas.md"),
    ("What only an Atlas A3 can confirm", "atlas.md"),
    ("Layout", "build.md"),
    ("The wheel needs no compiler", "build.md"),
    ("Kernels (`python benchmarks/bench_ops.py --repeat 30`)", "performance.md"),
    ("Soak (`python benchmarks/soak.py --steps 10000`)", "performance.md"),
    ("Pass time vs compile time", "performance.md"),
]


@pytest.mark.parametrize("heading,page", MOVED, ids=[h for h, _ in MOVED])
def test_moved_section_lives_in_docs(heading, page):
    text = (DOCS / page).read_text()
    headings = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    assert any(heading in h for h in headings), f"docs/{page} has no section {heading!r}: {headings}"


def test_trace_science_page_exists():
    # written by the trace work; the README's former "Trace science" section points there
    assert (DOCS / "trace-science.md").is_file()


_LINK = re.compile(r"\]\(([^)\s]+)\)")
_MENTION = re.compile(r"(?<![\w/.-])((?:docs|converters|models)/[\w./-]+\.(?:md|png|svg))")


def _doc_pages() -> list[Path]:
    return [README, ROOT / "converters" / "README.md", ROOT / "models" / "README.md"] + sorted(DOCS.glob("*.md"))


@pytest.mark.parametrize("page", _doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    text = page.read_text()
    missing = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor
        if not (page.parent / target.split("#")[0]).exists():
            missing.append(target)
    for target in _MENTION.findall(text):
        if not (ROOT / target).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} points at files that do not exist: {sorted(set(missing))}"


_CITE = re.compile(r"docs/([\w-]+\.md) \u00a7(\d+(?:\.\d+)?)")


def _sections(page: Path) -> set[str]:
    """Section numbers of a page: headings ``## 3.`` / ``### 3.1`` and bold items ``**8.4 ...``."""
    out = set()
    for m in re.finditer(r"^#+ (\d+(?:\.\d+)?)[. ]|^\* \*\*(\d+\.\d+) ", page.read_text(), flags=re.M):
        out.add(m.group(1) or m.group(2))
    return out


def test_citations_name_existing_sections():
    bad = []
    cache: dict[str, set[str]] = {}
    for path in _repo_files():
        for n, line in enumerate(_text(path).splitlines(), 1):
            for page, sec in _CITE.findall(line):
                target = DOCS / page
                if not target.is_file():
                    bad.append(f"{path.relative_to(ROOT)}:{n}: docs/{page} does not exist")
                    continue
                secs = cache.setdefault(page, _sections(target))
                if sec not in secs:
                    bad.append(f"{path.relative_to(ROOT)}:{n}: docs/{page} has no \u00a7{sec}")
    assert not bad, "citations of missing sections:\n" + "\n".join(bad)


def test_architecture_opens_with_the_map_pointing_at_every_op():
    text = (DOCS / "ARCHITECTURE.md").read_text()
    first = next(line for line in text.splitlines() if line.startswith("## "))
    assert first.startswith("## The map"), first
    the_map = text.split("\n## 1.", 1)[0]
    for spec in OP_SPECS:
        assert spec.qualname in the_map, f"the map does not point at {spec.qualname}"
    assert "docs/ops.md" in the_map


def test_op_reference_states_what_the_code_does():
    text = (DOCS / "ops.md").read_text()
    for spec in OP_SPECS:
        assert spec.schema in text, f"docs/ops.md lacks {spec.qualname}'s exact schema:\n{spec.schema}"
        if spec.functional:
            assert spec.functional in text, spec.functional
        for lim in spec.limits:
            row = re.search(rf"^\| `{lim.name}` \| (\d+) \|", text, flags=re.M)
            assert row, f"docs/ops.md's limits table lacks {lim.name} ({spec.qualname})"
            assert int(row.group(1)) == lim.value, f"{lim.name}: docs say {row.group(1)}, code {lim.value}"


def test_glossary_has_one_name_per_concept():
    text = (DOCS / "glossary.md").read_text()
    body, _, to_rename = text.partition("## To rename")
    assert to_rename.strip(), "the glossary lost its 'To rename' table"
    names = re.findall(r"^\| \*\*(.+?)\*\*", body, flags=re.M)
    assert len(names) >= 30
    dup = sorted({n for n in names if names.count(n) > 1})
    assert not dup, f"glossary names defined twice: {dup}"


def _console_scripts() -> set[str]:
    return set(re.findall(r'"(offload-[\w-]+) = ', (ROOT / "setup.py").read_text()))


def _shell_commands(page: Path) -> list[str]:
    """Each command of the page's ```bash blocks (comments dropped, `&&` chains split, `$ ` prompts off)."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", page.read_text(), flags=re.S | re.M):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip().removeprefix("$ ")
            if line.startswith("#"):
                continue
            out += [c.strip() for c in line.split("&&") if c.strip()]
    return out


@pytest.mark.parametrize("page", [README] + sorted(DOCS.glob("*.md")), ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_snippets_name_things_that_exist(page):
    import importlib.util

    scripts, bad = _console_scripts(), []
    for cmd in _shell_commands(page):
        words = [w for w in cmd.split() if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)]  # drop VAR=value prefixes
        if not words:
            continue
        if words[0].startswith("offload-") and words[0] not in scripts:
            bad.append(f"{cmd!r}: no console script {words[0]}")
        elif words[0] in ("python", "bash") and len(words) > 1:
            if words[1] == "-m" and len(words) > 2 and words[2].startswith("offload_passes"):
                if importlib.util.find_spec(words[2]) is None:
                    bad.append(f"{cmd!r}: no module {words[2]}")
            elif re.match(r"^(benchmarks|scripts|tests|tools)/[\w/.-]+\.(py|sh)$", words[1]):
                if not (ROOT / words[1]).is_file():
                    bad.append(f"{cmd!r}: no file {words[1]}")
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)


# ---------------------------------------------------------------------------------------------------
# Cited code symbols exist, and no change-tracker numbers are cited
# ---------------------------------------------------------------------------------------------------
import ast  # noqa: E402
from functools import lru_cache  # noqa: E402

#: Installed package -> repository folder (setup.py's COMPONENTS).
PACKAGE_FOLDERS = {"offload_passes": "offload_passes", "offload_passes.custom_ops": "custom_ops",
                   "offload_passes.converters": "converters", "offload_passes.models": "models",
                   "offload_passes.tools": "tools"}
#: Folders a cited path may be relative to: the repository root, or the package (``passes/_fx.py``).
PATH_BASES = ("", "offload_passes/")
#: Files the code writes at run time (dumps, reports, figures' data), cited by name: not sources.
GENERATED = re.compile(r"^(\d\d_\w+\.py|report\.json|atlas_check_report\.json|trace_\w+\.json)$")
_SYMBOL = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(\))?$")
_PATH = re.compile(r"^[\w./-]+\.(?:py|sh|cpp|h|md|yaml|toml|json)(?:::[\w.]+)?$")
_TICKED = re.compile(r"`([^`\n]+)`")


def _source_files() -> list[Path]:
    return [p for p in _repo_files() if p.suffix == ".py"]


@lru_cache(maxsize=None)
def _top_names(path: Path) -> dict:
    """Top-level names of a Python file -> the ClassDef node (classes) or None (everything else)."""
    tree = ast.parse(path.read_text())
    names: dict = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
        elif isinstance(node, ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names[n.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                names[(a.asname or a.name).split(".")[0]] = None
    return names


def _class_attrs(cls: ast.ClassDef) -> set[str]:
    """Methods, class attributes, dataclass fields and ``self.x`` assignments of a class body."""
    out = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
    return out


@lru_cache(maxsize=None)
def _modules() -> dict:
    """Dotted module name -> file, for every module of the installed package (``offload_passes.x.y``)."""
    out = {}
    for pkg, folder in PACKAGE_FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            name = ".".join((pkg,) + parts)
            if name not in out or rel.name == "__init__":
                out.setdefault(name, path)
    return out


@lru_cache(maxsize=None)
def _short_names() -> dict:
    """A module's trailing names (``npu_modes``, ``passes.rewrite``, ``custom_ops._library``) -> modules."""
    out: dict = {}
    for name in _modules():
        parts = name.split(".")
        for i in range(1, len(parts)):
            out.setdefault(".".join(parts[i:]), set()).add(name)
    return out


def _resolve_in(module: str, attrs: list[str]) -> bool:
    """``attrs`` is a name of ``module``: top level, a class's attribute, or (for ``backend.state`` where
    a doc means an instance) an attribute of one of the module's classes."""
    path = _modules()[module]
    names = _top_names(path)
    if not attrs:
        return True
    if attrs[0] in names:
        cls = names[attrs[0]]
        if cls is not None and len(attrs) > 1:
            return attrs[1] in _class_attrs(cls)
        return True
    sub = f"{module}.{attrs[0]}"
    if sub in _modules():
        return _resolve_in(sub, attrs[1:])
    return any(isinstance(c, ast.ClassDef) and attrs[0] in _class_attrs(c) for c in names.values())


@lru_cache(maxsize=None)
def _classes() -> dict:
    out: dict = {}
    for module, path in _modules().items():
        for name, node in _top_names(path).items():
            if isinstance(node, ast.ClassDef):
                out.setdefault(name, []).append(node)
    return out


def _symbol_problem(token: str) -> str | None:
    """Why ``token`` (``lowering.npu.NpuLowering``, ``offload_passes.cuda.plan_placement``, ``OpSpec.schema``)
    names nothing of ours; None if it exists or is not ours (``torch.compile``)."""
    parts = token.removesuffix("()").split(".")
    if any(p.startswith("__") for p in parts):  # module attributes Python sets (offload_passes.__file__)
        return None
    for n in range(len(parts), 0, -1):  # the longest module prefix wins (custom_ops._library.check)
        head = ".".join(parts[:n])
        mods = {head} if head in _modules() else _short_names().get(head, set())
        if mods:
            if any(_resolve_in(m, parts[n:]) for m in mods):
                return None
            return f"no {'.'.join(parts[n:])!r} in {sorted(mods)}"
    if parts[0] in _classes():
        if any(parts[1] in _class_attrs(c) for c in _classes()[parts[0]]):
            return None
        return f"class {parts[0]} has no attribute {parts[1]!r}"
    return None


def _path_problem(token: str) -> str | None:
    """Why the cited file (``passes/_fx.py``, ``custom_ops/opspec.py::OpSpec``) does not exist; None if
    it does, or if it is not one of ours (a file of TorchAir: ``_ge_concrete_graph/graph_pass.py``)."""
    path, _, name = token.partition("::")
    first = path.split("/")[0]
    if "/" in path:
        ours = {p.split("/")[0] for p in ("offload_passes", "custom_ops", "converters", "models", "tools",
                                           "benchmarks", "scripts", "tests", "docs")}
        ours |= {p.name for p in (ROOT / "offload_passes").iterdir() if p.is_dir()}
        if first not in ours:
            return None
        hits = [ROOT / b / path for b in PATH_BASES if (ROOT / b / path).is_file()]
    else:
        if GENERATED.match(path):
            return None
        hits = [p for p in _repo_files() if p.name == path]
    if not hits:
        return "no such file in the repository"
    if name:
        head, _, attr = name.partition(".")
        for hit in hits:
            names = _top_names(hit) if hit.suffix == ".py" else {}
            if head in names and (not attr or (names[head] is not None and attr in _class_attrs(names[head]))):
                return None
        return f"{path} defines no {name!r}"
    return None


def _cited(text: str) -> list[str]:
    return [t.strip() for t in _TICKED.findall(text)]


@pytest.mark.parametrize("page", _doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_code_exists(page):
    bad = []
    for token in _cited(page.read_text()):
        if _PATH.match(token):
            why = _path_problem(token)
        elif _SYMBOL.match(token):
            why = _symbol_problem(token)
        else:
            continue
        if why:
            bad.append(f"`{token}`: {why}")
    assert not bad, f"{page.relative_to(ROOT)} cites code that does not exist:\n" + "\n".join(sorted(set(bad)))


def test_the_symbol_check_catches_what_it_must():
    # names that do not exist (what a rename leaves behind in prose), and names that do
    assert _symbol_problem("backend.LOWERINGS")
    assert _symbol_problem("state.build_state")
    assert _symbol_problem("offload_passes.custom_ops._library.no_such_function()")
    assert _symbol_problem("OpSpec.no_such_field")
    assert _path_problem("passes/no_such_pass.py")
    assert _path_problem("custom_ops/opspec.py::NoSuchClass")
    for ok in ("modes.MODES", "passes.state_build.build_state", "custom_ops._library.check", "OpSpec.schema",
               "offload_passes.custom_ops._library.cpu_kernels_origin()", "npu_modes.NpuLowering", "torch.compile"):
        assert _symbol_problem(ok) is None, ok
    for ok in ("passes/state_build.py", "custom_ops/opspec.py::OpSpec", "custom_ops/opspec.py::OpSpec.schema",
               "setup.py", "_ge_concrete_graph/graph_pass.py::_get_output_to_input_ref_idx"):
        assert _path_problem(ok) is None, ok


#: A change-tracker number (the word, then a number): readers of the repository cannot look it up.
#: Written so that this file does not match itself.
_TRACKER = re.compile(r"\bissues?" + r"\s+#?\d+", re.I)


def test_no_tracker_numbers_are_cited():
    bad = []
    for path in _repo_files():
        for n, line in enumerate(_text(path).splitlines(), 1):
            if _TRACKER.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not bad, ("cite the file or docs section that says why, not a tracker number:\n" + "\n".join(bad))


#: A per-version result: a table row ``| 2.13.0 | ... passed`` or a summary line ``torch 2.13.0... N passed``.
_VERSION_RESULT = re.compile(r"^\|\s*2\.\d+\.\d+\s*\|.*\bpassed\b|\btorch 2\.\d+\.\d+\S*.*\b\d+ passed\b", re.M)


def test_results_live_on_one_dated_page():
    results = DOCS / "versions.md"
    text = results.read_text()
    tested = re.search(r'TORCH_VERSIONS=\$\{TORCH_VERSIONS:-"([^"]+)"\}', (ROOT / "scripts" / "test_matrix.sh").read_text())
    assert tested, "scripts/test_matrix.sh: no default TORCH_VERSIONS"
    for v in tested.group(1).split():
        assert re.search(rf"^\| {re.escape(v)} \|.*\bpassed\b", text, re.M), f"docs/versions.md: no result for {v}"
    assert re.search(r"Measured on \*\*\d{4}-\d{2}-\d{2}\*\*", text), "docs/versions.md: the results carry no date"
    copies = [f"{p.relative_to(ROOT)}: {m.group(0)[:80]}" for p in _doc_pages() if p != results
              for m in _VERSION_RESULT.finditer(p.read_text())]
    assert not copies, "per-version results copied outside docs/versions.md (link it instead):\n" + "\n".join(copies)
    for page in (README, DOCS / "verification.md"):
        assert "versions.md" in page.read_text(), f"{page.relative_to(ROOT)} does not link docs/versions.md"

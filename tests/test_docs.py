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
    assert "python -m pytest -q tests " in text or "python -m pytest -q tests\n" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q tests" in ci
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

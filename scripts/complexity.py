"""Complexity per function and lines per file, for the core package's size limits (docs/ARCHITECTURE.md).

A function's complexity is McCabe's: 1 + its decision points. A decision point is a branch a reader must
hold in mind: ``if`` / ``elif`` / a conditional expression,
``for`` / ``while`` (and comprehension loops and their ``if`` filters), ``except``, ``case``, and each
extra operand of ``and`` / ``or``. Nested functions are counted on their own.

    python scripts/complexity.py [PATH ...] [--over N] [--files-over N]
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Iterator

_BRANCHES = (ast.If, ast.IfExp, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler, ast.match_case)


def complexity(fn: ast.AST) -> int:
    """1 + the branches of ``fn``'s own body (nested functions and classes excluded)."""
    count = 1
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, _BRANCHES):
            count += 1
        elif isinstance(node, ast.BoolOp):
            count += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            count += 1 + len(node.ifs)
        stack.extend(ast.iter_child_nodes(node))
    return count


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def python_files(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=["offload_passes"])
    ap.add_argument("--over", type=int, default=25, help="list functions of a complexity above this")
    ap.add_argument("--files-over", type=int, default=500, help="list files with more lines than this")
    ap.add_argument("--exclude", action="append", default=[], help="path prefix to leave out (repeatable)")
    ap.add_argument("--function", action="append", default=[], help="print this function's count (FILE:NAME)")
    args = ap.parse_args(argv)
    worst = []
    long_files = []
    for path in python_files(args.paths):
        if any(str(path).startswith(e) for e in args.exclude):
            continue
        text = path.read_text()
        lines = text.count("\n")
        if lines > args.files_over:
            long_files.append((lines, str(path)))
        for name, fn in functions(ast.parse(text)):
            n = complexity(fn)
            if n > args.over or f"{path}:{name}" in args.function:
                worst.append((n, f"{path}:{name}"))
    for n, where in sorted(worst, reverse=True):
        print(f"{n:4d}  {where}")
    for n, where in sorted(long_files, reverse=True):
        print(f"{n:4d} lines  {where}")
    print(f"functions of complexity over {args.over}: {sum(n > args.over for n, _ in worst)}; files over {args.files_over} lines: "
          f"{len(long_files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

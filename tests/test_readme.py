"""Every Python snippet in README.md runs as written (each in a fresh interpreter, from an empty folder).

A snippet that needs Ascend hardware starts with the line ``# Ascend only`` and is only parsed here.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
ASCEND_ONLY = "# Ascend only"


def _snippets() -> list[tuple[int, str]]:
    text = README.read_text()
    out = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        line = text.count("\n", 0, m.start()) + 1
        out.append((line, m.group(1)))
    return out


SNIPPETS = _snippets()


def test_readme_has_python_snippets():
    assert len(SNIPPETS) >= 3, "README.md lost its usage snippets"


@pytest.mark.parametrize("line,code", SNIPPETS, ids=[f"README.md:{ln}" for ln, _ in SNIPPETS])
def test_snippet_runs_as_written(line, code, tmp_path):
    ast.parse(code, filename=f"README.md:{line}")
    if code.lstrip().startswith(ASCEND_ONLY):
        return  # needs an NPU: parsed above, run by offload-atlas-check on Ascend
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"README.md:{line} failed:\n{code}\n--- stderr ---\n{r.stderr[-4000:]}"

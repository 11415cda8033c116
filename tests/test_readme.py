"""Every Python snippet in README.md and docs/*.md runs as written (each in a fresh interpreter, from an
empty folder).

A snippet that needs Ascend hardware starts with the line ``# Ascend only``, one that needs a CUDA GPU with
``# GPU only``; those are only parsed here. A snippet that appears verbatim in several files runs once.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DEVICE_ONLY = ("# Ascend only", "# GPU only")


def snippets_of(path: Path) -> list[tuple[int, str]]:
    """(line, code) of every fenced ```python block of ``path``."""
    text = path.read_text()
    out = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        out.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


def _all_snippets() -> list[tuple[str, str]]:
    seen: set[str] = set()
    out = []
    for path in [README] + sorted(DOCS.glob("*.md")):
        for line, code in snippets_of(path):
            if code in seen:  # the same snippet in README and docs: running it twice proves nothing more
                continue
            seen.add(code)
            out.append((f"{path.relative_to(ROOT)}:{line}", code))
    return out


SNIPPETS = _all_snippets()


def test_readme_has_python_snippets():
    # the README's ways in: backend, entry point, decorator, recipe yaml, Hugging Face model
    assert len(snippets_of(README)) >= 5, "README.md lost its usage snippets"


def test_docs_snippets_are_collected():
    where = {w.split(":")[0] for w, _ in SNIPPETS}
    assert "docs/atlas.md" in where and "docs/usage.md" in where, sorted(where)


@pytest.mark.parametrize("where,code", SNIPPETS, ids=[w for w, _ in SNIPPETS])
def test_snippet_runs_as_written(where, code, tmp_path):
    ast.parse(code, filename=where)
    if code.lstrip().startswith(DEVICE_ONLY):
        return  # needs an NPU / a GPU: parsed above, run by offload-atlas-check / the GPU check there
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"{where} failed:\n{code}\n--- stderr ---\n{r.stderr[-4000:]}"


#: What README.md says of ``torch.compile(model).generate()`` (one sentence, whitespace folded).
COMPILE_GENERATE_CLAIM = (
    "`torch.compile(model).generate()` compiles nothing (torch hands `generate` to the original module) and "
    "warns of nothing while it runs; reading `backend.state` afterwards issues an `OffloadWarning` that the "
    "backend compiled no graph, and why.")


def test_readme_claim_on_compiled_model_generate_is_what_happens():
    """The README's sentence, then the behaviour it describes: no graph and no warning during ``generate()``,
    one ``OffloadWarning`` (naming the cause) when ``backend.state`` is read."""
    import warnings

    import torch

    from offload_passes import make_offload_backend
    from offload_passes.models import hf
    from offload_passes.pipeline import OffloadWarning

    assert COMPILE_GENERATE_CLAIM in " ".join(README.read_text().split())
    torch._dynamo.reset()
    model = hf.build("hf-tiny", num_hidden_layers=2, index_topk_pattern="FS").model
    model.generation_config.eos_token_id = None
    backend = make_offload_backend(pool_size=1024)
    ids = torch.randint(2, 256, (1, 70), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as during:
        warnings.simplefilter("always")
        out = torch.compile(model, backend=backend).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
            cache_implementation="static", pad_token_id=0)
    assert tuple(out.shape) == (1, 72) and len(backend.reports) == 0  # nothing compiled, the model still generated
    assert [w for w in during if issubclass(w.category, OffloadWarning)] == []
    with warnings.catch_warnings(record=True) as reading:
        warnings.simplefilter("always")
        assert backend.state is None
    msgs = [str(w.message) for w in reading if issubclass(w.category, OffloadWarning)]
    assert len(msgs) == 1 and "has compiled no graph yet" in msgs[0], msgs
    assert "torch.compile(model).generate() compiles nothing" in msgs[0], msgs

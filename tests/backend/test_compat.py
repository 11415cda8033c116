"""offload_passes/_compat.py is the only project module that uses private torch / TorchAir symbols.

The scan reads the code (``ast``), so docstrings, comments and messages may still name them.
"""
from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest
import torch

from offload_passes import _compat

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("offload_passes", "custom_ops", "converters", "models", "tools")
COMPAT = ROOT / "offload_passes" / "_compat.py"
PRIVATE_ROOTS = ("torch", "torchair", "npugraph_ex", "torch_npu")


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] in PRIVATE_ROOTS and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _dotted(node: ast.AST) -> str:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
        return ".".join(reversed(names))
    return ""


def private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _private(node.module) or (node.module.split(".")[0] in PRIVATE_ROOTS
                                         and any(a.name.startswith("_") for a in node.names)):
                found.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
            d = _dotted(node)
            if _private(d) and "." not in d[len(d.split(".")[0]) + 1:]:  # report the outermost torch._x once
                found.append(d)
    return [f"{path.relative_to(ROOT)}:{u}" for u in found]


def test_private_symbols_only_in_compat():
    files = [p for f in FOLDERS for p in (ROOT / f).rglob("*.py") if p != COMPAT and "csrc" not in p.parts]
    assert len(files) > 30
    uses = [u for p in files for u in private_uses(p)]
    assert uses == [], "private torch / TorchAir symbols outside offload_passes/_compat.py:\n" + "\n".join(uses)


def test_the_scan_finds_private_uses(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import torch\nfrom torch._ops import OpOverload\nimport torchair._ge_concrete_graph\n"
                 "from torchair import _private_thing\nx = torch._C._has_storage\n"
                 "y = torch.compiler.reset\n'''torch._dynamo in a docstring'''\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert sorted(private_uses(p)) == ["m.py:from torch._ops import OpOverload",
                                           "m.py:from torchair import _private_thing",
                                           "m.py:import torchair._ge_concrete_graph", "m.py:torch._C"]
    finally:
        ROOT = old


def test_compat_symbols_work_on_this_torch():
    assert _compat.TORCH_VERSION == tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert _compat.dispatcher_has_schema("custom::dsa_serve")
    assert not _compat.dispatcher_has_schema("custom::no_such_op")
    assert _compat.dispatcher_schema("custom::dsa_serve").startswith("custom::dsa_serve(Tensor plan")
    assert _compat.dispatcher_schema("custom::no_such_op") is None
    assert _compat.dispatcher_has_kernel("custom::dsa_serve", "Functionalize")
    assert not _compat.dispatcher_has_kernel("custom::dsa_serve_functional", "Functionalize")
    assert isinstance(torch.ops.custom.dsa_serve.default, _compat.OpOverload)
    assert isinstance(torch.ops.custom.dsa_serve, _compat.OpOverloadPacket)
    assert _compat.has_storage(torch.zeros(1)) and not _compat.has_storage(torch.zeros(2).to_sparse())
    assert _compat.detect_fake_mode([torch.zeros(1)]) is None
    for f in (_compat.aot_module_simplified, _compat.make_boxed_func, _compat.inductor_compile_fx):
        assert callable(f())
    assert isinstance(_compat.custom_graph_pass_base(), type)
    assert _compat.torch_logs_registry() is not None


def test_a_static_address_is_not_guarded_by_identity():
    """A new tensor of the same shapes in a static-address input reuses the graph (torch 2.8's own default
    would recompile: it guards such a tensor by its identity)."""
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda cache, x: cache.add_(x), backend=count)
    first, second = torch.zeros(3), torch.zeros(3)
    for t in (first, second):
        _compat.mark_static_address(t)
        fn(t, torch.ones(3))
    torch._dynamo.reset()
    assert len(graphs) == 1
    assert torch.equal(first, torch.ones(3)) and torch.equal(second, torch.ones(3))


class _Shared(collections.UserDict):
    pass


def test_dynamo_traces_user_dict_says_what_dynamo_does():
    """``dynamo_traces_user_dict`` (transformers' ``KVSharingDict``) agrees with a full-graph compile of a
    ``UserDict`` subclass built in the step: False on torch 2.8 (its Dynamo skips ``UserDict.__init__``),
    True on 2.13."""
    def step(x):
        shared = _Shared()
        shared["k"] = x
        return shared["k"] + 1

    torch._dynamo.reset()
    fn = torch.compile(step, backend="eager", fullgraph=True)
    if _compat.dynamo_traces_user_dict():
        assert torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))
    else:
        with pytest.raises(Exception, match=r"Attempted to inline function marked as skipped(.|\n)*UserDict.__init__"):
            fn(torch.ones(2))
    torch._dynamo.reset()
    if _compat.TORCH_VERSION < (2, 9):
        assert not _compat.dynamo_traces_user_dict()
    if _compat.TORCH_VERSION >= (2, 13):
        assert _compat.dynamo_traces_user_dict()


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def test_supported_range_is_exactly_the_tested_versions():
    """setup.py's torch range, the matrix's default versions, the torch-npu table and docs/versions.md
    name the same torch releases: the range covers what is tested and no more."""
    import re

    from offload_passes.tools.torchair_env import TORCH_NPU_FOR_TORCH

    from offload_passes import _extensions

    # setup.py requires _extensions.torch_requirement(..., binary_wheel=False) for a source install: this range
    assert "torch_requirement" in (ROOT / "setup.py").read_text()
    (low, high), = re.findall(r'^>=([0-9.]+),<([0-9.]+)$', _extensions.TORCH_RANGE)
    matrix = re.search(r'TORCH_VERSIONS=\$\{TORCH_VERSIONS:-"([^"]+)"\}',
                       (ROOT / "scripts" / "test_matrix.sh").read_text()).group(1).split()
    tested = sorted(_minor(v) for v in matrix)
    assert sorted(_minor(v) for v in TORCH_NPU_FOR_TORCH) == tested
    assert _minor(low) == tested[0]
    assert _minor(high) == (tested[-1][0], tested[-1][1] + 1)  # "<2.16" once 2.15 is in the matrix
    versions_md = (ROOT / "docs" / "versions.md").read_text()
    for v in matrix:
        npu = TORCH_NPU_FOR_TORCH['.'.join(v.split('.')[:2])]  # None: no torch-npu release exists
        row = f"| {v} | {npu if npu is not None else 'none'} "
        assert row in versions_md, f"docs/versions.md has no row {row!r} for torch {v}"

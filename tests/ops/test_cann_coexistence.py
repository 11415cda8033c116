"""offload_passes beside CANN's custom-op library, in both load orders (docs/atlas.md §3, §4).

CANN's library cannot load here; these tests use its CPU stand-in (TEST DOUBLE,
``tests/testdoubles/cann_custom_ops.cpp``: ``TORCH_LIBRARY(custom, m)`` with the seven schemas, CANN's
Meta kernels and throwing PrivateUse1 kernels), built once per session. Every scenario runs in a child
process: a wrong order aborts the process inside ``dlopen`` (exit code -6 / 134), which pytest itself
could not survive.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import offload_passes
from offload_passes.custom_ops import _cann, _library as Lib, cann_library_status

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "tests" / "testdoubles"))
import cann_standin  # noqa: E402

INPLACE = ("dsa_serve", "dsa_install", "npu_gather_selection_kv_cache")


@pytest.fixture(scope="module")
def standin() -> Path:
    return cann_standin.build()


def _run(code: str, *args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 600):
    full = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    full.pop(_cann.ENV_VAR, None)
    full.update(env or {})
    # default cwd: not the repository root, whose own custom_ops/ folder would shadow the wheel's
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=full,
                          cwd=cwd or REPO / "tests", capture_output=True, text=True, timeout=timeout)


def _ok(res) -> dict:
    assert res.returncode == 0, f"rc={res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


# Shared by the child processes: checks the kernels every op ends up with when CANN (the stand-in)
# owns the schemas, then runs a few plain CPU calls and a compiled offload-demo.
_CHECKS = """
import json, sys, torch
# (offload_passes is imported by each scenario below, in its own order)

def check_cann_owned(expect_when):
    from offload_passes.custom_ops import _library as Lib, cann_library_status
    s = cann_library_status()
    assert s.loaded and s.when == expect_when, s.as_dict()
    assert s.path and s.path.endswith("custom_ops_lib.so"), s.path
    assert s.missing_npu_kernels == [] and s.schema_mismatches == [], s.as_dict()
    for name, o in s.ops.items():
        assert o.schema_owner == "cann" and o.npu_kernel and not o.npu_guard, o
        assert o.meta_kernel and not o.our_fake, o            # CANN's Meta kernel, no fake of ours
        assert o.cpu_kernel, o                                # ... plus our CPU kernel
        assert o.functionalize_kernel == (name in ("dsa_serve", "dsa_install", "npu_gather_selection_kv_cache")), o
    assert list(Lib.defined_ops()) == []
    return s

def npu_call_reaches_cann():
    # The stand-in's PrivateUse1 kernel (not a guard of ours, not a CPU fallback) answers an NPU call.
    try:
        torch.ops.custom.dsa_plan.default.redispatch(
            torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1),
            torch.zeros(1, 1, 64, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            torch.zeros(1, 16, dtype=torch.int32), torch.zeros(1, 8, dtype=torch.int32),
            torch.zeros(1, 1, dtype=torch.int32))
    except RuntimeError as e:
        assert "TEST DOUBLE" in str(e), e
    else:
        raise AssertionError("PrivateUse1 call did not raise")

def cpu_plan_call():
    topk = torch.arange(64, dtype=torch.int32).view(1, 1, 64)
    plan, rec, act = torch.ops.custom.dsa_plan(topk, torch.tensor([100], dtype=torch.int32),
        torch.full((1, 16), -1, dtype=torch.int32), torch.full((1, 128), -1, dtype=torch.int32),
        torch.zeros(1, 1, dtype=torch.int32))
    assert act.tolist() == [64] and plan[:, 0].eq(2).sum() == 64, (act, plan[:4])

def run_demo():
    from offload_passes.apps import demo
    import contextlib, io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = demo.main(["--steps", "2", "--json"])
    out = json.loads(buf.getvalue())
    assert rc == 0 and out["within_tolerance"], (rc, out)
    return out
"""


def test_cann_first_then_import(standin):
    """(a) CANN's library loaded before ``import offload_passes``: nothing redefined, CPU kernels added,
    and the offload-demo path runs on them."""
    code = _CHECKS + """
assert "offload_passes" not in sys.modules
torch.ops.load_library(sys.argv[1])
import offload_passes
s = check_cann_owned("before")
assert s.source == "preloaded", s.as_dict()
npu_call_reaches_cann()
cpu_plan_call()
out = run_demo()
assert check_cann_owned("before") == s   # loading our own C++ CPU kernels did not touch the record
print(json.dumps({"ops": out["ops"], "within": out["within_tolerance"]}))
"""
    out = _ok(_run(code, str(standin)))
    assert out["within"] and out["ops"]["dsa_plan"] > 0 and out["ops"]["dsa_install"] > 0, out


def test_import_then_cann_with_torch_ops_load_library(standin):
    """(b) ``import offload_passes`` first, then the reference's loader (``torch.ops.load_library``): no
    abort; CANN now owns the schemas, the ``torch.ops.custom`` objects taken before stay valid, and the
    offload-demo path runs on our CPU kernels."""
    code = _CHECKS + """
import offload_passes
from offload_passes.custom_ops import cann_library_status
plan_packet = torch.ops.custom.dsa_plan
serve_overload = torch.ops.custom.dsa_serve.default
before = cann_library_status()
assert not before.loaded and all(o.npu_guard and o.our_fake for o in before.ops.values()), before.as_dict()
torch.ops.load_library(sys.argv[1])
s = check_cann_owned("after")
assert s.source == "torch.ops.load_library", s.as_dict()
assert torch.ops.custom.dsa_plan is plan_packet and torch.ops.custom.dsa_serve.default is serve_overload
npu_call_reaches_cann()
cpu_plan_call()
out = run_demo()
assert check_cann_owned("after") == s
print(json.dumps({"ops": out["ops"], "within": out["within_tolerance"]}))
"""
    out = _ok(_run(code, str(standin)))
    assert out["within"] and out["ops"]["dsa_plan"] > 0 and out["ops"]["dsa_serve"] > 0, out


@pytest.mark.parametrize("how", ["load_cann_ops", "import_custom_ops"])
def test_import_then_cann_other_loaders(standin, tmp_path, how):
    """(b) the two other late loaders: ``offload_passes.load_cann_ops(path)`` and ``import custom_ops``
    (the wheel's ``__init__`` imports its ``custom_ops_lib`` extension). Discovery is switched off so the
    wheel on ``PYTHONPATH`` is not picked up at import."""
    site = tmp_path / "site"
    cann_standin.wheel_layout(site, standin)
    load = {
        "load_cann_ops": "offload_passes.load_cann_ops(sys.argv[1])",
        "import_custom_ops": "import custom_ops",
    }[how]
    source = {"load_cann_ops": "explicit", "import_custom_ops": "import"}[how]
    code = _CHECKS + f"""
import offload_passes
from offload_passes.custom_ops import cann_library_status
assert not cann_library_status().loaded
{load}
s = check_cann_owned("after")
assert s.source == {source!r}, s.as_dict()
npu_call_reaches_cann()
cpu_plan_call()
# fake tensors now go through CANN's Meta kernels
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode():
    plan, rec, act = torch.ops.custom.dsa_plan(torch.empty(2, 3, 1, 128, dtype=torch.int32),
        torch.empty(2, dtype=torch.int32), torch.empty(2, 64, dtype=torch.int32),
        torch.empty(2, 1000, dtype=torch.int32), torch.empty(2, 4, dtype=torch.int32), raw_seq=3)
    assert tuple(plan.shape) == (768, 2) and tuple(act.shape) == (6,) and rec.numel() == 2 * 3 * 8 * 4096 + 4096 + 4095
print(json.dumps({{"ok": True}}))
"""
    pkg_lib = site / "custom_ops" / "custom_ops_lib.so"
    _ok(_run(code, str(pkg_lib), env={"PYTHONPATH": str(site), _cann.ENV_VAR: "none"}))


def test_raw_dlopen_after_import_still_aborts(standin):
    """Documents the limit: a ``ctypes.CDLL`` we cannot see still hits PyTorch's duplicate-schema abort
    (the reason for the hooks and for loading CANN first)."""
    code = """
import ctypes, sys
import offload_passes
ctypes.CDLL(sys.argv[1])
print("survived")
"""
    res = _run(code, str(standin))
    assert res.returncode != 0 and "survived" not in res.stdout
    assert "Tried to register an operator (custom::" in res.stderr, res.stderr[-3000:]


def test_discovered_from_installed_wheel_before_defining(standin, tmp_path):
    """``import offload_passes`` finds ``custom_ops/custom_ops_lib*.so`` on ``sys.path`` and loads it before
    defining anything, also when run from the repository root (whose own ``custom_ops/`` folder must be
    skipped)."""
    site = tmp_path / "site"
    pkg = cann_standin.wheel_layout(site, standin)
    code = _CHECKS + """
import offload_passes
s = check_cann_owned("before")
assert s.source == "discovered", s.as_dict()
assert "custom_ops" not in sys.modules          # the wheel's __init__ (torch_npu mount) is not imported
print(json.dumps({"path": s.path}))
"""
    out = _ok(_run(code, env={"PYTHONPATH": str(site)}, cwd=REPO))
    assert Path(out["path"]) == (pkg / "custom_ops_lib.so").resolve()


def test_env_var_loads_first(standin, tmp_path):
    site = tmp_path / "site"
    pkg = cann_standin.wheel_layout(site, standin)
    value = str(pkg / "custom_ops_lib.so")
    code = _CHECKS + """
import offload_passes
s = check_cann_owned("before")
print(json.dumps({"source": s.source, "env": s.env_value}))
"""
    out = _ok(_run(code, env={_cann.ENV_VAR: value}))
    assert out == {"source": "env", "env": value}


def test_library_search_rules(tmp_path, monkeypatch):
    """Where ``find_cann_library`` looks (no loading here): the env var (file, directory, or parent of
    ``custom_ops/``) wins; else ``custom_ops/custom_ops_lib*.so`` on ``sys.path``, never our own folder."""
    site = tmp_path / "site"
    pkg = site / "custom_ops"
    pkg.mkdir(parents=True)
    lib = pkg / "custom_ops_lib.cpython-311-aarch64-linux-gnu.so"
    lib.write_bytes(b"")
    monkeypatch.delenv(_cann.ENV_VAR, raising=False)
    monkeypatch.setattr(sys, "path", [str(REPO), str(tmp_path / "nothing"), str(site)])
    assert _cann.find_cann_library() == lib  # REPO/custom_ops (ours) skipped
    for value in (str(lib), str(pkg), str(site)):
        monkeypatch.setenv(_cann.ENV_VAR, value)
        assert _cann.find_cann_library() == lib, value
    monkeypatch.setenv(_cann.ENV_VAR, "none")
    assert _cann.find_cann_library() is None
    monkeypatch.setenv(_cann.ENV_VAR, str(tmp_path / "nothing"))
    with pytest.raises(RuntimeError, match="no such file, and no custom_ops_lib"):
        _cann.find_cann_library()
    monkeypatch.delenv(_cann.ENV_VAR)
    monkeypatch.setattr(sys, "path", [str(REPO)])
    monkeypatch.setattr(_cann.sysconfig, "get_paths", lambda: {})
    assert _cann.find_cann_library() is None


def test_own_cpu_kernel_libraries_never_look_like_cann(tmp_path):
    """Our C++ CPU kernels define offload_cpu:: ops with the same names; loading them must not hand our
    custom:: schemas away (they are recognised by their build name)."""
    ours = tmp_path / "offload_passes_dsa_plan.so"
    ours.write_bytes(b"...dsa_plan(Tensor selection_topk_indices, ...")
    cann = tmp_path / "custom_ops_lib.so"
    cann.write_bytes(ours.read_bytes())
    assert not _cann._defines_our_ops(ours, {"dsa_plan"})
    assert _cann._defines_our_ops(cann, {"dsa_plan"})
    assert not _cann._defines_our_ops(cann, {"dsa_serve"})


def test_env_var_pointing_nowhere_fails_at_import(tmp_path):
    res = _run("import offload_passes", env={_cann.ENV_VAR: str(tmp_path / "missing.so")})
    assert res.returncode == 1
    assert f"{_cann.ENV_VAR}={str(tmp_path / 'missing.so')!r}: no such file" in res.stderr, res.stderr[-2000:]


def test_env_var_none_disables_discovery(standin, tmp_path):
    site = tmp_path / "site"
    cann_standin.wheel_layout(site, standin)
    code = """
import json, offload_passes
from offload_passes.custom_ops import cann_library_status
s = cann_library_status()
print(json.dumps({"loaded": s.loaded, "discovery": s.discovery}))
"""
    out = _ok(_run(code, env={"PYTHONPATH": str(site), _cann.ENV_VAR: "none"}))
    assert out == {"loaded": False, "discovery": "disabled"}


def test_failed_late_load_restores_our_definitions(tmp_path):
    """A library that mentions our schemas but cannot be loaded: our schemas, fakes and guards come back
    and the ops keep working (nothing half-registered)."""
    bogus = tmp_path / "custom_ops_lib.so"
    bogus.write_bytes(b"not an ELF file; dsa_plan(Tensor selection_topk_indices ...")
    code = _CHECKS + """
import offload_passes
from offload_passes.custom_ops import cann_library_status
try:
    offload_passes.load_cann_ops(sys.argv[1])
except OSError as e:
    err = str(e)
else:
    raise AssertionError("loading a non-library did not raise")
s = cann_library_status()
assert not s.loaded and s.error and sys.argv[1] in s.error, s.as_dict()
assert all(o.schema_owner == "offload_passes" and o.npu_guard and o.our_fake and o.schema_matches
           for o in s.ops.values()), s.as_dict()
cpu_plan_call()
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode():
    torch.ops.custom.dsa_plan(torch.empty(1, 1, 64, dtype=torch.int32), torch.empty(1, dtype=torch.int32),
        torch.empty(1, 16, dtype=torch.int32), torch.empty(1, 8, dtype=torch.int32), torch.empty(1, 1, dtype=torch.int32))
print(json.dumps({"ok": True}))
"""
    _ok(_run(code, str(bogus)))


def test_fakes_agree_with_cann_meta_kernels(standin):
    """(c) our fakes vs the stand-in's Meta kernels (CANN's output shapes) over 100 random geometries per op
    (700 calls), including ``install_records``' byte size from docs/ops.md §2.2."""
    res = subprocess.run(
        [sys.executable, str(HERE / "cann_meta_check.py"), str(standin), "100", "20261201"],
        env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"), capture_output=True, text=True, timeout=600,
    )
    counts = _ok(res)
    assert counts == {name: 100 for name in offload_passes.custom_ops.CUSTOM_OPS}, counts


# --------------------------------------------------------------------------------------------
# No CANN library (this process): an NPU call raises a clear error, never a CPU fallback
# --------------------------------------------------------------------------------------------

class NPUTensorDouble(torch.Tensor):
    """TEST DOUBLE for an NPU tensor: a storage-less tensor whose backend dispatch key is PrivateUse1
    (device ``privateuseone:0``, what torch_npu's tensors carry). Its ``__torch_dispatch__`` only steps
    below the Python key, so the real dispatcher picks the op's PrivateUse1 kernel (or a PrivateUse1
    fallback) exactly as for a torch_npu tensor."""

    @staticmethod
    def __new__(cls, like: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype,
                                                   device=torch.device("privateuseone", 0))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with torch._C._DisableTorchDispatch():
            return func(*args, **(kwargs or {}))


@pytest.fixture
def npu_autograd_fallthrough():
    """TEST DOUBLE for torch_npu's AutogradPrivateUse1 fallback: the Autograd key of an NPU tensor passes a
    call on to PrivateUse1. torch 2.13 has this fallthrough by default; torch 2.8 leaves it to the backend
    (torch_npu registers it), so without it the call stops at 'AutogradPrivateUse1'."""
    lib = None
    if not torch._C._dispatch_has_backend_fallback(torch._C.DispatchKey.AutogradPrivateUse1):
        lib = torch.library.Library("_", "IMPL", "AutogradPrivateUse1")
        lib.fallback(torch.library.fallthrough_kernel)
    yield
    if lib is not None:
        lib._destroy()


def _plan_args(npu: bool):
    ts = (torch.zeros(1, 1, 64, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
          torch.zeros(1, 16, dtype=torch.int32), torch.zeros(1, 8, dtype=torch.int32),
          torch.zeros(1, 1, dtype=torch.int32))
    return tuple(NPUTensorDouble(t) for t in ts) if npu else ts


@pytest.mark.parametrize("name", sorted(offload_passes.custom_ops.CUSTOM_OPS))
def test_every_op_has_an_npu_guard_without_cann(name):
    s = cann_library_status().ops[name]
    assert s.schema_owner == "offload_passes" and s.npu_guard and not s.npu_kernel
    assert Lib.has_kernel(name, "PrivateUse1")


def test_npu_call_without_cann_raises_instead_of_cpu_fallback(npu_autograd_fallthrough):
    """Our PrivateUse1 kernel answers an NPU call. torch_npu's CPU fallback is a *backend fallback*
    (``m.fallback`` for PrivateUse1), which the dispatcher only uses for ops without a PrivateUse1 kernel;
    a Python-registered fallback double cannot be used here (torch 2.13 asserts ``func != nullptr`` when
    one is called), so the control test below shows the routing without a guard instead."""
    assert not cann_library_status().loaded
    with pytest.raises(RuntimeError) as e:
        torch.ops.custom.dsa_plan(*_plan_args(npu=True))
    msg = str(e.value)
    assert msg.startswith("custom::dsa_plan was called on an NPU tensor, but CANN's custom-op library")
    for needle in ("custom_ops_lib*.so", "On an Atlas A3", "OFFLOAD_PASSES_CANN_OPS_LIB", "load_cann_ops(path)"):
        assert needle in msg, needle
    # in-place ops too (the mutated arguments are NPU tensors)
    with pytest.raises(RuntimeError, match="custom::dsa_install was called on an NPU tensor"):
        torch.ops.custom.dsa_install(*[NPUTensorDouble(torch.zeros(1, dtype=torch.int8))] * 9)
    # the same call on CPU tensors runs our CPU kernel
    plan, _, act = torch.ops.custom.dsa_plan(*_plan_args(npu=False))
    assert plan.shape == (64, 2) and act.tolist() == [0]


def test_npu_double_routes_to_privateuse1(npu_autograd_fallthrough):
    """Control: without a PrivateUse1 kernel the same tensor double makes the dispatcher look for the
    PrivateUse1 backend (here: no kernel, no fallback -> NotImplementedError naming it)."""
    lib = torch.library.Library("offload_test_noguard", "DEF")
    lib.define("f(Tensor x) -> Tensor")
    lib.impl("f", lambda x: x, "CPU")
    try:
        with pytest.raises(NotImplementedError, match="'PrivateUse1' backend"):
            torch.ops.offload_test_noguard.f(NPUTensorDouble(torch.zeros(2)))
        assert torch.ops.offload_test_noguard.f(torch.zeros(2)).shape == (2,)
    finally:
        lib._destroy()


def test_status_is_json_ready():
    d = cann_library_status().as_dict()
    assert json.loads(json.dumps(d)) == d
    assert set(d["ops"]) == set(offload_passes.custom_ops.CUSTOM_OPS)
    assert d["missing_npu_kernels"] == sorted(d["ops"], key=list(offload_passes.custom_ops.CUSTOM_OPS).index)

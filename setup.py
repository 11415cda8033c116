"""Packaging for offload_passes.

Import layout: the repository keeps one top-level folder per component (custom_ops/, converters/,
models/, tools/), but they are installed *inside* the ``offload_passes`` package
(``offload_passes.custom_ops`` ...). Real Ascend machines already carry CANN's own ``custom_ops``
wheel, and ``models``/``tools`` are names many projects use; nothing of ours lands in
site-packages under those names.

C++ extensions (``offload_passes/_extensions.py`` names them and holds their flags) are built here, with
torch's ``BuildExtension``, as torchvision does: all CPU kernels (``custom_ops/csrc/*.cpp``) in one
library installed as ``offload_passes.custom_ops._C_torch<version>``, the offload-sim core
(``offload_passes/trace/csrc/trace_sim.cpp``) as ``offload_passes.trace._trace_sim_torch<version>``, and
the serving loop's KV transfer (``models/glm/csrc/kv_transfer.cpp``) as
``offload_passes.models.glm._kv_transfer_torch<version>``.
torch must already be installed: build with ``pip install --no-build-isolation`` (an isolated build env
would download a second, possibly CUDA, torch and build against it).

The ``torch`` requirement depends on what is built: a binary wheel (``pip wheel --no-build-isolation .``)
requires ``torch==<the torch it was compiled against>``, since its libraries load only there; an editable
install or an sdist requires the tested range (``_extensions.torch_requirement``).
"""
import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1: the wheel package's command
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # pragma: no cover - depends on how pip was called
    sys.exit(
        "offload_passes builds its C++ kernels against the installed torch: install torch first, then "
        "`pip install --no-build-isolation -e .` (or `bash scripts/setup.sh`)"
    )


def _load_extensions_module():
    # By path: importing the package itself would register the ops (and needs the built kernels).
    spec = importlib.util.spec_from_file_location("_offload_extensions", ROOT / "offload_passes" / "_extensions.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EXT = _load_extensions_module()


def _rel(paths) -> list:
    return [str(Path(p).relative_to(ROOT)) for p in paths]


# The interpreter's CFLAGS (sysconfig) add -g, which the JIT build does not: without -g0 each library is
# 9-11 MB of mostly debug info instead of ~250 KB.
NO_DEBUG_INFO = ["-g0"]

EXT_MODULES = [
    CppExtension(
        name="offload_passes.custom_ops." + EXT.cpu_kernels_name(torch.__version__),
        sources=_rel(EXT.cpu_kernel_sources(ROOT / "custom_ops" / "csrc")),
        include_dirs=[str(ROOT / "custom_ops" / "csrc")],
        extra_compile_args=list(EXT.CPU_KERNELS_CFLAGS) + NO_DEBUG_INFO,
        extra_link_args=list(EXT.CPU_KERNELS_LDFLAGS),
    ),
    CppExtension(
        name="offload_passes.trace." + EXT.trace_sim_name(torch.__version__),
        sources=_rel([ROOT / "offload_passes" / "trace" / "csrc" / "trace_sim.cpp"]),
        extra_compile_args=list(EXT.TRACE_SIM_CFLAGS) + NO_DEBUG_INFO,
    ),
    CppExtension(
        name="offload_passes.models.glm." + EXT.kv_transfer_name(torch.__version__),
        sources=_rel([ROOT / "models" / "glm" / "csrc" / "kv_transfer.cpp"]),
        extra_compile_args=list(EXT.KV_TRANSFER_CFLAGS) + NO_DEBUG_INFO,
    ),
]


class _BuildExt(BuildExtension):
    """BuildExtension for a checkout that venvs of several torch versions install from (editable)."""

    def finalize_options(self):
        super().finalize_options()
        # One object folder per torch version, kept in the checkout (pip's editable builds would otherwise
        # use a fresh temporary one): re-installs recompile only what changed (ninja), and the 2.8 and
        # 2.13 venvs never reuse each other's objects.
        self.build_temp = str(ROOT / "build" / ("temp-" + EXT.torch_tag(torch.__version__)))

    def copy_file(self, infile, outfile, *args, **kwargs):
        # Write beside and rename (the in-place copy of an editable install): a process that has the
        # previous library loaded keeps its intact file instead of one truncated under it.
        if os.path.isdir(outfile):
            return super().copy_file(infile, outfile, *args, **kwargs)
        tmp = f"{outfile}.tmp-{os.getpid()}"
        result = super().copy_file(infile, tmp, *args, **kwargs)
        os.replace(tmp, outfile)
        return outfile, result[1]


class _BdistWheel(bdist_wheel):
    """``bdist_wheel`` (``pip wheel``, ``pip install .``): the wheel's METADATA pins the torch its kernels
    were compiled against (``_extensions.torch_requirement``).

    The pin is written into the wheel's own dist-info, whether pip's metadata step made it (reused with
    ``--dist-info-dir``) or this command did. ``pip install -e .`` (``editable_wheel``) also calls
    ``write_wheelfile`` of this class, without ``run``: its metadata keeps the range.
    """

    def run(self):
        self._binary_wheel = True
        super().run()

    def write_wheelfile(self, wheelfile_base, *args, **kwargs):
        if getattr(self, "_binary_wheel", False):
            metadata = Path(wheelfile_base) / "METADATA"
            metadata.write_text(EXT.pin_torch_in_metadata(metadata.read_text(), torch.__version__))
        return super().write_wheelfile(wheelfile_base, *args, **kwargs)


# Installed name -> repository folder. Sub-packages (folders with __init__.py) are found below each.
COMPONENTS = {
    "offload_passes": "offload_passes",
    "offload_passes.custom_ops": "custom_ops",
    "offload_passes.converters": "converters",
    "offload_passes.models": "models",
    "offload_passes.tools": "tools",
}


def _packages() -> dict:
    found = {}
    for name, folder in COMPONENTS.items():
        found[name] = folder
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            if rel.parts and not any(p.startswith((".", "_")) or p == "csrc" for p in rel.parts):
                found[".".join((name,) + rel.parts)] = "/".join((folder,) + rel.parts)
    # offload_passes/ must not swallow the mapped folders
    return found


PACKAGES = _packages()

setup(
    name="offload_passes",
    version="0.1.0",
    description="torch.compile backend that rewrites GLM-5.2 DSA decode graphs into the shared-indexer KV-offload scheme",
    python_requires=">=3.10",
    packages=list(PACKAGES),
    package_dir=PACKAGES,
    package_data={
        "offload_passes.custom_ops": ["csrc/*.cpp", "csrc/*.h"],
        "offload_passes.trace": ["csrc/*.cpp"],
        "offload_passes.models": ["configs/*.yaml", "glm/csrc/*.cpp"],  # serve.py's JIT fallback of its KV transfer
    },
    install_requires=[
        # the tested range; a binary wheel pins the exact torch instead (_BdistWheel below, docs/build.md)
        EXT.torch_requirement(torch.__version__, binary_wheel=False),
        "sympy",
        "pyyaml",
        "ninja",  # the JIT fallback (custom_ops/_library.py) when no prebuilt kernels match the torch
        "safetensors",
        "numpy",  # safetensors.torch and TorchAir need it; the torch CPU wheel does not pull it in
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "protobuf>=3.13", "packaging", "scipy"],
        "plan": ["numpy", "scipy"],  # offload-capacity --what-if: the bounded least-squares fit (tools/capacity_plan_whatif.py)
        "viz": ["graphviz", "matplotlib"],  # matplotlib: offload-sim --plot
        # the HF front-end (models/hf, passes/frontends/hf/), verified on 5.23.0 and 5.25.0 (models/hf TRANSFORMERS_VERIFIED)
        "hf": ["transformers>=5.23,<5.26"],
        "cuda": ["triton>=3.2"],  # the Triton kernels (custom_ops/cuda/); tests/cuda run them in its interpreter on CPU
        # the KV store's shared tier (offload_passes/store, docs/store.md): Mooncake Store client and mooncake_master
        "store": ["mooncake-transfer-engine-non-cuda", "safetensors"],
    },
    ext_modules=EXT_MODULES,
    cmdclass={"build_ext": _BuildExt, "bdist_wheel": _BdistWheel},
    entry_points={
        "torch_dynamo_backends": ["dsa_offload = offload_passes.backend:dsa_offload_backend"],
        "console_scripts": [
            "offload-demo = offload_passes.apps.demo:main",
            "offload-inspect = offload_passes.tools.inspect_dump:main",
            "offload-capacity = offload_passes.tools.capacity_plan:main",
            "offload-plan = offload_passes.tools.capacity_plan:main_alias",  # deprecated alias of offload-capacity
            "offload-atlas-check = offload_passes.tools.atlas_check:main",
            "offload-sim = offload_passes.trace.cli:main",
        ],
    },
)

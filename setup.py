"""Packaging for offload_passes.

Import layout: the repository keeps one top-level folder per component (custom_ops/, converters/,
models/, tools/), but they are installed *inside* the ``offload_passes`` package
(``offload_passes.custom_ops`` ...). Real Ascend machines already carry CANN's own ``custom_ops``
wheel, and ``models``/``tools`` are names many projects use; nothing of ours lands in
site-packages under those names.
"""
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
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
        "offload_passes.models": ["configs/*.yaml"],
    },
    install_requires=[
        "torch>=2.8,<2.14",  # checked: 2.8.0 and 2.13.0 (scripts/test_matrix.sh)
        "sympy",
        "pyyaml",
        "ninja",
        "safetensors",
        "numpy",  # safetensors.torch and TorchAir need it; the torch CPU wheel does not pull it in
    ],
    extras_require={
        "test": ["pytest", "hypothesis", "protobuf>=3.13", "packaging"],
        "viz": ["graphviz", "matplotlib"],  # matplotlib: offload-sim --plot
        "hf": ["transformers==5.23.0"],  # the HF front-end (models/hf, passes/detect_hf.py), verified on 5.23.0
    },
    entry_points={
        "torch_dynamo_backends": ["dsa_offload = offload_passes.backend:dsa_offload_backend"],
        "console_scripts": [
            "offload-demo = offload_passes.demo:main",
            "offload-inspect = offload_passes.tools.inspect_dump:main",
            "offload-plan = offload_passes.tools.capacity_plan:main",
            "offload-atlas-check = offload_passes.tools.atlas_check:main",
            "offload-sim = offload_passes.trace.cli:main",
        ],
    },
)

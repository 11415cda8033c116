#!/usr/bin/env bash
# Installs offload_passes (editable, C++ kernels built by pip) with its test extras, the CPU build of torch 2.13.0, Graphviz's
# `dot` (for offload-inspect --svg/--png) and the TorchAir / npugraph_ex Python sources used by the
# converter tests (extracted from the torch-npu wheel, never installed into site-packages).
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
# torch 2.13.0 by default; OFFLOAD_PASSES_TORCH=2.8.0 / 2.10.0 / 2.11.0 / 2.14.1 / 2.15.0 picks another tested version
# (setup.py: >=2.8,<2.16; scripts/test_matrix.sh runs them; docs/versions.md). The TorchAir sources below follow the
# installed torch (none exist for torch 2.15: no torch-npu release).
python -m pip install -q "torch==${OFFLOAD_PASSES_TORCH:-2.13.0}"
# The C++ kernels are compiled here, at install (about 3 min on 2 cores), against the torch just installed:
# --no-build-isolation so that pip builds with this environment's torch/setuptools/ninja instead of
# downloading a second torch into an isolated build env (pyproject.toml lists no torch on purpose).
python -m pip install -q "setuptools>=64" wheel ninja
python -m pip install -q --no-build-isolation -e ".[test,viz,hf,store]"
# transformers 5.25.0, the newest release the HF front-end is verified on (the [hf] extra allows 5.23 to 5.25;
# docs/hf.md). It requires `kernels>=0.19.1,<0.20` (hub kernels for accelerators, imported only when installed),
# which some package indexes do not carry: then 5.25.0 is installed with its other requirements, without that one.
if ! python -m pip install -q "transformers==5.25.0" 2>/dev/null; then
  echo "setup: transformers 5.25.0's requirement kernels>=0.19.1 is not on this index; installing it without kernels" >&2
  python -m pip install -q --no-deps "transformers==5.25.0"
  python - <<'PY'
import subprocess, sys
from importlib.metadata import requires
from packaging.requirements import Requirement
reqs = [str(r) for r in map(Requirement, requires("transformers")) if r.marker is None and r.name != "kernels"]
subprocess.run([sys.executable, "-m", "pip", "install", "-q", *reqs], check=True)
PY
fi
python -m pip install -q "triton>=3.2"  # the [cuda] extra (no torch dependency): tests/cuda run the Triton kernels in its interpreter
python - <<'PY'
import offload_passes.custom_ops._library as L
lib = L.prebuilt_library()
if lib is None:
    raise SystemExit("setup: pip install did not build the C++ CPU kernels for this torch (see the pip output)")
print("setup: C++ CPU kernels built at install:", lib)
PY
if ! command -v dot >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) || echo "setup: could not install graphviz; offload-inspect --svg/--png will ask for --dot" >&2
  else
    echo "setup: install Graphviz (dot) for offload-inspect --svg/--png" >&2
  fi
fi
if python -c "from offload_passes.tools.torchair_env import default_torch_npu_version as f; raise SystemExit(f() is None)"; then
  python -m offload_passes.tools.torchair_env --ensure
else
  python -c "from offload_passes.tools.torchair_env import no_torch_npu_reason as f; print('setup:', f())" >&2
fi
# The KV store's shared tier (the [store] extra: docs/store.md): the Mooncake Store client and mooncake_master,
# CPU build. Its transfer engine links libibverbs even for TCP, so the library is installed where we can.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null) || echo "setup: could not install libibverbs1; the Mooncake tier may not load" >&2
fi
python -m pip install -q "mooncake-transfer-engine-non-cuda"  # the [store] extra above; again here for a set-up that skipped it

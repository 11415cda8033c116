#!/usr/bin/env bash
# benchmarks/gpu_check.py on a lent GPU machine with no network (docs/cuda.md, "On a lent H200").
#
#   bash scripts/lent_gpu.sh fetch                # here, with network: the wheels the machine's image lacks -> .whl/
#   bash scripts/lent_gpu.sh run [gpu_check args] # there: install .whl/ and this checkout, then the check
#
# The image (torch 2.11.0+cu130, triton 3.6, transformers 5.17, Python 3.12) has everything but the
# transformers the HF front-end is verified on (5.23.0: its StaticIndexedLayer keeps the MLA latent cache
# the front-end rewrites; 5.17 caches the expanded K/V); its other requirements are in the image.
# `run` installs the carried wheels into /tmp/site (first on PYTHONPATH), builds this checkout's C++ CPU
# kernels against the image's torch (pip, editable, no index, all cores), then runs the check with the
# arguments given (JSON and table in gpu_check.json / on stdout).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=("transformers==5.23.0")

case "${1:-}" in
  fetch)
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"  # carried, never committed
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "${WHEELS[@]}"
    ls -l .whl
    ;;
  run)
    shift
    ls .whl/*.whl >/dev/null 2>&1 || { echo "lent_gpu.sh: no .whl/*.whl (run 'fetch' first, carry .whl)" >&2; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    MAX_JOBS=$(nproc) "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
    export TORCH_DEVICE_BACKEND_AUTOLOAD=0 PYTHONUNBUFFERED=1
    "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
 'transformers', transformers.__version__, torch.cuda.get_device_name())"
    "$PY" benchmarks/gpu_check.py "$@"
    ;;
  *)
    echo "usage: bash scripts/lent_gpu.sh fetch | run [gpu_check args]" >&2
    exit 2
    ;;
esac

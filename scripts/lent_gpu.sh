#!/usr/bin/env bash
# The GPU check of the CUDA path on a lent GPU machine with no network (docs/cuda.md, "On a lent H200"): first the
# device tests (pytest with OFFLOAD_PASSES_GPU=1: the tests of tests/cuda marked `device`, on the GPU with the
# compiled Triton kernels), then the timings (benchmarks/gpu_check.py). One command:
#
#   bash scripts/lent_gpu.sh fetch                 # here, with network: the wheels the machine's image lacks -> .whl/
#   bash scripts/lent_gpu.sh run [gpu_check args]  # there: install .whl/ and this checkout, the tests, the timings
#   bash scripts/lent_gpu.sh tests                 # there, after a `run`: the device tests again
#   bash scripts/lent_gpu.sh timings [gpu_check args]  # there, after a `run`: the timings again (e.g. --sections serve --merge)
#   bash scripts/lent_gpu.sh dry                   # anywhere, no GPU: the device tests on the CPU (Triton's
#                                                  # interpreter), then gpu_check.py --dry-run; nothing installed
#   bash scripts/lent_gpu.sh --help
#
# Figures go under $OUT (default: the checkout's root): device_tests_<group>.xml (JUnit: each test's verdict and the
# values it records, e.g. max_abs_diff) and device_tests_<group>.txt (pytest's output) per group below;
# gpu_check.json and gpu_check.txt (the timings' table). The exit status is 1 when a group or the timings failed;
# every part runs regardless.
#
# The device tests run one process per group under its own wall-clock limit (a fatal CUDA error or a hang ends
# that group only): group, limit in seconds (estimates by arithmetic, not measured: kernels 65 s, models 115 s), files.
DEVICE_GROUPS=(
  "kernels 120 tests/cuda/test_device_ops.py tests/cuda/test_host_kv_write.py tests/cuda/test_static_cache_write.py tests/cuda/test_gpu_capacity.py"
  "models 180 tests/cuda/test_device_models.py"
)
#
# The image (torch 2.11.0+cu130, triton 3.6, transformers 5.17, Python 3.12) has everything but the
# transformers the HF front-end is verified on (5.23.0: its StaticIndexedLayer keeps the MLA latent cache
# the front-end rewrites; 5.17 caches the expanded K/V); its other requirements are in the image.
# `run` installs the carried wheels into /tmp/site (first on PYTHONPATH), builds this checkout's C++ CPU
# kernels against the image's torch (pip, editable, no index, all cores), then the tests and the timings.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=("transformers==5.23.0")
OUT=${OUT:-.}
USAGE="usage: bash scripts/lent_gpu.sh fetch | run [gpu_check args] | tests | timings [gpu_check args] | dry | --help"

device_tests() {  # $1: "gpu" or "dry"; returns 1 when a group failed
  local status=0 group limit files rc
  for spec in "${DEVICE_GROUPS[@]}"; do
    read -r group limit files <<< "$spec"
    rc=0
    if [ "$1" = gpu ]; then
      OFFLOAD_PASSES_GPU=1 timeout "$limit" "$PY" -m pytest -q -rA -p no:cacheprovider -m device $files \
        --junitxml "$OUT/device_tests_$group.xml" > "$OUT/device_tests_$group.txt" 2>&1 || rc=$?
    else
      env -u OFFLOAD_PASSES_GPU "$PY" -m pytest -q -rA -p no:cacheprovider -m device $files \
        --junitxml "$OUT/device_tests_$group.xml" > "$OUT/device_tests_$group.txt" 2>&1 || rc=$?
    fi
    [ "$rc" = 124 ] && echo "device tests $group: passed the limit of $limit s" >> "$OUT/device_tests_$group.txt"
    echo "device tests $group: exit $rc; $(tail -n 1 "$OUT/device_tests_$group.txt")"
    [ "$rc" = 0 ] || status=1
  done
  return $status
}

timings() {  # gpu_check.py with the given arguments; its table also in $OUT/gpu_check.txt
  "$PY" benchmarks/gpu_check.py --json "$OUT/gpu_check.json" "$@" | tee "$OUT/gpu_check.txt"
}

both() {  # $1: "gpu" or "dry", then gpu_check arguments
  local mode=$1 status=0
  shift
  device_tests "$mode" || status=1
  timings "$@" || status=1
  return $status
}

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
    mkdir -p "$OUT"
    both gpu "$@"
    ;;
  tests)
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} TORCH_DEVICE_BACKEND_AUTOLOAD=0 PYTHONUNBUFFERED=1
    mkdir -p "$OUT"
    device_tests gpu
    ;;
  timings)
    shift
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} TORCH_DEVICE_BACKEND_AUTOLOAD=0 PYTHONUNBUFFERED=1
    mkdir -p "$OUT"
    timings "$@"
    ;;
  dry)
    export TORCH_DEVICE_BACKEND_AUTOLOAD=0 PYTHONUNBUFFERED=1
    mkdir -p "$OUT"
    both dry --dry-run
    ;;
  -h|--help)
    echo "$USAGE"
    sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'
    echo "device test groups (group, limit in seconds, files):"
    printf '  %s\n' "${DEVICE_GROUPS[@]}"
    ;;
  *)
    echo "$USAGE" >&2
    exit 2
    ;;
esac

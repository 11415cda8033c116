#!/usr/bin/env bash
# Runs the README's test command on every supported torch version, one venv per version.
#
#   bash scripts/test_matrix.sh                               # torch 2.8.0 2.10.0 2.11.0 2.13.0 2.14.1 2.15.0 (docs/versions.md)
#   TORCH_VERSIONS="2.14.1" bash scripts/test_matrix.sh
#   MATRIX_SETUP_ONLY=1 bash scripts/test_matrix.sh           # build the venvs only, run nothing
#   MATRIX_TESTS="tests/backend/test_compat.py tests/converters" bash scripts/test_matrix.sh   # a subset
#
# Per version: a venv under $MATRIX_DIR (default ~/.cache/offload_passes/matrix/venv-<version>, reused
# when its torch is already that version), torch from PyPI (PyPI serves the CUDA build for these
# versions, ~0.9 GB plus ~3 GB of nvidia libraries, which runs on CPU), this project editable with its
# test extras (the global environment is never touched; pip builds the C++ kernels for that torch), the
# TorchAir / npugraph_ex sources of the matching torch-npu wheel (tools/torchair_env.py:
# TORCH_NPU_FOR_TORCH; a torch that no torch-npu release exists for, 2.15, runs without them and its NPU
# tests skip, naming why, the one skip OFFLOAD_PASSES_NO_SKIP lets through), its own JIT folder, then `python -m pytest -q $MATRIX_PYTEST_ARGS $MATRIX_TESTS`
# (defaults: `-n 2` as in the README, and tests)
# with OFFLOAD_PASSES_NO_SKIP=1 (skips are failures).
# Prints one summary line per version; exits 1 if any version failed.
# A pip configuration that caps torch below a version (a machine whose pip constraints name only the torch
# releases on its disk) makes `pip install torch==<version>` fail: run with PIP_CONFIG_FILE=/dev/null there.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
MATRIX_DIR=${MATRIX_DIR:-$HOME/.cache/offload_passes/matrix}
TORCH_VERSIONS=${TORCH_VERSIONS:-"2.8.0 2.10.0 2.11.0 2.13.0 2.14.1 2.15.0"}
MATRIX_TESTS=${MATRIX_TESTS:-tests}
MATRIX_PYTEST_ARGS=${MATRIX_PYTEST_ARGS:--n 2}
MATRIX_SETUP_ONLY=${MATRIX_SETUP_ONLY:-0}
PYTHON=${PYTHON:-python}
export TORCH_DEVICE_BACKEND_AUTOLOAD=0 PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$MATRIX_DIR"

declare -a SUMMARY
status=0
for v in $TORCH_VERSIONS; do
  venv="$MATRIX_DIR/venv-$v"
  log="$MATRIX_DIR/pytest-$v.log"
  echo "== torch $v: venv $venv"
  if [ ! -x "$venv/bin/python" ]; then
    "$PYTHON" -m venv "$venv" || { SUMMARY+=("torch $v: FAILED (venv)"); status=1; continue; }
  fi
  py="$venv/bin/python"
  have=$("$py" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
  if [ "$have" != "$v" ]; then
    "$py" -m pip install -q "torch==$v" || { SUMMARY+=("torch $v: FAILED (pip install torch==$v)"); status=1; continue; }
  fi
  # --no-build-isolation: pip compiles the C++ kernels (setup.py) against this venv's torch, never a second
  # one pulled into an isolated env; PEP 660 editable (pyproject.toml), so the package_dir mapping holds.
  # The libraries land in the shared checkout named for their torch (_C_torch2_8_0...so), beside the
  # other versions' builds; object files go to build/temp-torch<version>.
  "$py" -m pip install -q "setuptools>=64" wheel ninja >/dev/null
  "$py" -m pip install -q --no-build-isolation -e ".[test,viz,hf,store]" \
    || { SUMMARY+=("torch $v: FAILED (pip install -e .[test,viz,hf,store])"); status=1; continue; }
  # pip resolves setup.py's torch range too: a version outside it is silently swapped for one inside
  after=$("$py" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
  if [ "$after" != "$v" ]; then
    SUMMARY+=("torch $v: FAILED (pip install -e replaced torch $v by ${after:-nothing}: outside setup.py's torch range?)")
    status=1; continue
  fi
  "$py" -c "import offload_passes.custom_ops._library as L, sys; sys.exit(L.prebuilt_library() is None)" \
    || { SUMMARY+=("torch $v: FAILED (no prebuilt C++ kernels after pip install)"); status=1; continue; }
  export TORCH_EXTENSIONS_DIR="$MATRIX_DIR/torch_extensions-$v"  # JIT builds (CANN test double) per torch ABI
  npu=$("$py" -c "from offload_passes.tools.torchair_env import default_torch_npu_version as f; print(f() or '')")
  if [ -n "$npu" ]; then
    "$py" -m offload_passes.tools.torchair_env --ensure \
      || { SUMMARY+=("torch $v: FAILED (TorchAir sources)"); status=1; continue; }
    npu_label="torch-npu $npu TorchAir"
  else
    npu_label="no torch-npu release: the NPU tests skip"
  fi
  torch_full=$("$py" -c "import torch; print(torch.__version__)")
  if [ "$MATRIX_SETUP_ONLY" = 1 ]; then
    SUMMARY+=("torch $torch_full ($npu_label): prepared, nothing run"); continue
  fi
  start=$(date +%s)
  # shellcheck disable=SC2086  # MATRIX_TESTS / MATRIX_PYTEST_ARGS are lists of words
  (cd "$ROOT" && OFFLOAD_PASSES_NO_SKIP=1 "$py" -m pytest -q $MATRIX_PYTEST_ARGS $MATRIX_TESTS -p no:cacheprovider) >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  result=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error|skipped)" "$log" | tail -1 | sed -e 's/^=* *//' -e 's/ *=*$//')
  [ $rc -eq 0 ] || status=1
  SUMMARY+=("torch $torch_full ($npu_label): ${result:-no pytest summary, see $log} [exit $rc, ${secs}s]")
  echo "   log: $log"
done
echo
echo "test matrix (python -m pytest -q $MATRIX_PYTEST_ARGS $MATRIX_TESTS, OFFLOAD_PASSES_NO_SKIP=1):"
for line in "${SUMMARY[@]}"; do echo "  $line"; done
exit $status

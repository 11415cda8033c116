#!/usr/bin/env bash
# Checks that the C++ kernels are built at install and that an installed wheel needs no compiler:
#
#   bash scripts/check_wheel.sh            # work folder: a new /tmp/check_wheel.XXXXXX (kept, printed)
#   CHECK_WHEEL_DIR=/tmp/cw bash scripts/check_wheel.sh
#   CHECK_WHEEL_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu" bash scripts/check_wheel.sh
#       (where pip's configured indexes do not serve the running torch's exact build, e.g. 2.13.0+cpu)
#
# 1. builds a wheel of a clean copy of this checkout (pip wheel --no-build-isolation --no-deps: against the
#    running torch; cold build, nothing from build/ or an editable install's .so files) and checks that its
#    metadata pins that exact torch (Requires-Dist: torch==<version>, offload_passes/_extensions.py);
# 2. creates a fresh venv (no system site-packages) and installs only the wheel with its [test] extra:
#    pip picks torch from the wheel's pin, and the torch it installed must be the one the wheel was built with;
# 3. seals the run: PATH = the venv's bin plus an empty folder (no cc/c++/gcc/clang reachable),
#    CC/CXX = a file that does not exist, TORCH_EXTENSIONS_DIR = an empty folder;
#    control: a forced JIT build (OFFLOAD_PASSES_JIT_KERNELS=1) must fail there;
# 4. in a folder outside the checkout (a copy of tests/, so the source tree is not
#    imported; checked through offload_passes.__file__) runs `offload-demo --config tiny` and
#    `pytest tests/ops` (without test_cann_coexistence.py: it compiles CANN's test double by design);
# 5. checks that TORCH_EXTENSIONS_DIR is still empty. Prints PASS/FAIL per check and a summary; exit 1 on FAIL.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python}
WORK=${CHECK_WHEEL_DIR:-$(mktemp -d /tmp/check_wheel.XXXXXX)}
mkdir -p "$WORK"
export TORCH_DEVICE_BACKEND_AUTOLOAD=0 PIP_DISABLE_PIP_VERSION_CHECK=1
unset OFFLOAD_PASSES_JIT_KERNELS OFFLOAD_PASSES_CPU_KERNELS PYTHONPATH

declare -a RESULTS
npass=0
nfail=0
record() {  # record PASS|FAIL "what"
  RESULTS+=("$1  $2")
  if [ "$1" = PASS ]; then npass=$((npass + 1)); else nfail=$((nfail + 1)); fi
  echo "check_wheel: $1  $2"
}
finish() {
  echo
  echo "check_wheel summary ($WORK):"
  for line in "${RESULTS[@]}"; do echo "  $line"; done
  if [ "$nfail" -eq 0 ]; then echo "check_wheel: PASS ($npass/$((npass + nfail)) checks)"; exit 0; fi
  echo "check_wheel: FAIL ($nfail of $((npass + nfail)) checks failed)"
  exit 1
}

torch_version=$("$PYTHON" -c "import torch; print(torch.__version__)") || { record FAIL "torch importable"; finish; }
echo "check_wheel: work folder $WORK, torch $torch_version"

# 1. wheel, from a clean copy of the checkout (the files git tracks or would add: no build/, no .so), so the
#    build starts cold and cannot pick up anything an editable install left in the tree
rm -rf "$WORK/dist" "$WORK/src"
mkdir -p "$WORK/src"
"$PYTHON" - "$ROOT" "$WORK/src" <<'PY' || { record FAIL "copy of the checkout"; finish; }
import shutil, subprocess, sys
from pathlib import Path
root, dst = Path(sys.argv[1]), Path(sys.argv[2])
listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        check=True, capture_output=True).stdout.decode().split("\0")
for rel in filter(None, listed):
    if (root / rel).is_file():  # tracked files deleted in the work tree are skipped
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dst / rel)
PY
start=$(date +%s)
if "$PYTHON" -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/dist" "$WORK/src" >"$WORK/wheel.log" 2>&1; then
  whl=$(ls "$WORK"/dist/offload_passes-*.whl)
  sos=$("$PYTHON" -m zipfile -l "$whl" | awk '/\.so /{print $1}' | xargs -n1 basename | tr '\n' ' ')
  record PASS "wheel built in $(( $(date +%s) - start )) s: $(basename "$whl") [$sos]"
else
  record FAIL "pip wheel (log: $WORK/wheel.log)"; finish
fi
requires=$("$PYTHON" - "$whl" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    print(" ".join(l.split(":", 1)[1].strip() for l in z.read(meta).decode().splitlines()
                   if l.startswith("Requires-Dist: torch") and "extra ==" not in l))
PY
)
if [ "$requires" = "torch==$torch_version" ]; then
  record PASS "wheel metadata pins the torch it was built with: Requires-Dist: $requires"
else
  record FAIL "wheel metadata: expected Requires-Dist: torch==$torch_version, got: ${requires:-none}"
fi

# 2. fresh venv (nothing from the system site-packages), then the wheel alone: torch comes from its pin
venv="$WORK/venv"
rm -rf "$venv"
start=$(date +%s)
# shellcheck disable=SC2086  # CHECK_WHEEL_PIP_ARGS holds several pip options
if "$PYTHON" -m venv "$venv" \
   && "$venv/bin/python" -m pip install -q ${CHECK_WHEEL_PIP_ARGS:-} "${whl}[test]" >"$WORK/install.log" 2>&1; then
  venv_torch=$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>>"$WORK/install.log")
  if [ "$venv_torch" = "$torch_version" ]; then
    record PASS "fresh venv: wheel[test] installed in $(( $(date +%s) - start )) s; pip chose torch $venv_torch (the build's)"
  else
    record FAIL "fresh venv: pip installed torch ${venv_torch:-?}, the wheel was built against $torch_version"
  fi
else
  record FAIL "venv install (log: $WORK/install.log)"; finish
fi

# 3. sealed environment: no compiler on PATH, CC/CXX point nowhere, empty extensions folder
mkdir -p "$WORK/empty-bin" "$WORK/torch_extensions" "$WORK/run/tests" "$WORK/home"
rm -rf "$WORK/torch_extensions"/* "$WORK/run/tests"/*
run() {  # run [NAME=VALUE...] CMD... in the sealed environment, from the folder outside the checkout
  (cd "$WORK/run" && /usr/bin/env -i HOME="$WORK/home" LANG=C.UTF-8 PATH="$venv/bin:$WORK/empty-bin" \
     CC="$WORK/no-such-cc" CXX="$WORK/no-such-c++" TORCH_EXTENSIONS_DIR="$WORK/torch_extensions" \
     TORCH_DEVICE_BACKEND_AUTOLOAD=0 OMP_NUM_THREADS=2 "$@")
}
# bash by absolute path: it is not on the sealed PATH either
probe=$(run /bin/bash -c 'for c in cc c++ gcc g++ clang clang++ "$CC" "$CXX"; do command -v "$c" || echo "-"; done; command -v python')
found=$(echo "$probe" | grep -v -x -e - -e "$venv/bin/python" | tr '\n' ' ')
if [ "$(echo "$probe" | tail -1)" = "$venv/bin/python" ] && [ -z "$found" ]; then
  record PASS "no compiler reachable (PATH=$venv/bin:$WORK/empty-bin; cc c++ gcc g++ clang clang++ \$CC \$CXX: none found)"
else
  record FAIL "sealed environment: compilers reachable or probe failed: ${found:-$probe}"
fi
if run OFFLOAD_PASSES_JIT_KERNELS=1 python -c "import logging; logging.basicConfig(); import offload_passes.custom_ops._library as L; L.cpu_op('dsa_plan')" >"$WORK/control.log" 2>&1; then
  record FAIL "control: a forced JIT build succeeded in the sealed environment (a compiler is reachable)"
elif grep -q "JIT build (forced by OFFLOAD_PASSES_JIT_KERNELS)" "$WORK/control.log"; then
  record PASS "control: a forced JIT build (OFFLOAD_PASSES_JIT_KERNELS=1) fails there: $(grep -m1 -o -E "RuntimeError: Error building extension '[^']*'" "$WORK/control.log")"
else
  record FAIL "control: the forced JIT build did not start (log: $WORK/control.log)"
fi
rm -rf "$WORK/torch_extensions"/*  # the control may leave a half-made build folder

# 4. the installed package, from outside the checkout
cp -r "$WORK/src/tests/." "$WORK/run/tests/"  # all of tests/ of the copy the wheel was built from (op tests use stand-ins from other folders); run: tests/ops
find "$WORK/run/tests" -name __pycache__ -prune -exec rm -rf {} +
where=$(run python -c "import torch, offload_passes, offload_passes.custom_ops._library as L; print(torch.__file__, offload_passes.__file__, L.cpu_kernels_origin())" 2>"$WORK/where.log")
case "$where" in
  "$venv"/lib/*" $venv"/lib/*" prebuilt") record PASS "torch and the installed package imported from the venv: $where" ;;
  *) record FAIL "import offload_passes from the venv with prebuilt kernels, got: ${where:-error, see $WORK/where.log}" ;;
esac

start=$(date +%s)
run offload-demo --config tiny >"$WORK/demo.log" 2>&1
rc=$?
if [ $rc -eq 0 ]; then
  record PASS "offload-demo --config tiny: exit 0 in $(( $(date +%s) - start )) s"
  grep -E "^  (final graph|pool|host rows|max \|diff\|)" "$WORK/demo.log" | sed 's/^/            demo: /'
else
  record FAIL "offload-demo --config tiny: exit $rc (log: $WORK/demo.log)"
fi

start=$(date +%s)
run python -m pytest -q -p no:cacheprovider tests/ops --ignore=tests/ops/test_cann_coexistence.py >"$WORK/pytest.log" 2>&1
rc=$?
summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error)" "$WORK/pytest.log" | tail -1 | sed -e 's/^=* *//' -e 's/ *=*$//')
if [ $rc -eq 0 ]; then
  record PASS "pytest tests/ops (installed package): ${summary} [$(( $(date +%s) - start )) s]"
else
  record FAIL "pytest tests/ops: ${summary:-no summary} [exit $rc, log: $WORK/pytest.log]"
fi

# 5. nothing was JIT-built
left=$(ls -A "$WORK/torch_extensions")
if [ -z "$left" ]; then
  record PASS "TORCH_EXTENSIONS_DIR still empty: no JIT build happened"
else
  record FAIL "TORCH_EXTENSIONS_DIR not empty: $left"
fi
finish

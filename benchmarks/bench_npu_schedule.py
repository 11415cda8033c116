"""The NPU-schedule structural checks of ``tests/lowering/test_npu_schedule.py`` on the *whole*
``glm-5.2-78l`` preset (78 layers, 21 IndexShare groups) instead of its first 10 layers.

Same assertions (installs wait on their serve's event, joins, records identity, no full-cache / pool /
selection copies, in-place KV writes) in both NPU modes, through TorchAir's / npugraph_ex's real
Python pipelines up to the GE graph / ACL capture (CANN-linked modules replaced by the labelled test
doubles). Too slow for the suite on 2 shared cores; run it once per change of the NPU modes::

    python benchmarks/bench_npu_schedule.py            # prints the pytest summary and the wall time
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    env = {**os.environ, "OFFLOAD_PASSES_SCHEDULE_LAYERS": "78", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "tests" / "converters" / "test_npu_schedule.py"), "-k", "78l"],
                         cwd=ROOT, env=env)
    print(f"glm-5.2-78l, 78 layers, both NPU modes: {time.perf_counter() - t0:.0f} s, exit {out.returncode}")
    return out.returncode


if __name__ == "__main__":
    sys.exit(main())

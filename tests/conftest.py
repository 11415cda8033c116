"""Shared pytest configuration. Sub-folders keep their own fixtures in their own conftest.py."""
import os

# Never let an installed torch_npu autoload into a CPU test run (spec/torchair.md §6).
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import offload_passes  # noqa: E402,F401  (registers the ops)

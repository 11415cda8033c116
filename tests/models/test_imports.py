"""models/ is the "unmodified" input: importing and running it must not load any pass machinery (the ops,
the torch-version compatibility and extension-naming modules they use, and the one list of exe_modes,
offload_passes/modes.py, which imports nothing, are not passes)."""
import subprocess
import sys


def test_models_do_not_import_the_passes():
    code = (
        "import sys, torch\n"
        "from offload_passes import models\n"
        "b = models.build('tiny', enable_offload=True, decode_steps=1)\n"
        "b.driver.run()\n"
        "bad = sorted(m for m in sys.modules if m.startswith('offload_passes.') and not "
        "m.startswith(('offload_passes.models', 'offload_passes.custom_ops', 'offload_passes._compat', 'offload_passes._extensions', 'offload_passes.modes')))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"

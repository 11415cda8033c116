"""Compiles recorded Triton launches ahead of time for a GPU target; run as a script, without a GPU.

    python tests/cuda/_compile_kernels.py launches.json results.json [--arch 90]

``launches.json``: a list of ``{"module", "kernel", "signature", "constexprs", "options"}`` (written by
``tests/cuda/test_cuda_compile.py``, which records them under the interpreter). Each one is compiled by
Triton's own compiler (``triton.compile`` of an ``ASTSource``) for ``GPUTarget("cuda", arch, 32)``, down
to a cubin (Triton's bundled ``ptxas``); no CUDA driver is touched. A separate process because the
kernels must be imported with ``TRITON_INTERPRET`` unset (``triton.jit`` decides at import time).
Results: per launch ``{"ok", "cubin_bytes", "shared", "fma", "regs", "spill_stores", "spill_loads", "stack",
"error"}``: shared memory (bytes, Triton's metadata); floating-point fused multiply-adds in the PTX; registers per thread
and spill / stack bytes from ``ptxas -v``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile


def resource_usage(ptx: str, arch: int) -> dict:
    """``{"regs", "spill_stores", "spill_loads", "stack"}`` (per thread; bytes) of the one kernel in ``ptx``,
    from ``ptxas -v`` run exactly as Triton runs it (its own ptxas for this arch, its arch name)."""
    from triton.backends.nvidia import compiler as nv
    try:
        ptxas = nv.get_ptxas(arch).path   # triton >= 3.5
    except TypeError:
        ptxas = nv.get_ptxas().path       # triton 3.4
    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "k.ptx"), os.path.join(d, "k.o")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-v", f"--gpu-name={nv.sm_arch_from_capability(arch)}", src, "-o", out],
                             capture_output=True, text=True, check=True).stderr
    num = lambda pat: int(re.search(pat, log).group(1))  # noqa: E731
    return {"regs": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "stack": num(r"(\d+) bytes stack frame")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("launches")
    ap.add_argument("results")
    ap.add_argument("--arch", type=int, default=90)
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("_compile_kernels: TRITON_INTERPRET must be unset", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", a.arch, 32)
    out = []
    for rec in json.load(open(a.launches)):
        kern = getattr(importlib.import_module(rec["module"]), rec["kernel"])
        res = {"ok": False}
        try:
            # the JIT's divisibility-by-16 specialisation of the launch (pointers and integers), so that
            # registers, spills and vector widths are those of the kernel that runs
            attrs = {(i,): [["tt.divisibility", 16]] for i in rec.get("divisible_by_16", [])}
            src = ASTSource(fn=kern, signature=rec["signature"], constexprs=rec["constexprs"], attrs=attrs)
            c = triton.compile(src, target=target, options=rec["options"])
            md = c.metadata
            res = {"ok": bool(c.asm.get("cubin")), "cubin_bytes": len(c.asm.get("cubin", b"")),
                   "shared": int(getattr(md, "shared", 0)), "fma": len(re.findall(r"\bfma\.[\w.]*f(?:32|64)\b", c.asm["ptx"])),
                   **resource_usage(c.asm["ptx"], a.arch)}
        except Exception as e:  # reported per launch; the test names the kernel and the error
            res["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        out.append(res)
    json.dump(out, open(a.results, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the benchmarks share: timing (CPU and CUDA), result rows and their Markdown table, device data, and the
section processes of the GPU benchmark (``gpu_check.py``: each section in a process of its own under a
wall-clock limit, so a fatal CUDA error or a hang ends that section only).

Imported by name from the scripts beside it (``python benchmarks/<script>.py`` puts this folder first on
``sys.path``) and from the tests (``tests/cuda/_device.py`` adds the folder).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence

import torch

NO_GPU = "no GPU"
COLUMNS = ("section", "check", "value", "goal", "host_us", "note")


# ------------------------------------------------------------------------------------ CPU timing

def timeit(fns: Dict[str, Callable[[], object]], repeat: int) -> Dict[str, float]:
    """Min wall time per function over ``repeat`` interleaved rounds, each timed call right after an untimed
    call of the same function (the same warm caches for every function); every other round runs the
    functions in reverse order (none always follows the same neighbour)."""
    best = {k: float("inf") for k in fns}
    for i in range(repeat):
        for k, f in (fns.items() if i % 2 == 0 else reversed(fns.items())):
            f()
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


# ------------------------------------------------------------------------------------ rows and the table

def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    """``num / den``, None when either is missing or ``den`` is 0."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def gbps(nbytes: int, seconds: Optional[float]) -> Optional[float]:
    return None if not seconds else nbytes / seconds / 1e9


def cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A Markdown table of ``rows`` (missing values ``-``, floats to 3 significant digits)."""
    head = "| " + " | ".join(columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def row(section: str, check: str, value: Any = None, goal: Any = None, note: str = "", ok: Optional[bool] = None,
        **extra: Any) -> dict:
    """One line of the table. ``ok``: False fails the run (a section's error), None for a figure."""
    return {"section": section, "check": check, "value": value, "goal": goal, "note": note, "ok": ok, **extra}


class Timing(NamedTuple):
    """One call's time: on the device (``how``: "graph replay" or "queued launches") and on the host (the
    Python wrapper and the launch: the launch overhead)."""

    device_s: Optional[float]
    host_s: Optional[float]
    how: str


def timing_row(section: str, check: str, t: Optional[Timing], ref: Optional[Timing] = None,
               goal: Optional[float] = None, nbytes: Optional[int] = None, dry: bool = False, note: str = "") -> dict:
    """A timing line: with a ceiling ``ref`` the value is ``ref / t`` (the fraction of the ceiling reached), else
    device ms per call; ``host_us`` is the host's time per call."""
    if dry or t is None:
        return row(section, check, NO_GPU, goal, NO_GPU, host_us=NO_GPU)
    if ref is not None:
        value = ratio(ref.device_s, t.device_s)
        if nbytes:
            rate = f"{cell(gbps(nbytes, t.device_s))} GB/s vs {cell(gbps(nbytes, ref.device_s))} GB/s"
            note = f"{note}; {rate}" if note else rate
    else:
        value = None if t.device_s is None else t.device_s * 1e3
        note = f"{note}; ms on the device" if note else "ms on the device"
    note = f"{note} ({t.how})"
    return row(section, check, value, goal, note, host_us=None if t.host_s is None else t.host_s * 1e6)


def summary_rows(results: dict, sections: Sequence[str]) -> list:
    """Every section's rows in ``sections`` order (a section that failed: one row with its error)."""
    rows = []
    for name in sections:
        part = results.get(name)
        if isinstance(part, dict) and "error" in part:
            rows.append(row(name, f"section {name}", None, None, part["error"], ok=False))
        elif isinstance(part, list):
            rows.extend(part)
    return rows


def failed(rows: Sequence[dict]) -> list:
    """The rows whose verdict is False."""
    return [r for r in rows if r.get("ok") is False]


def err(e: BaseException) -> str:
    """An exception in one line: its type and the first line of its message (200 characters at most)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def guarded(section: str, checks: Sequence[str], fn: Callable[[], list]) -> list:
    """``fn()``'s rows, or one failed row per name in ``checks`` with the exception (one group's failure must not
    hide the others)."""
    try:
        return fn()
    except Exception as e:
        traceback.print_exc()
        return [row(section, c, None, None, err(e), ok=False) for c in checks]


# ------------------------------------------------------------------------------------ device data and timing

def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def gen(dev: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=dev).manual_seed(seed)


def randn(shape: Sequence[int], dev: torch.device, g: torch.Generator, dtype: torch.dtype = torch.bfloat16
          ) -> torch.Tensor:
    """Normal data generated on ``dev`` (the device's generator: no single-threaded host fill)."""
    return torch.randn(tuple(shape), generator=g, device=dev, dtype=torch.float32).to(dtype)


def pinned_empty(shape: Sequence[int], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """Host memory for a full cache: pinned in place (exact size) when ``dev`` is a CUDA device."""
    t = torch.empty(tuple(shape), dtype=dtype)
    if dev.type == "cuda":
        from offload_passes.cuda import host_pinned

        t = host_pinned(t)
    return t


def fill_from_device(dst: torch.Tensor, dev: torch.device, g: torch.Generator, chunk_bytes: int = 1 << 30) -> None:
    """Random rows into ``dst`` (host or device), generated on ``dev`` in chunks along dim 0."""
    per = max(1, chunk_bytes // max(1, dst[0].numel() * dst.element_size()))
    for i in range(0, dst.size(0), per):
        part = dst[i:i + per]
        part.copy_(randn(part.shape, dev, g, dst.dtype))


def time_cuda(fn: Callable[[], Any], reps: int = 20, warmup: int = 3) -> Timing:
    """``fn``'s time per call: on the device from a CUDA graph of ``reps`` calls replayed (CUDA events), or, when
    ``fn`` cannot be captured, from ``reps`` launches queued while the device sleeps (so they run back to back);
    on the host from ``reps`` eager calls without synchronisation (the launch overhead)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # torch's recipe: one call on the capture stream before capturing
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        return Timing(a.elapsed_time(b) / 1e3 / reps, host, "graph replay")
    except Exception as e:  # not capturable: queue the launches behind a sleep long enough to cover them
        print(f"capture refused ({err(e)}); timing queued launches", file=sys.stderr)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(max(host * reps * 1.5, 1e-3) * 2e9))  # ~2 GHz: the host queues while it sleeps
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        return Timing(a.elapsed_time(b) / 1e3 / reps, host, "queued launches")


# ------------------------------------------------------------------------------------ section processes

class Section(NamedTuple):
    """One timing section of a GPU benchmark: its wall-clock limit (its own process: start, imports, Triton's
    compiles of what it launches, its work), the estimate it was sized by (seconds on an H200, by arithmetic
    from the work listed in ``why``: not measured) and its CPU limit under ``--dry-run``."""

    name: str
    limit_s: int
    estimate_s: int
    dry_limit_s: int
    why: str


def _tail(text: str) -> str:
    lines = [x for x in (text or "").strip().splitlines() if x.strip()]
    return lines[-1][:200] if lines else ""


def run_section(argv: Sequence[str], name: str, limit_s: float, env: Optional[dict] = None) -> tuple:
    """``python argv... --out FILE`` (one section) in a process of its own under a wall-clock limit:
    ``(rows, error, seconds, info)``. A crash (a fatal CUDA error, a signal) or the limit ends that process only;
    the process writes ``{"rows"}`` or ``{"error"}`` (and ``device`` / ``torch`` / ``triton``) into FILE."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{name}.json")
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, *argv, "--out", out], env=env, timeout=limit_s,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except subprocess.TimeoutExpired as e:
            text = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            sys.stderr.write(text[-20000:])
            return None, f"TimeoutError: section {name} passed its limit of {limit_s:.0f} s", \
                time.perf_counter() - t0, {}
        secs = time.perf_counter() - t0
        sys.stderr.write(p.stderr[-20000:])
        if not os.path.exists(out):
            return None, f"the section's process exited with {p.returncode}: {_tail(p.stderr)}", secs, {}
        with open(out) as f:
            data = json.load(f)
        info = {k: data[k] for k in ("device", "torch", "triton") if k in data}
        if "error" in data:
            return None, data["error"], secs, info
        return data["rows"], None, secs, info


def write_section(out: str, device: str, body: Callable[[], list]) -> int:
    """The body of a section's process: ``body()``'s rows (or its error) into ``out`` as JSON."""
    import importlib.metadata

    data: dict = {"device": device, "torch": torch.__version__, "triton": importlib.metadata.version("triton")}
    try:
        data["rows"] = body()
    except Exception as e:
        traceback.print_exc()
        data["error"] = err(e)
    with open(out, "w") as f:
        json.dump(data, f, default=str)
    return 0

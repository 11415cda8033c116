"""What the demos share (``demo.py``, ``hf.py``, ``world.py``, ``serve.py``): the ``--json`` schema, the
difference measures and their tolerances, the op counts and ``--threads``. Below every demo module, so
that none imports another for these."""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import torch

from .._cli import UsageError

ATTN_TOL = 2e-2
LOGITS_TOL = 5e-2
#: ``--threads`` above the machine's CPUs only oversubscribes, and torch's thread pool segfaults on huge
#: counts (100000 did): the limit is ``os.cpu_count()``.
MAX_THREADS = os.cpu_count() or 1

#: The one ``--json`` schema of both front-ends (``demo.run`` and ``hf.run_hf`` build it with ``result``).
RESULT_KEYS = (
    "model", "config", "mode", "steps", "B", "S", "K", "T", "prefill", "attn_implementation", "dtype",
    "pool_size", "rewritten", "sparse_layers", "groups", "offload", "ops", "replacement_policy",
    "hits", "misses", "window", "hit_rate", "host_rows_read", "unmodified_host_rows_read", "baseline_host_rows_read",
    "host_rows_saved",
    "reference", "max_abs_diff", "max_rel_diff", "tolerance", "within_tolerance",
    "refusals", "offload_refusals", "dense_masks_left",
    "compile_s", "pass_s", "timings", "state_bytes", "run_s", "trace",
)
#: Deprecated keys -> the key whose value each repeats (removed in the next release; docs/glossary.md,
#: "Renamed"). ``result`` fills them: a front-end passes only the canonical key.
KEY_ALIASES = {"baseline_host_rows_read": "unmodified_host_rows_read"}
#: The outputs each difference measure is reported for (``None`` where the front-end has no such output).
DIFF_OUTPUTS = ("logits", "attn")
#: The difference measures; ``tolerance`` is keyed the same way.
DIFF_MEASURES = ("max_abs_diff", "max_rel_diff")


def result(**fields: Any) -> dict:
    """A ``--json`` object: every key of ``RESULT_KEYS`` in that order, ``None`` where not given."""
    unknown = sorted(set(fields) - (set(RESULT_KEYS) - set(KEY_ALIASES)))
    if unknown:  # a front-end adding a key of its own would split the schema again
        raise TypeError(f"demo result: keys {unknown} are not in RESULT_KEYS (or are aliases: {sorted(KEY_ALIASES)})")
    return {k: fields.get(KEY_ALIASES.get(k, k)) for k in RESULT_KEYS}


def per_output(**values: Optional[float]) -> dict:
    """``{"logits": ..., "attn": ...}`` (the outputs not given are ``None``)."""
    return {k: values.get(k) for k in DIFF_OUTPUTS}


def max_diffs(refs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> tuple[float, float]:
    """``(max |out - ref|, max over pairs of |out - ref| / max |ref|)``; a zero reference counts the
    absolute difference (0 when both are 0)."""
    d_abs = d_rel = 0.0
    for r, o in zip(refs, outs, strict=True):
        d = float((o.float() - r.float()).abs().max())
        scale = float(r.float().abs().max())
        d_abs = max(d_abs, d)
        d_rel = max(d_rel, d / scale if scale > 0 else d)
    return d_abs, d_rel


def op_counts(rep: dict, replacement_policy: str) -> dict:
    """dsa_plan / dsa_serve / dsa_install (+ dsa_install_sc under second chance) in the final graph."""
    ops_after = rep.get("ops", {}).get("after", {})
    return {k: ops_after.get(k, 0) for k in ("dsa_plan", "dsa_serve", "dsa_install")
            + (("dsa_install_sc",) if replacement_policy != "fifo" else ())}


def check_threads(threads: int) -> int:
    """``threads`` if in ``[0, MAX_THREADS]``; ``UsageError`` naming the limit otherwise."""
    if not 0 <= threads <= MAX_THREADS:
        raise UsageError(f"--threads must be in [0, {MAX_THREADS}] (0 = torch default; at most os.cpu_count() "
                         f"= {MAX_THREADS}), got {threads}")
    return threads


def set_threads(threads: int) -> None:
    """``torch.set_num_threads`` for ``threads`` in ``[1, MAX_THREADS]``; 0 keeps torch's default."""
    if check_threads(threads) > 0:
        torch.set_num_threads(threads)

"""Trace science for the shared-indexer KV-offload pool (docs/trace-science.md).

* :mod:`.format`  — the ``offload_passes.trace`` npz format (:class:`Trace`, :func:`save_trace`, :func:`load_trace`);
* :mod:`.record`  — recorders: compiled runs (``OffloadState.record_trace()``, ``offload-demo --record-trace``)
  and the unmodified model with top-P ranks (``python -m offload_passes.trace.record``);
* :mod:`.sim`     — replacement-policy simulator (C++ core), ``offload-sim`` in :mod:`.cli`;
* :mod:`.synth`   — synthetic traces with interpretable locality and their calibration;
* :mod:`.kernel_replay` — the same trace through the real ``dsa_plan`` / ``dsa_install`` kernels;
* :mod:`.setsim`  — an independent NumPy simulator of the set-associative policies and the per-set MIN bound;
* :mod:`.models`  — an ensemble of structurally different trace models fitted to the reference's numbers;
* :mod:`.study`   — the ensemble tables of ``docs/trace-science.md`` (``python -m offload_passes.trace.study``).

Nothing here is imported by the backend or the passes; importing it never compiles.
"""
from .format import Trace, load_trace, save_trace  # noqa: F401
from . import record  # noqa: F401,E402  (registers the recorder behind OffloadState.record_trace)

__all__ = ["Trace", "load_trace", "save_trace"]

"""offload_passes: a torch.compile backend that rewrites GLM-5.2 DSA decode graphs into the
shared-indexer KV-offload scheme (one ``dsa_plan`` per IndexShare group, a ``dsa_serve`` per layer,
deferred ``dsa_install``\\ s).

Importing the package registers every op (``torch.ops.custom.*``, ``torch.ops.offload_ref.*``). The
backend API is loaded lazily so that model code importing ``offload_passes.models`` never pulls in
the passes.
"""
from __future__ import annotations

import logging
from typing import Any

from . import custom_ops  # noqa: F401  (registers the ops; loads CANN's custom_ops_lib first if found)
from .custom_ops import load_cann_ops  # noqa: F401  (explicit CANN op loading for unusual layouts)

logging.getLogger("offload_passes").addHandler(logging.NullHandler())


def _register_torch_logs() -> None:
    """Make ``TORCH_LOGS="offload_passes"`` (``+`` for debug) / ``torch._logging.set_logs`` work for our loggers."""
    import os

    from ._compat import torch_logs_registry

    _internal = torch_logs_registry()
    if _internal is None:  # pragma: no cover - torch without the logging registry
        return
    if "offload_passes" in _internal.log_registry.log_alias_to_log_qnames:
        return
    _internal.register_log("offload_passes", "offload_passes")
    if "offload_passes" in os.environ.get("TORCH_LOGS", ""):
        _internal._init_logs()  # TORCH_LOGS was parsed at torch import, before we registered


_register_torch_logs()

__version__ = "0.1.0"

_LAZY = {
    "offload_backend": "offload_passes.backend",
    "make_offload_backend": "offload_passes.backend",
    "offload": "offload_passes.decorator",
    "OffloadOptions": "offload_passes.options",
}

__all__ = list(_LAZY) + ["__version__", "load_cann_ops"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'offload_passes' has no attribute {name!r}")

"""TorchAir / npugraph_ex integration of the DSA offload ops (NPU modes ``ge_graph`` / ``npugraph_ex``).

Importing this package needs neither TorchAir nor torch_npu; :func:`register_all` imports them lazily:

* GE converters for the seven ``custom::`` ops (+ the ``offload_ref::`` attention references),
  :mod:`.ge_converters`;
* the ``DsaServe`` / ``DsaInstall`` ref pairs in GE's ref-output analysis, :mod:`.ge_ref_patch`;
* reinplace pairs in npugraph_ex's and TorchAir-ACL's ``inplaceable_npu_ops``, :mod:`.npu_reinplace_registry`;
* the GE converter of the KV-cache write op ``offload_ge::scatter_nd_update``, :mod:`.ge_cache_write`.

The FX passes the NPU modes run before these lowerings live in :mod:`offload_passes.passes`.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Dict, List

log = logging.getLogger("offload_passes.converters")

# The per-op facts the registrations below derive from are the op specs (custom_ops.OP_SPECS).
__all__ = ["register_all", "register_ge", "register_npugraph_ex", "torchair_available",
           "npugraph_ex_available"]


def torchair_available() -> bool:
    """True if ``import torchair`` can succeed (installed with torch_npu, or put on ``sys.path``)."""
    return importlib.util.find_spec("torchair") is not None


def npugraph_ex_available() -> bool:
    return importlib.util.find_spec("npugraph_ex") is not None


def _require(name: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError as e:
        raise RuntimeError(
            f"offload_passes.converters needs {name!r} (shipped inside torch_npu; on a CPU machine use "
            f"`python -m offload_passes.tools.torchair_env` for the test copy): {e}"
        ) from e


def register_ge() -> List[str]:
    """GE converters, DSA ref pairs and DSA copy elimination (``ge_graph`` mode). Idempotent."""
    import offload_passes  # noqa: F401  (op schemas must exist before converters attach to them)

    _require("torchair")
    from .ge_cache_write import register_ge_converter as register_cache_write
    from .ge_converters import register_ge_converters
    from .ge_ref_patch import patch_copy_pass, patch_ref_idx

    names = register_ge_converters()
    register_cache_write()
    names.append("offload_ge::scatter_nd_update")
    patch_ref_idx()
    patch_copy_pass()
    return names


def register_npugraph_ex() -> Dict[str, List[str]]:
    """Reinplace pairs in both ``inplaceable_npu_ops`` registries that can be imported. Idempotent."""
    import offload_passes  # noqa: F401  (the ops must exist)

    from .npu_reinplace_registry import register_reinplace, registry_modules

    return register_reinplace(registry_modules())


def register_all(*, ge: bool = True, npugraph_ex: bool = True) -> Dict[str, object]:
    """Register everything this package provides. Raises ``RuntimeError`` when TorchAir is missing."""
    out: Dict[str, object] = {}
    if ge:
        out["ge_converters"] = register_ge()
    if npugraph_ex:
        out["reinplace"] = register_npugraph_ex()
    return out

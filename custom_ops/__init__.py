"""CANN-compatible DSA KV-offload ops (namespace ``custom``) with CPU kernels.

Importing this package registers, for each op: the schema (unless CANN's extension already defined
it), a fake kernel, a CPU kernel (C++ built on first use, or the pure-torch reference), and for the
in-place ops a Functionalize kernel that maps them onto their ``*_functional`` twins.

One op, one module: ``dsa_plan.py``, ``dsa_serve.py``, ``dsa_install.py``,
``npu_gather_selection_kv_cache.py`` (``custom::`` namespace) and the decode-path references
``npu_lightning_indexer.py``, ``npu_sparse_flash_attention.py`` (``offload_ref::`` namespace, so they
never clash with torch_npu's ``npu::`` ops). C++ sources are ``csrc/<op>.cpp``. Shared helpers:
``_library.py`` (registration, checks, CPU-kernel plumbing), ``_records.py`` (install-records layout),
``_pool.py`` (pool geometry checks of plan/install), ``_attention_common.py`` (``offload_ref``
registration and the query/kv-layout checks of the two decode-path references).
"""
from . import _library  # noqa: F401
from . import dsa_plan, dsa_serve, dsa_install, npu_gather_selection_kv_cache  # noqa: F401
from . import npu_lightning_indexer, npu_sparse_flash_attention  # noqa: F401

#: The seven ``custom::`` ops whose schemas must match CANN's strings exactly.
CUSTOM_OPS = (
    "dsa_plan",
    "dsa_serve",
    "dsa_serve_functional",
    "dsa_install",
    "dsa_install_functional",
    "npu_gather_selection_kv_cache",
    "npu_gather_selection_kv_cache_functional",
)

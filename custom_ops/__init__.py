"""CANN-compatible DSA KV-offload ops (namespace ``custom``) with CPU kernels.

Importing this package registers, for each op: the schema (unless CANN's extension already defined
it), a fake kernel, a CPU kernel (C++ built on first use, or the pure-torch reference), and for the
in-place ops a Functionalize kernel that maps them onto their ``*_functional`` twins.

One op, one module: ``dsa_plan.py``, ``dsa_serve.py``, ``dsa_install.py``,
``npu_gather_selection_kv_cache.py`` (``custom::`` namespace) and the decode-path references
``npu_lightning_indexer.py``, ``npu_quant_lightning_indexer.py``, ``npu_sparse_flash_attention.py``
(``offload_ref::`` namespace, so they never clash with torch_npu's ``npu::`` ops). C++ sources are
``csrc/<op>.cpp``. Each op module declares ``SPEC`` (:class:`~.opspec.OpSpec`: schema, twin, GE
mapping, limits) near its top and registers from it; :data:`OP_SPECS` lists every op we define and
:func:`spec_for` finds one. Shared helpers:
``_library.py`` (registration, checks, CPU-kernel plumbing), ``_records.py`` (install-records layout),
``_pool.py`` (pool geometry checks of plan/install), ``_attention_common.py`` (``offload_ref``
registration and the query/kv-layout checks of the two decode-path references), ``_cann.py``
(coexistence with CANN's ``custom_ops_lib*.so`` in either load order: :func:`load_cann_ops`,
:func:`cann_library_status`, ``$OFFLOAD_PASSES_CANN_OPS_LIB``).
"""
from . import _library  # noqa: F401
from . import _cann

# CANN's own library (if installed / configured) must be loaded before we define any schema: its
# TORCH_LIBRARY(custom, m) aborts the process when a schema already exists (see _cann.py).
_cann.autoload()

from . import dsa_plan, dsa_serve, dsa_install, npu_gather_selection_kv_cache  # noqa: F401,E402
from . import npu_lightning_indexer, npu_sparse_flash_attention  # noqa: F401,E402

_cann.register_npu_guards()
_cann.install_hooks()

from ._cann import CannLibraryStatus, cann_library_status, find_cann_library, load_cann_ops  # noqa: E402,F401
from . import npu_quant_lightning_indexer  # noqa: F401
from . import dsa_install_sc  # noqa: F401,E402  (opt-in second-chance pool policy, offload_ref::)
from . import cache_write  # noqa: F401,E402  (in-place cache writes of the reference graph, offload_ref:: test doubles)
from . import static_cache_write  # noqa: F401,E402  (a transformers StaticCache layer's write: the HF host-KV cache)
from . import moe_distribute  # noqa: F401,E402  (MC2 MoE dispatch / combine references, offload_ref::)

from .opspec import OpSpec, find_spec  # noqa: E402

#: Every op we define, in any namespace (each twin is described by its in-place op's spec).
OP_SPECS: tuple[OpSpec, ...] = (
    dsa_plan.SPEC,
    dsa_serve.SPEC,
    dsa_install.SPEC,
    npu_gather_selection_kv_cache.SPEC,
    npu_lightning_indexer.SPEC,
    npu_quant_lightning_indexer.SPEC,
    npu_sparse_flash_attention.SPEC,
    dsa_install_sc.SPEC,
    *cache_write.SPECS,
    static_cache_write.SPEC,
    *moe_distribute.SPECS,
)

from .cuda import autoregister as _cuda_autoregister  # noqa: E402  (Triton kernels; CUDA + triton only)

_cuda_autoregister(OP_SPECS)

#: The seven ``custom::`` ops whose schemas must match CANN's strings exactly.
CUSTOM_OPS: tuple[str, ...] = tuple(n for s in OP_SPECS if s.namespace == _library.NAMESPACE for n in s.op_names)


def spec_for(name: str) -> OpSpec:
    """The spec of op ``name``: in-place, functional or qualified (``custom::dsa_serve``) name.

    Raises ``KeyError`` naming the argument and the known ops otherwise.
    """
    return find_spec(OP_SPECS, name)

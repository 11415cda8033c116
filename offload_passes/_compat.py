"""The one place where offload_passes uses private torch / TorchAir / npugraph_ex symbols and handles
differences between torch versions (torch 2.8 through 2.15, ``setup.py``; what differs per version and
where it is handled: docs/versions.md).

Every function below says why no public API does the job and the versions it was checked against
("2.8-2.15": the versions ``scripts/test_matrix.sh`` runs). TorchAir and npugraph_ex are optional (NPU
modes, converter tests): their symbols are imported inside functions, on first use.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, Optional

import torch

#: ``(major, minor)`` of the running torch.
TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

# ---------------------------------------------------------------------------------------- torch
# FX call targets of ATen / custom ops; torch exposes the classes only in torch._ops (2.8-2.15).
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket  # noqa: E402


def dispatcher_has_schema(qualname: str) -> bool:
    """``ns::name[.overload]`` is known to the dispatcher (ours, CANN's or torch_npu's). torch.library
    has no query; ``hasattr(torch.ops.ns, name)`` would also accept Python-only packets (2.8-2.15)."""
    try:
        torch._C._dispatch_find_schema_or_throw(qualname, "")
        return True
    except RuntimeError:
        return False


def dispatcher_schema(qualname: str) -> str | None:
    """The schema string the dispatcher holds for ``qualname`` (CANN's, when its library defined it
    first), or None (2.8-2.15)."""
    try:
        return str(torch._C._dispatch_find_schema_or_throw(qualname, "").schema())
    except RuntimeError:
        return None


def dispatcher_op_names(namespace: str) -> list[str]:
    """Sorted ``ns::name`` of every operator the dispatcher knows in ``namespace`` (overload names
    dropped); torch.library has no way to enumerate a namespace (2.8-2.15)."""
    prefix = f"{namespace}::"
    return sorted({n.split(".", 1)[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix)})


# Schema strings parsed without registering anything (custom_ops/opspec.py); torch.library parses
# with the same private parser and exposes none (2.8-2.15).
FunctionSchema = torch._C.FunctionSchema
SchemaArgument = torch._C.Argument
parse_schema = torch._C.parse_schema


def resolve_library_path(path: str) -> str:
    """The path ``torch.ops.load_library`` will actually load (same resolution rules) (2.8-2.15)."""
    return torch._utils_internal.resolve_library_path(path)


def has_storage(t: Any) -> bool:
    """A tensor with real storage (not a fake / meta / functional wrapper); no public query (2.8-2.15)."""
    return torch._C._has_storage(t)


def foreach_copy_(dst: list, src: list) -> None:
    """``dst[i].copy_(src[i])`` for all i in one call (``torch._foreach_copy_``, private in 2.8-2.15)."""
    torch._foreach_copy_(dst, src)


def is_fake(t: Any) -> bool:
    """A FakeTensor (``torch._subclasses.fake_tensor.is_fake``, private in 2.8-2.15)."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return bool(fake(t))


def library_impl_override(lib: Any, op: str, fn: Any, dispatch_key: str) -> None:
    """``lib.impl`` that replaces a kernel another Python library registered for ``op`` at ``dispatch_key``
    (a test putting another implementation behind an op). torch 2.11 refuses that ("already a kernel
    registered from python") unless ``allow_override=True``; 2.13 replaces it with a warning."""
    if "allow_override" in inspect.signature(lib.impl).parameters:
        lib.impl(op, fn, dispatch_key, allow_override=True)
    else:
        lib.impl(op, fn, dispatch_key)


def dispatcher_has_kernel(qualname: str, dispatch_key: str) -> bool:
    """A kernel for ``dispatch_key`` is registered (so we never replace CANN's / torch_npu's); no
    public query exists (2.8-2.15)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualname, dispatch_key)


def has_python_fake_kernel(qualname: str) -> bool:
    """A fake kernel registered with ``torch.library.register_fake`` exists (registering a second one
    raises); only torch._library's registry knows (2.8-2.15)."""
    try:
        from torch._library.simple_registry import singleton

        return singleton.find(qualname).fake_impl.kernel is not None
    except Exception:  # registry layout changed: treat as absent, register_fake then reports a clash
        return False


# Functionalize kernels for ops with CANN's fixed in-place schemas (torch.library.custom_op would
# auto-functionalize instead, but AOT must emit our *_functional twins): the C++ functionalization
# API as torch's own Python Functionalize kernels use it (2.8-2.15).
is_functional_tensor = torch._is_functional_tensor
from_functional_tensor = torch._from_functional_tensor
to_functional_tensor = torch._to_functional_tensor
functionalize_sync = torch._functionalize_sync
functionalize_replace = torch._functionalize_replace
functionalize_commit_update = torch._functionalize_commit_update


@contextlib.contextmanager
def functionalize_excluded() -> Iterator[None]:
    """Run the functional twin below the Functionalize key (2.8-2.15)."""
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
        yield


def aot_module_simplified() -> Any:
    """AOTAutograd entry point for a Dynamo backend (functionalization + our compiler on the
    functional graph); the public ``torch.compile`` offers no hook there (2.8-2.15)."""
    from torch._functorch.aot_autograd import aot_module_simplified as f

    return f


def make_boxed_func() -> Any:
    """Boxed-calling wrapper AOT expects from a compiler (2.8-2.15)."""
    from torch._functorch.aot_autograd import make_boxed_func as f

    return f


def inductor_compile_fx() -> Any:
    """Inductor's backend function, called with our post-grad pass in ``config_patches`` (2.8-2.15)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx


def inductor_lowers_assert_async() -> bool:
    """Whether Inductor turns ``aten._assert_async.msg`` into a run-time check (2.10-2.15). Torch 2.8 decomposes
    it to nothing, so our in-graph guards would vanish in ``inductor`` mode."""
    from torch._inductor.lowering import lowerings

    return torch.ops.aten._assert_async.msg in lowerings


def inductor_decompositions_keeping_asserts() -> dict:
    """Inductor's decomposition table without its no-op decomposition of ``aten._assert_async.msg``."""
    from torch._inductor.decomposition import select_decomp_table

    return {k: v for k, v in select_decomp_table().items() if k is not torch.ops.aten._assert_async.msg}


def custom_graph_pass_base() -> type:
    """Base class that makes a ``post_grad_custom_pre_pass`` cacheable (``uuid``) (2.8-2.15)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def constant_source(name: str) -> Any:
    """Dynamo source for a buffer the rewrite adds to the graph module (AOT maps every lifted
    parameter/buffer to a source via ``_param_name_to_source``) (2.8-2.15)."""
    from torch._dynamo.source import ConstantSource

    return ConstantSource(name)


def detect_fake_mode(inputs: Any) -> Any:
    """The FakeTensorMode of a compile's example inputs (None outside one); no public twin (2.8-2.15)."""
    from torch._guards import detect_fake_mode as f

    return f(inputs)


def mark_static_address(t: Any) -> None:
    """``torch._dynamo.mark_static_address``: ``t`` keeps one data pointer for its life, so Dynamo treats it
    as a static input (what ``transformers``' ``StaticLayer`` does with its caches; ``offload_passes/hf_cache.py``).
    Unguarded on every version (2.13's default): torch 2.8's default guards such a tensor by its identity, so
    a new cache of the same shapes recompiled the step instead of reusing its graph (2.8-2.15)."""
    torch._dynamo.mark_static_address(t, guard=False)


def static_fake(t: Any) -> Any:
    """A fake tensor with plain-int sizes and strides standing in for ``t`` when every symbol in them is
    already specialised (``pipeline._specialise``), else None. torch 2.8's meta of ``aten.view`` calls
    ``numel()`` on a fake whose sizes are SymInts even when they are constants by now, and raises
    "Cannot call numel() on tensor with symbolic sizes/strides"; 2.10 and later do not. ``SymNode.expr``
    applies the ShapeEnv's replacements; no public API reads a SymInt's specialised value without adding a
    guard (2.8-2.15)."""
    if not isinstance(t, torch.Tensor) or getattr(t, "fake_mode", None) is None:
        return None

    def plain(v: Any) -> Optional[int]:
        if not isinstance(v, torch.SymInt):
            return int(v)
        expr = v.node.expr
        return int(expr) if getattr(expr, "is_number", False) else None

    sizes = [plain(v) for v in t.shape]
    strides = [plain(v) for v in t.stride()]
    if None in sizes or None in strides:
        return None
    with t.fake_mode:
        return torch.empty_strided(sizes, strides, dtype=t.dtype, device=t.device)


def python_dispatcher() -> Any:
    """A context in which fake tensors take the Python meta kernels, as under Dynamo's tracing. torch 2.8's C++
    meta of ``aten.view`` / ``reshape`` calls ``numel()`` on a fake whose sizes are symbols (a cache length
    kept symbolic) and raises "Cannot call numel() on tensor with symbolic sizes/strides"; its Python
    meta (``torch._refs``) reads ``sym_numel``. 2.10 and later take the symbolic path either way."""
    from torch._dispatch.python import enable_python_dispatcher

    return enable_python_dispatcher()


def dynamo_traces_mask_indexing() -> bool:
    """Whether Dynamo traces boolean-mask indexing (``x[:, mask]``, an ``aten.nonzero``) into a full graph
    with its default settings. torch 2.8 raises ``Unsupported: Dynamic shape operator`` unless
    ``torch._dynamo.config.capture_dynamic_output_shape_ops`` is set; 2.10, 2.13 and 2.14 trace it.
    transformers' ``glm5_next`` pools its indexer keys that way (docs/hf.md)."""
    return TORCH_VERSION >= (2, 10)


def mask_indexing_traced() -> Any:
    """A context in which Dynamo traces boolean-mask indexing into a full graph: torch 2.8 needs
    ``capture_dynamic_output_shape_ops`` for it (:func:`dynamo_traces_mask_indexing`), later ones nothing."""
    if dynamo_traces_mask_indexing():
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)


def dynamo_traces_user_dict() -> bool:
    """Whether Dynamo inlines ``collections.UserDict`` (transformers' ``KVSharingDict``, which the decode
    step of ``mistral_large4`` and ``kolibri1_1`` builds). torch 2.8's trace rules skip the whole
    ``collections`` module ("Attempted to inline function marked as skipped ... ``UserDict.__init__``");
    2.13's inline it. Read from Dynamo's own trace rules (checked: 2.8 False, 2.13 True)."""
    import collections

    from torch._dynamo import trace_rules

    return not trace_rules.check(collections.UserDict.__init__, is_inlined_call=True)


def functional_collectives() -> Any:
    """``torch.distributed._functional_collectives``: the collectives Dynamo traces as ``_c10d_functional``
    ops (all_gather_tensor / reduce_scatter_tensor / all_to_all_single / wait_tensor); torch has no
    public module for them (2.8/2.13/2.14). Used by the multi-rank model (models/glm/parallel.py)."""
    import torch.distributed._functional_collectives as funcol

    return funcol


def hf_grouped_mm_traceable_on_cpu() -> bool:
    """Whether transformers' ``grouped_mm`` experts path traces under Dynamo on CPU. For torch <= 2.10
    transformers (5.23) checks ``data_ptr() % 16`` first, which Dynamo cannot trace (``Unsupported:
    builtin mod``), and torch 2.8 has no ``grouped_mm`` at all; checked on 2.8, 2.10 (False), 2.13, 2.14
    (True). ``models/hf`` picks ``batched_mm`` where it is False."""
    return TORCH_VERSION > (2, 10) and hasattr(torch.nn.functional, "grouped_mm")


def transformers_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed transformers (ImportError without the ``hf`` extra)."""
    import transformers

    return tuple(int(p) for p in transformers.__version__.split(".")[:2])


def hf_cache_kwarg() -> str:
    """The name of the cache argument of a transformers model's ``forward`` / ``generate`` and of the field of
    their outputs: ``past_key_values`` up to 5.23, ``cache`` from 5.24 (which still accepts the old name, with
    a deprecation warning, until 5.40). Checked on transformers 5.23.0 and 5.25.0; ``models/hf`` passes its
    ``StaticCache`` under this name, so the runner adds no deprecation noise on either."""
    return "cache" if transformers_version() >= (5, 24) else "past_key_values"


def torch_logs_registry() -> Any:
    """``torch._logging._internal``: registers ``TORCH_LOGS="offload_passes"``; torch has no public
    API to add a log alias (2.8-2.15). None when absent."""
    try:
        from torch._logging import _internal
    except ImportError:
        return None
    return _internal


# ----------------------------------------------------------------- TorchAir / npugraph_ex (lazy)
def torchair_ge_apis() -> Any:
    """``torchair._ge_concrete_graph.ge_apis``: the generated GE op builders (``ScatterNdUpdate`` ...);
    ``torchair.ge`` re-exports only ``TensorMove`` (as ``Clone``) and a few others (npu 2.8-2.14)."""
    from torchair._ge_concrete_graph import ge_apis

    return ge_apis


#: The python kernels TorchAir's ``_utils.register_matmul_backward_decomp`` adds (npu 2.8-2.14); npugraph_ex's
#: copy of that function adds the same three.
_TORCHAIR_MATMUL_PATCH_KERNELS = (("to", "other", "AutogradPrivateUse1"), ("type_as", "default", "AutogradPrivateUse1"),
                                  ("matmul_backward", "default", "CompositeImplicitAutograd"))


def torchair_ready_after_npugraph_ex() -> None:
    """Lets TorchAir's GE backend compile in a process where npugraph_ex compiled first.

    Both packages patch ATen once per process (``_utils.add_npu_patch``). npugraph_ex's copy skips its
    ``to.other`` / ``type_as`` / ``matmul_backward`` python kernels when they are present; TorchAir's
    registers them unconditionally, and its first compile after npugraph_ex's raises "Trying to override
    a python impl" (npu 2.8.0.post5-2.14). Before TorchAir's patch has run, drop those three kernels if
    npugraph_ex's patch registered them; TorchAir then registers its own, identical, decompositions.
    """
    try:
        from torchair import _utils as ta_utils
    except ImportError:
        return
    patch = getattr(ta_utils, "add_npu_patch", None)
    if patch is None or getattr(patch, "has_run", True):
        return
    try:
        from npugraph_ex import _utils as ex_utils
    except ImportError:
        return
    if not getattr(getattr(ex_utils, "add_npu_patch", None), "has_run", False):
        return
    for op, overload, key in _TORCHAIR_MATMUL_PATCH_KERNELS:
        getattr(getattr(torch.ops.aten, op), overload).py_kernels.pop(getattr(torch._C.DispatchKey, key), None)


def torchair_core_extension() -> Any:
    """``torchair.core._torchair``: TorchAir's CANN-linked module, whose ``get_registered_ir_def``
    tells whether CANN knows a GE op type (``tools/atlas_check.py``, Atlas only) (npu 2.8-2.14)."""
    from torchair.core import _torchair

    return _torchair


def torchair_ge_graph_pass() -> Any:
    """``torchair._ge_concrete_graph.graph_pass``: its ref-op table is taught DsaServe / DsaInstall
    (``converters/ge_ref_patch.py``); no registration API exists (npu 2.8-2.14)."""
    from torchair._ge_concrete_graph import graph_pass

    return graph_pass


def torchair_fx2ge_converter() -> Any:
    """``torchair._ge_concrete_graph.fx2ge_converter``: the copy pass patched by
    ``converters/ge_ref_patch.py``; converters themselves use the public
    ``torchair.register_fx_node_ge_converter`` (npu 2.8-2.14)."""
    from torchair._ge_concrete_graph import fx2ge_converter

    return fx2ge_converter


def npugraph_ex_tagged_event() -> Any:
    """``npugraph_ex.ops._tagged_event``: creates npugraph_ex's tagged events (its
    ``_npu_create_tagged_event`` / ``_GLOBAL_TAG_TO_EVENT``); the public ``npu_create_tagged_event``
    is TorchAir's, with its own registry (npu 2.8-2.14)."""
    import npugraph_ex.ops._tagged_event as tagged

    return tagged


def npugraph_ex_ops() -> Any:
    """The op namespace of npugraph_ex's stream / event ops (``tagged_event_*``, ``record_tagged_stream_``,
    ``scope_enter``): ``torch.ops.npugraph_ex`` in npu 2.10.0.post4-2.14, ``torch.ops.air`` in npu 2.8.0.post5."""
    npugraph_ex_tagged_event()  # registers them
    import npugraph_ex.scope  # noqa: F401

    ns = torch.ops.npugraph_ex
    return ns if hasattr(ns, "tagged_event_record") else torch.ops.air


#: npugraph_ex options whose place in ``npugraph_ex.CompilerConfig`` differs by version: flat attributes in
#: npu 2.10.0.post4-2.14; TorchAir-style nested ones in npu 2.8 (its ``_NpuGraphExConfig.OPTIONS_TO_CONFIG_MAP``).
_NPUGRAPH_EX_NESTED = {"force_eager": "debug.run_eagerly", "frozen_parameter": "experimental_config.frozen_parameter",
                       "pattern_fusion_pass": "experimental_config.pattern_fusion_pass"}


def set_npugraph_ex_option(cfg: Any, name: str, value: Any) -> None:
    """``cfg.<name> = value`` on an ``npugraph_ex.CompilerConfig`` of either layout (npu 2.8-2.14)."""
    if name not in _NPUGRAPH_EX_NESTED:
        raise ValueError(f"set_npugraph_ex_option: unknown option {name!r} (known: {sorted(_NPUGRAPH_EX_NESTED)})")
    flat = name in getattr(cfg, "__dict__", {})
    target, attr = cfg, name
    if not flat:
        *path, attr = _NPUGRAPH_EX_NESTED[name].split(".")
        for part in path:
            target = getattr(target, part)
    setattr(target, attr, value)


def get_npugraph_ex_option(cfg: Any, name: str) -> Any:
    """The option set by :func:`set_npugraph_ex_option` (the config's option object) (npu 2.8-2.14)."""
    if name in getattr(cfg, "__dict__", {}):
        return getattr(cfg, name)
    target = cfg
    for part in _NPUGRAPH_EX_NESTED[name].split("."):
        target = getattr(target, part)
    return target


#: Modules holding TorchAir's / npugraph_ex's reinplace registries (``converters/npu_reinplace_registry.py``
#: registers our in-place ops there; no public registration API) (npu 2.8-2.14).
REINPLACE_REGISTRY_MODULES = ("torchair._acl_concrete_graph.graph_pass", "npugraph_ex._acl_concrete_graph.graph_pass")


def _registry_package(registry_module: Any) -> str:
    return registry_module.__name__.rsplit("._acl_concrete_graph", 1)[0]


def reinplace_event_protection(registry_module: Any) -> Any:
    """The package's event-aware stream check ``_utils.graph_utils.verify_cross_stream_event_protected``
    (npugraph_ex in npu 2.10.0.post4, 2.13, 2.14), or None: npugraph_ex 2.8 and TorchAir 2.8-2.14 only have
    ``verify_nodes_on_same_stream``, and ``converters/stream_fence.py`` stands in (npu 2.8-2.14)."""
    import importlib

    try:
        utils = importlib.import_module(_registry_package(registry_module) + "._utils.graph_utils")
    except ImportError:
        return None
    return getattr(utils, "verify_cross_stream_event_protected", None)


def reinplace_mutated_input_users(registry_module: Any) -> Any:
    """``_acl_concrete_graph.utils.get_inplace_op_mutated_input_users`` of the registry's package: the
    users its own stream checker inspects, per mutated argument index (npu 2.8-2.14)."""
    import importlib

    utils = importlib.import_module(registry_module.__name__.rsplit(".", 1)[0] + ".utils")
    return utils.get_inplace_op_mutated_input_users


def dynamo_frame_compile() -> Optional[dict]:
    """Dynamo's compile id of the frame being compiled (``torch._guards.CompileContext``) and its recompile
    limit (``recompile_limit``; ``cache_size_limit`` before it was renamed); None outside a Dynamo compile."""
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
    except Exception:  # noqa: BLE001 - a torch without compile ids: nothing to report
        return None
    if cid is None or cid.frame_compile_id is None:
        return None
    cfg = torch._dynamo.config
    limit = getattr(cfg, "recompile_limit", None) or getattr(cfg, "cache_size_limit", None)
    return {"frame_id": cid.frame_id, "frame_compile_id": cid.frame_compile_id, "recompile_limit": limit,
            "last_allowed": limit is not None and cid.frame_compile_id + 1 >= limit}

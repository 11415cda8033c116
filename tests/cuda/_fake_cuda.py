"""Fake CUDA on a CPU-only torch (test doubles, labelled as such).

* ``FakeTensorMode`` creates fake ``cuda:0`` tensors without a device and checks devices exactly as a CUDA
  run's dispatch would (``Mismatching aten.index_put_.default device between self (cpu) and values
  (cuda:0)``), Dynamo traces them and AOT propagates them.
* A CPU-only torch has no CUDA *device guard*, which Python indexing of a CUDA tensor (``t[1:3]``,
  ``t[idx]``) and a few other paths ask for. :func:`install_fake_cuda_guard` registers c10's own
  ``FakeGuardImpl<CUDA>`` (device index bookkeeping only, no driver) from a three-line C++ test double
  built with ``torch.utils.cpp_extension.load_inline`` (cached by torch; about 20 s the first time).
  Never loaded where torch has CUDA (the real guard is there).
* The flow's own fake mode is the compile's: entered inside a Dynamo compile (the flow's backend runs in it,
  so the offload state's pools are made there), it stands in for the tracing context's fake mode until it
  exits. torch 2.8 and 2.10 assert that every fake mode in sight is the tracing context's
  (``torch._guards.detect_fake_mode``: "fake mode ... from tracing context 0 doesn't match mode ... from
  active fake mode 0"); 2.11+ take the tracing context's and ignore the rest. A real CUDA run has no outer
  fake mode.
* Fake tensors carry no values. The offload's compile-time *value* reads (the block tables' identity
  layout, ``passes/frontends/recipe.py`` ``is_identity_table``) are answered from the CPU twins of the same
  tables (:func:`values_from_twins`); nothing else reads values.

The model is built on the CPU with its seeded weights, then every parameter and buffer is replaced by a
fake tensor of the same shape, stride and dtype on the device a CUDA run places it
(:func:`fake_cuda_model`): the full latent / rope caches on the host (what ``offload_passes.cuda``
``place_full_caches`` pins), everything else on ``cuda:0``.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator

import torch
from torch._guards import TracingContext
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import ShapeEnv

_GUARD_SRC = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
namespace { C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>); }
"""
_loaded = False


def install_fake_cuda_guard() -> None:
    """Register the fake CUDA device guard once per process (no-op where torch has CUDA)."""
    global _loaded
    if _loaded or torch.cuda.is_available():
        return
    from torch.utils.cpp_extension import load_inline

    load_inline("offload_passes_test_fake_cuda_guard", cpp_sources=[_GUARD_SRC], is_python_module=False,
                extra_cflags=["-O0"])
    _loaded = True


def _fake_rules_for(mode_type: type) -> None:
    """A higher-order operator finds its rule by the exact type of the mode (``python_key_table``): give
    ``mode_type`` FakeTensorMode's rule for each operator that has one."""
    for op in torch._ops._higher_order_ops.values():
        rule = op.python_key_table.get(FakeTensorMode)
        if rule is not None and mode_type not in op.python_key_table:
            op.python_key_table[mode_type] = rule


class _FakeModeWithoutDevice(FakeTensorMode):
    """The flow's fake mode. Entered inside a Dynamo compile it is the compile's fake mode (module doc).
    torch 2.8's ``FakeTensorMode`` constant-folds a copy of a real host tensor to ``cuda`` by running
    the copy, which needs a driver; torch 2.10+ skips that fold when no device is available (its
    ``avoid_device_init``). Here the real tensor becomes a fake first, as 2.10+ does."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._swapped: list = []

    def __enter__(self):
        # inside a Dynamo compile (the flow's backend runs in this mode), this mode is the compile's fake mode
        ctx = TracingContext.try_get()
        swap = ctx is not None and ctx.fake_mode is not None and ctx.fake_mode is not self
        self._swapped.append((ctx, ctx.fake_mode) if swap else None)
        if swap:
            ctx.fake_mode = self
            _fake_rules_for(type(self))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            swapped = self._swapped.pop()
            if swapped is not None:
                swapped[0].fake_mode = swapped[1]

    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if (func is torch.ops.aten._to_copy.default and args and type(args[0]) is torch.Tensor
                and dev is not None and torch.device(dev).type != "cpu"):
            args = (self.from_tensor(args[0], static_shapes=True),) + tuple(args[1:])
        return super().dispatch(func, types, args, kwargs)


def sdpa_without_device() -> contextlib.AbstractContextManager:
    """SDPA's math kernel only. Choosing a fused kernel for a CUDA tensor reads the device's properties;
    torch 2.8's CUDA build asks the driver for them even for fake tensors. The placement does not depend
    on the kernel chosen."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def new_mode() -> FakeTensorMode:
    """A fake mode for a whole flow: real host tensors (the driver's token stream) may enter it; a shape
    environment so that data-dependent sizes stay symbolic."""
    return _FakeModeWithoutDevice(allow_non_fake_inputs=True, shape_env=ShapeEnv())


def fake_cuda_model(model: torch.nn.Module, mode: FakeTensorMode, host: set) -> Dict[int, torch.Tensor]:
    """Replace ``model``'s parameters and buffers by fake tensors: ``(module id, name)`` in ``host`` on the
    host, the rest on ``cuda:0``. Returns ``{id(fake): the CPU tensor it replaced}`` (the value twins)."""
    twins: Dict[int, torch.Tensor] = {}
    for sub in model.modules():
        for store, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for name, t in list(store.items()):
                if t is None:
                    continue
                dev = "cpu" if (id(sub), name) in host else "cuda"
                with mode:
                    f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=dev)
                if is_param:
                    f = torch.nn.Parameter(f, requires_grad=False)
                store[name] = f
                twins[id(f)] = t.detach()
    return twins


@contextlib.contextmanager
def values_from_twins(twins: Dict[int, torch.Tensor]) -> Iterator[None]:
    """Answer the offload's compile-time value reads from the CPU twins (fake tensors have no values)."""
    from offload_passes.passes.frontends import recipe

    orig_values, orig_ident = recipe.input_values, recipe.is_identity_table

    def input_values(gm, example_inputs):
        out = orig_values(gm, example_inputs)
        for n in out:  # Dynamo's graph argument of a placeholder holds the module's own tensor
            ga = n.meta.get("grapharg")
            twin = twins.get(id(getattr(ga, "example", None)))
            if twin is not None:
                out[n] = twin
        return out

    def is_identity_table(t, rows, cols):
        with unset_fake_temporarily():
            return orig_ident(t, rows, cols)

    recipe.input_values, recipe.is_identity_table = input_values, is_identity_table
    try:
        yield
    finally:
        recipe.input_values, recipe.is_identity_table = orig_values, orig_ident

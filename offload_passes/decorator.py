"""``@offload(...)``: compile a model class or instance with the ``dsa_offload`` backend.

* On an instance: ``offload(model, pool_size=...)`` / ``offload(pool_size=...)(model)`` returns an
  ``OffloadedModule`` wrapping ``torch.compile(model, backend=...)``.
* On a class: ``@offload(pool_size=...) class M(nn.Module)`` returns a subclass whose instances are
  compiled in place (``nn.Module.compile``) at construction.

Both expose ``offload_state`` (one ``OffloadState`` over every graph serving the module's caches, graph
breaks included; empty before the first call), ``offload_backend`` (the ``OffloadBackend``) and
``offload_reports``. A Hugging Face model's caches are not module buffers (they live in the ``StaticCache``
that ``generate()`` builds): its ``offload_state`` is then the state bound to the caches of the
backend's most recently run rewritten graph, i.e. of the last ``generate()`` call.

Hugging Face models (``generate()``): the class form compiles ``nn.Module.__call__``, which ``generate``
calls, so it offloads as it is. The instance form keeps ``generate``: ``offload(model).generate(...)``
runs the model's own ``generate`` with its ``forward`` compiled by the backend for the duration of the
call (``torch.compile(model).generate()`` compiles nothing: torch's wrapper hands ``generate`` to the
original module; see docs/hf.md).

``copy.deepcopy``, ``torch.save`` / ``torch.load(..., weights_only=False)`` and ``pickle`` keep the
module's parameters and buffers and its offload options; the copy (or loaded module) is compiled again
by a *new* backend with the same options, on its first call: its ``offload_reports`` start empty and list
only its own graphs, its ``offload_state`` covers only its own caches (a cold pool: the first steps
miss, never wrong). The original's graphs and pool are not shared with it (a compiled graph and its
backend are process state, not module state). ``state_dict()`` holds the wrapped module's tensors only.
"""
from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from .backend import OffloadBackend, make_offload_backend
from .hf_reorder import cache_tensors
from .state import OffloadState, module_state

#: Options ``make_offload_backend`` takes beside ``OffloadOptions`` (the NPU lowerings').
_NPU_KW = ("compiler_config", "npu_options", "side_stream")


def own_forward(model: nn.Module) -> Any:
    """``model.forward`` as a function with a code object of its own, to compile instead of
    ``model.forward``: Dynamo counts its ``recompile_limit`` per code object, and every transformers
    model's ``forward`` is one wrapper function (transformers/utils/generic.py), so models compiled through
    it share one budget and a third model may run unmodified. ``torch.compile(own_forward(model),
    backend=...)`` compiles the same code, counted for this model alone (``offload(model)`` does this)."""
    bound = model.forward
    f = getattr(bound, "__func__", None)
    if not isinstance(f, types.FunctionType):
        raise TypeError(f"own_forward: model.forward must be a method defined in Python, got {type(bound).__name__}")
    g = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    g.__kwdefaults__ = f.__kwdefaults__
    g.__dict__.update(f.__dict__)
    g.__qualname__, g.__doc__, g.__module__ = f.__qualname__, f.__doc__, f.__module__
    return types.MethodType(g, bound.__self__)


def _rebuild_options(backend: OffloadBackend, options: dict) -> dict:
    """What a copy's backend is built from: the resolved options (a recipe yaml path may be gone by the
    time a saved module is loaded) plus the NPU keywords given."""
    return {"config": backend.options, **{k: v for k, v in options.items() if k in _NPU_KW}}


class _ExposesOffload:
    """``offload_state`` / ``offload_reports`` of the object's ``offload_backend``."""

    offload_backend: OffloadBackend

    def _offload_target(self) -> nn.Module:
        return self

    @property
    def offload_state(self) -> OffloadState:
        """The state of every graph that serves this module (``reset(rows=...)`` covers them all); for a
        module whose caches are not its buffers (HF ``StaticCache``), the state of the last rewritten
        graph's caches."""
        st = module_state(self._offload_target())
        if not st.groups and self.offload_backend.reports:
            last = self.offload_backend.state
            if last is not None:
                return last
        return st

    @property
    def offload_reports(self) -> list:
        return self.offload_backend.reports


class OffloadedModule(_ExposesOffload, nn.Module):
    """A module compiled with the offload backend (the original stays reachable as ``.module``)."""

    def __init__(self, module: nn.Module, backend: OffloadBackend, options: dict | None = None):
        super().__init__()
        self.module = module
        self.offload_backend = backend
        self._offload_rebuild = _rebuild_options(backend, options or {})
        self._compiled = torch.compile(module, backend=backend)
        # generate() (HF GenerationMixin) calls the module's forward: compiled per call, see generate()
        # its own code object: its recompiles do not count against other models' (own_forward)
        self._compiled_forward = torch.compile(own_forward(module), backend=backend) if hasattr(module, "generate") \
            else None

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate`` with its ``forward`` compiled by the backend during the call."""
        m = self.module
        if self._compiled_forward is None:
            raise AttributeError(f"{type(m).__name__} has no generate()")
        had = "forward" in m.__dict__
        prev = m.__dict__.get("forward")
        m.forward = self._compiled_forward
        try:
            return m.generate(*args, **kwargs)
        finally:
            if had:
                m.forward = prev
            else:
                del m.forward

    def __getstate__(self) -> dict:
        # the backend (weak references, compiled graphs) and the compiled wrapper are process state: a copy
        # gets its own in __setstate__ (pickling them fails deep inside a WeakValueDictionary)
        state = dict(self.__dict__)
        state.pop("offload_backend", None)
        state.pop("_compiled_forward", None)
        state["_modules"] = {k: v for k, v in self._modules.items() if k != "_compiled"}
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.offload_backend = make_offload_backend(**self._offload_rebuild)
        self._compiled = torch.compile(self.module, backend=self.offload_backend)
        self._compiled_forward = torch.compile(own_forward(self.module), backend=self.offload_backend) \
            if hasattr(self.module, "generate") else None

    def _offload_target(self) -> nn.Module:
        return self.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiled(*args, **kwargs)


def _wrap_class(cls: type, opts: dict) -> type:
    class Offloaded(_ExposesOffload, cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            # not an nn.Module attribute (no submodule registration): keep it out of state_dict
            object.__setattr__(self, "offload_backend", make_offload_backend(**opts))
            self.compile(backend=self.offload_backend)

        def __getstate__(self) -> dict:
            # nn.Module.compile's wrapper calls *this* instance's _call_impl: a deep copy keeping it would
            # run the original model; the backend is process state. Both are made anew in __setstate__.
            state = dict(self.__dict__)
            for k in ("offload_backend", "_compiled_call_impl"):
                state.pop(k, None)
            return state

        def __setstate__(self, state: dict) -> None:
            super().__setstate__(state)
            object.__setattr__(self, "offload_backend", make_offload_backend(**opts))
            self.compile(backend=self.offload_backend)

    Offloaded.__name__ = cls.__name__
    Offloaded.__qualname__ = cls.__qualname__
    Offloaded.__module__ = cls.__module__
    Offloaded.__doc__ = cls.__doc__
    return Offloaded


class _CacheTensors:
    """The tensors of a cache object in layer order, for ``module_state`` (which reads ``buffers()``)."""

    def __init__(self, tensors: list):
        self._tensors = tensors

    def buffers(self) -> Any:
        return iter(self._tensors)


def static_cache_state(cache: Any) -> OffloadState:
    """The offload state bound to a Hugging Face ``StaticCache`` (``generate(..., return_dict_in_generate=True)
    .past_key_values``): its pools and counters, every group whose caches are this cache's layers. Empty when
    no rewritten graph ran on it."""
    return module_state(_CacheTensors(cache_tensors(cache)))


def offload(target: Any = None, /, **options: Any) -> Any:
    """Decorate a model class or wrap an instance; options as ``make_offload_backend``."""
    def apply(t: Any) -> Any:
        if isinstance(t, type) and issubclass(t, nn.Module):
            return _wrap_class(t, options)
        if isinstance(t, nn.Module):
            return OffloadedModule(t, make_offload_backend(**options), options)
        raise TypeError(f"offload: expected an nn.Module class or instance, got {type(t).__name__}")

    if target is None:
        return apply
    return apply(target)

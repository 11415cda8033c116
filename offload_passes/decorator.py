"""``offload(...)``: compile a model class or instance with the ``dsa_offload`` backend.

``offload(model, pool_size=...)`` returns an ``OffloadedModule`` wrapping ``torch.compile(model, backend=...)``;
``@offload(pool_size=...)`` on a class returns a subclass whose instances are compiled in place at
construction. Both expose ``offload_state`` (every graph serving the module's caches; for a Hugging Face
model, the last ``generate()`` call's cache), ``offload_backend`` and ``offload_reports``; a Hugging Face
model's ``generate`` runs with a :class:`offload_passes.hf_generate.GenerateRouter`. A copy (``deepcopy``,
``pickle``, ``torch.save``) keeps parameters, buffers and options and is compiled again by a new backend.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import _compat
from .backend import OffloadBackend, make_offload_backend
from .hf_generate import GenerateRouter, check_cache_len_buckets, check_store, generate_kwargs, own_method
from .hf_reorder import cache_tensors
from .state import OffloadState, module_state

#: Options ``make_offload_backend`` takes beside ``OffloadOptions`` (the NPU lowerings').
_NPU_KW = ("compiler_config", "npu_options", "side_stream")
#: Options of ``generate()`` under ``offload`` (offload_passes/hf_generate.py), not of the backend.
_GENERATE_KW = ("cache_len_buckets", "host_kv", "store")


def own_forward(model: nn.Module) -> Any:
    """``model.forward`` as a function with a code object of its own, to compile instead of
    ``model.forward``: Dynamo counts its ``recompile_limit`` per code object, and every transformers
    model's ``forward`` is one wrapper function (transformers/utils/generic.py), so models compiled through
    it share one budget and a third model may run unmodified. ``torch.compile(own_forward(model),
    backend=...)`` compiles the same code, counted for this model alone (``offload(model)`` does this)."""
    return own_method(model.forward, where="own_forward: model.forward")




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

    def __init__(self, module: nn.Module, backend: OffloadBackend, options: dict | None = None,
                 generate_options: dict | None = None):
        super().__init__()
        self.module = module
        self.offload_backend = backend
        self._offload_rebuild = _rebuild_options(backend, options or {})
        gen = dict(generate_options or {})
        store = gen.pop("store", None)
        # a store is process state (open files, a connection): a copy gets none (__setstate__)
        self._generate_options = gen
        # generate() (HF GenerationMixin): the cache and the compiled decode step per call, see generate()
        self.offload_router = GenerateRouter(backend, store=store, **gen) if hasattr(module, "generate") else None
        if self.offload_router is not None:
            self.offload_router.check_store(module)  # before anything is compiled: a refusal leaves nothing
        self._compiled = torch.compile(module, backend=backend)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate``; during the call the cache (where the caller chose none) and the
        compiled decode steps are ``offload_router``'s (offload_passes/hf_generate.py)."""
        m = self.module
        if self.offload_router is None:
            raise AttributeError(f"{type(m).__name__} has no generate()")
        return self.offload_router.run(m, m.generate, args, generate_kwargs(kwargs))

    def __getstate__(self) -> dict:
        # the backend (weak references, compiled graphs) and the compiled wrapper are process state: a copy
        # gets its own in __setstate__ (pickling them fails deep inside a WeakValueDictionary)
        state = dict(self.__dict__)
        state.pop("offload_backend", None)
        state.pop("offload_router", None)
        state["_modules"] = {k: v for k, v in self._modules.items() if k != "_compiled"}
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.offload_backend = make_offload_backend(**self._offload_rebuild)
        self._compiled = torch.compile(self.module, backend=self.offload_backend)
        self.offload_router = GenerateRouter(self.offload_backend, **self._generate_options) \
            if hasattr(self.module, "generate") else None

    def _offload_target(self) -> nn.Module:
        return self.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiled(*args, **kwargs)


def _wrap_class(cls: type, opts: dict, generate_options: dict) -> type:
    class Offloaded(_ExposesOffload, cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self._offload_setup()

        def _offload_setup(self) -> None:
            # not nn.Module attributes (no submodule registration): kept out of state_dict
            object.__setattr__(self, "offload_backend", make_offload_backend(**opts))
            router = GenerateRouter(self.offload_backend, **generate_options) if hasattr(cls, "generate") else None
            object.__setattr__(self, "offload_router", router)
            self.compile(backend=self.offload_backend)

        def __getstate__(self) -> dict:
            # nn.Module.compile's wrapper calls *this* instance's _call_impl: a deep copy keeping it would
            # run the original model; the backend and router are process state. All made anew in __setstate__.
            state = dict(self.__dict__)
            for k in ("offload_backend", "offload_router", "_compiled_call_impl"):
                state.pop(k, None)
            return state

        def __setstate__(self, state: dict) -> None:
            super().__setstate__(state)
            self._offload_setup()

        if hasattr(cls, "generate"):
            def generate(self, *args: Any, **kwargs: Any) -> Any:
                """The model's ``generate`` as ``offload(model).generate`` runs it (offload_passes/hf_generate.py):
                the compiled ``__call__`` is set aside for the call, the router compiles the decode steps."""
                compiled = self.__dict__.get("_compiled_call_impl")
                object.__setattr__(self, "_compiled_call_impl", None)
                try:
                    return self.offload_router.run(self, super().generate, args, generate_kwargs(kwargs))
                finally:
                    object.__setattr__(self, "_compiled_call_impl", compiled)

    Offloaded.__name__ = cls.__name__
    Offloaded.__qualname__ = cls.__qualname__
    Offloaded.__module__ = cls.__module__
    Offloaded.__doc__ = cls.__doc__
    return Offloaded


class _CacheTensors(nn.Module):
    """The tensors of a cache object in layer order, for ``module_state`` (which takes a module and reads its
    ``buffers()``); not registered as buffers: they stay the cache's."""

    def __init__(self, tensors: list):
        super().__init__()
        self._tensors = tensors

    def buffers(self, recurse: bool = True) -> Any:
        return iter(self._tensors)


def static_cache_state(cache: Any) -> OffloadState:
    """The offload state bound to a Hugging Face cache (a ``StaticCache``, or a ``DynamicCache`` whose pools
    followed it to its current tensors): its pools and counters, every group whose caches are this cache's
    layers. Empty when no rewritten graph ran on it. ``cache`` is the cache, or the
    output of ``generate(..., return_dict_in_generate=True)`` / of the model holding it (its field
    ``past_key_values``, ``cache`` from transformers 5.24: ``_compat.hf_cache_kwarg``)."""
    if not hasattr(cache, "layers"):
        field = _compat.hf_cache_kwarg()
        held = getattr(cache, field, None)
        if not hasattr(held, "layers"):
            raise TypeError(f"static_cache_state: cache must be a transformers Cache (with .layers) or a generate() / "
                            f"model output holding one in .{field}, got {type(cache).__name__}")
        cache = held
    return module_state(_CacheTensors(cache_tensors(cache)))


def offload(target: Any = None, /, **options: Any) -> Any:
    """Decorate a model class or wrap an instance; options as ``make_offload_backend``, and for a Hugging Face
    model's ``generate()``: ``cache_len_buckets`` (None: powers of two from 64; or strictly increasing ints),
    ``host_kv`` (the supplied cache a ``HostStaticCache``) and ``store`` (a ``KVStore`` of the model's
    fingerprint: each call reloads its prompt's stored prefix and stores its sequence),
    offload_passes/hf_generate.py."""
    gen = {k: options.pop(k) for k in _GENERATE_KW if k in options}
    gen["cache_len_buckets"] = check_cache_len_buckets(gen.get("cache_len_buckets"))
    if not isinstance(gen.setdefault("host_kv", False), bool):
        raise TypeError(f"offload: host_kv must be a bool, got {type(gen['host_kv']).__name__}")
    gen["store"] = check_store(gen.get("store"))

    def apply(t: Any) -> Any:
        if gen["store"] is not None and not hasattr(t, "generate"):
            raise TypeError(f"offload: store needs a model with generate() (a Hugging Face model), got "
                            f"{t.__name__ if isinstance(t, type) else type(t).__name__}")
        if isinstance(t, type) and issubclass(t, nn.Module):
            return _wrap_class(t, options, gen)
        if isinstance(t, nn.Module):
            return OffloadedModule(t, make_offload_backend(**options), options, gen)
        raise TypeError(f"offload: expected an nn.Module class or instance, got {type(t).__name__}")

    if target is None:
        return apply
    return apply(target)

"""``@offload(...)``: compile a model class or instance with the ``dsa_offload`` backend.

* On an instance: ``offload(model, pool_size=...)`` / ``offload(pool_size=...)(model)`` returns an
  ``OffloadedModule`` wrapping ``torch.compile(model, backend=...)``.
* On a class: ``@offload(pool_size=...) class M(nn.Module)`` returns a subclass whose instances are
  compiled in place (``nn.Module.compile``) at construction.

Both expose ``offload_state`` (one ``OffloadState`` over every graph serving the module's caches, graph
breaks included; empty before the first call), ``offload_backend`` (the ``OffloadBackend``) and
``offload_reports``.

``copy.deepcopy``, ``torch.save`` / ``torch.load(..., weights_only=False)`` and ``pickle`` keep the
module's parameters and buffers and its offload options; the copy (or loaded module) is compiled again
by a *new* backend with the same options, on its first call: its ``offload_reports`` start empty and list
only its own graphs, its ``offload_state`` covers only its own caches (a cold pool: the first steps
miss, never wrong). The original's graphs and pool are not shared with it (a compiled graph and its
backend are process state, not module state). ``state_dict()`` holds the wrapped module's tensors only.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .backend import OffloadBackend, make_offload_backend
from .state import OffloadState, module_state

#: Options ``make_offload_backend`` takes beside ``OffloadOptions`` (the NPU lowerings').
_NPU_KW = ("compiler_config", "npu_options", "side_stream")


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
        """The state of every graph that serves this module (``reset(rows=...)`` covers them all)."""
        return module_state(self._offload_target())

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

    def __getstate__(self) -> dict:
        # the backend (weak references, compiled graphs) and the compiled wrapper are process state: a copy
        # gets its own in __setstate__ (pickling them fails deep inside a WeakValueDictionary)
        state = dict(self.__dict__)
        state.pop("offload_backend", None)
        state["_modules"] = {k: v for k, v in self._modules.items() if k != "_compiled"}
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.offload_backend = make_offload_backend(**self._offload_rebuild)
        self._compiled = torch.compile(self.module, backend=self.offload_backend)

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

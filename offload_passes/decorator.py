"""``@offload(...)``: compile a model class or instance with the ``dsa_offload`` backend.

* On an instance: ``offload(model, pool_size=...)`` / ``offload(pool_size=...)(model)`` returns an
  ``OffloadedModule`` wrapping ``torch.compile(model, backend=...)``.
* On a class: ``@offload(pool_size=...) class M(nn.Module)`` returns a subclass whose instances are
  compiled in place (``nn.Module.compile``) at construction.

Both expose ``offload_state`` (one ``OffloadState`` over every graph serving the module's caches, graph
breaks included; empty before the first call), ``offload_backend`` (the ``OffloadBackend``) and
``offload_reports``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .backend import OffloadBackend, make_offload_backend
from .state import OffloadState, module_state


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

    def __init__(self, module: nn.Module, backend: OffloadBackend):
        super().__init__()
        self.module = module
        self.offload_backend = backend
        self._compiled = torch.compile(module, backend=backend)

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
            return OffloadedModule(t, make_offload_backend(**options))
        raise TypeError(f"offload: expected an nn.Module class or instance, got {type(t).__name__}")

    if target is None:
        return apply
    return apply(target)

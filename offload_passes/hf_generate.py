"""``generate()`` under a server's traffic: the cache ``offload(model)`` supplies and the decode graphs it compiles.

Left alone, ``generate()`` builds a ``DynamicCache`` (refused ``dynamic_cache``) or, with
``cache_implementation="static"``, a ``StaticCache`` sized per call whose decode graphs share one Dynamo frame
and reach its ``recompile_limit`` after a few lengths. :class:`GenerateRouter` runs for the duration of
``offload(model).generate`` (and the class form's ``generate``):

* the cache (:meth:`GenerateRouter.prepare_cache`): where the caller chose none, a ``StaticCache``
  (``HostStaticCache`` with ``host_kv=True``) of a bucketed length (:func:`bucket_cache_len`);
* the decode step (:meth:`GenerateRouter.forward`): one compiled function per decode key (the cache's class
  and shapes), each its own code object, so each key compiles once under a budget of its own;
* the prefill: the model's own ``forward``, eagerly (dense by design on a new cache).
"""
from __future__ import annotations

import contextlib
import logging
import types
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from . import _compat

log = logging.getLogger("offload_passes.hf_generate")

__all__ = ["GenerateRouter", "bucket_cache_len", "check_cache_len_buckets", "own_method", "MIN_CACHE_LEN"]

#: the smallest cache length bucket of the default (powers of two)
MIN_CACHE_LEN = 64

#: the generation modes whose cache never changes its batch or length (hf_reorder.py): the ones given a cache
_STATIC_MODES = ("greedy_search", "sample", "beam_search", "beam_sample")


def check_cache_len_buckets(value: Any, where: str = "offload") -> Optional[tuple[int, ...]]:
    """``cache_len_buckets`` as given to ``offload``: None (powers of two from :data:`MIN_CACHE_LEN`) or a
    non-empty, strictly increasing sequence of ints >= 1."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{where}: cache_len_buckets must be None or a sequence of ints, got {type(value).__name__}")
    out = tuple(value)
    if not out:
        raise ValueError(f"{where}: cache_len_buckets must not be empty (None gives powers of two from "
                         f"{MIN_CACHE_LEN})")
    bad = [v for v in out if not isinstance(v, int) or isinstance(v, bool)]
    if bad:
        raise TypeError(f"{where}: cache_len_buckets must hold ints, got {bad[0]!r} ({type(bad[0]).__name__})")
    if out[0] < 1 or any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"{where}: cache_len_buckets must be strictly increasing ints >= 1, got {list(out)}")
    return out


def bucket_cache_len(n: int, buckets: Optional[tuple[int, ...]] = None) -> int:
    """The cache length bucket of a call that needs ``n`` rows: the smallest bucket >= ``n``; past the last
    bucket the next multiple of it. ``buckets`` None: the next power of two, at least :data:`MIN_CACHE_LEN`."""
    if n < 1:
        raise ValueError(f"bucket_cache_len: n must be >= 1, got {n}")
    if buckets is None:
        return max(MIN_CACHE_LEN, 1 << (n - 1).bit_length())
    for b in buckets:
        if b >= n:
            return b
    last = buckets[-1]
    return -(-n // last) * last


def own_method(bound: Any, where: str = "own_method: bound") -> Any:
    """A bound method with a copy of its function's code object (:func:`offload_passes.decorator.own_forward`)."""
    f = getattr(bound, "__func__", None)
    if not isinstance(f, types.FunctionType):
        raise TypeError(f"{where} must be a method defined in Python, got {type(bound).__name__}")
    g = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    g.__kwdefaults__ = f.__kwdefaults__
    g.__dict__.update(f.__dict__)
    g.__qualname__, g.__doc__, g.__module__ = f.__qualname__, f.__doc__, f.__module__
    return types.MethodType(g, bound.__self__)


def _mode_name(mode: Any) -> str:
    return str(getattr(mode, "value", mode))


def decode_key(cache: Any, kwargs: dict) -> Optional[tuple]:
    """The decode key of a forward call, or None for one that runs eagerly (the prefill): a one-token step on
    a transformers ``StaticCache`` whose every layer holds its tensors."""
    from transformers import StaticCache

    if not isinstance(cache, StaticCache):
        return None
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if ids is None or ids.dim() < 2 or ids.shape[1] != 1:
        return None
    shapes = []
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            return None
        shapes.append(tuple(tuple(t.shape) for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                            if isinstance(t, torch.Tensor)))
    return type(cache), tuple(shapes), ids.dtype


class GenerateRouter:
    """Per model: the cache ``generate()`` gets where the caller chose none, and one compiled decode function
    per decode key (module doc). ``compiled`` counts the decode functions made; ``backend.reports`` their
    graphs."""

    def __init__(self, backend: Any, cache_len_buckets: Optional[tuple[int, ...]] = None,
                 host_kv: bool = False):
        if not isinstance(host_kv, bool):
            raise TypeError(f"offload: host_kv must be a bool, got {type(host_kv).__name__}")
        self.backend = backend
        self.buckets = check_cache_len_buckets(cache_len_buckets)
        self.host_kv = host_kv
        self._decode: dict[tuple, Callable] = {}
        self._eager: Optional[Callable] = None
        self.supplied = 0  # caches this router made for generate()

    @property
    def compiled(self) -> int:
        """Decode functions compiled so far (one per decode key)."""
        return len(self._decode)

    # -- the cache ----------------------------------------------------------------------------------
    def wants_cache(self, model: nn.Module, generation_config: Any, model_kwargs: dict, generation_mode: Any) -> bool:
        """Whether to supply the cache: the caller chose none and the mode keeps the cache's rows in place."""
        if model_kwargs.get(_compat.hf_cache_kwarg()) is not None or model_kwargs.get("past_key_values") is not None:
            return False
        if generation_config.cache_implementation is not None or generation_config.use_cache is False:
            return False
        if getattr(generation_config, "is_assistant", False) or model.config.is_encoder_decoder:
            return False
        return _mode_name(generation_mode) in _STATIC_MODES and model._supports_default_dynamic_cache()

    def make_cache(self, model: nn.Module, generation_config: Any, batch_size: int, max_cache_length: int) -> Any:
        """The supplied cache: ``max_cache_len`` = the bucket of what ``generate()`` needs (and of the call's
        ``max_cache_len``, when given)."""
        need = max(max_cache_length, generation_config.max_cache_len or 0)
        length = bucket_cache_len(need, self.buckets)
        text = model.config.get_text_config(decoder=True)
        if self.host_kv:
            from .hf_cache import HostStaticCache

            rows = max(generation_config.num_beams, generation_config.num_return_sequences or 1) * batch_size
            cache = HostStaticCache(text, max_cache_len=length, batch_size=rows, device=model.device,
                                    dtype=model.dtype)
        else:
            from transformers import StaticCache

            cache = StaticCache(config=text, max_cache_len=length)
        self.supplied += 1
        log.debug("generate(): %s with max_cache_len %d (needs %d)", type(cache).__name__, length, need)
        return cache

    def prepare_cache(self, model: nn.Module, orig: Callable) -> Callable:
        """``model._prepare_cache_for_generation`` for one call: supplies the cache or defers to ``orig``."""
        def prepare(generation_config: Any, model_kwargs: dict, generation_mode: Any, batch_size: int,
                    max_cache_length: int) -> Any:
            if not self.wants_cache(model, generation_config, model_kwargs, generation_mode):
                return orig(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
            model_kwargs[_compat.hf_cache_kwarg()] = self.make_cache(model, generation_config, batch_size,
                                                                      max_cache_length)
            return None

        return prepare

    # -- the forward ----------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """What ``generate()`` calls as ``model.forward`` during the call (module doc)."""
        cache = kwargs.get(_compat.hf_cache_kwarg())
        if cache is None:
            cache = kwargs.get("past_key_values")
        key = decode_key(cache, kwargs) if not args else None
        if key is None:
            return self._eager(*args, **kwargs)
        fn = self._decode.get(key)
        if fn is None:
            # the class's forward (the instance's is this router during the call), its own code object
            fn = torch.compile(own_method(self._eager), backend=self.backend)
            self._decode[key] = fn
            log.info("generate(): decode key %d: %s", len(self._decode), key[1][:1])
        return fn(*args, **kwargs)

    @contextlib.contextmanager
    def installed(self, model: nn.Module) -> Iterator[None]:
        """For one ``generate()`` call: ``model.forward`` is :meth:`forward`, the cache is prepared by
        :meth:`prepare_cache`; both are instance attributes, removed (or restored) after the call."""
        saved = {k: model.__dict__[k] for k in ("forward", "_prepare_cache_for_generation") if k in model.__dict__}
        self._eager = type(model).forward.__get__(model)  # the model's own forward: the prefill runs it
        orig_prepare = saved.get("_prepare_cache_for_generation", model._prepare_cache_for_generation)
        model.forward = self.forward
        model._prepare_cache_for_generation = self.prepare_cache(model, orig_prepare)
        try:
            yield
        finally:
            for k in ("forward", "_prepare_cache_for_generation"):
                if k in saved:
                    model.__dict__[k] = saved[k]
                else:
                    model.__dict__.pop(k, None)
            self._eager = None


def generate_kwargs(kwargs: dict) -> dict:
    """The caller's ``generate()`` keywords, with HF's own compile of the decode step off unless the caller
    set it: on an accelerator ``generate()`` wraps ``model.__call__`` in ``torch.compile`` (inductor) for a
    static cache, which would trace through :meth:`GenerateRouter.forward` and compile the model without this
    backend. ``compile_config`` / ``disable_compile`` given by the caller are kept."""
    out = dict(kwargs)
    gc = out.get("generation_config")
    chose = "compile_config" in out or "disable_compile" in out or (
        gc is not None and (getattr(gc, "compile_config", None) is not None or getattr(gc, "disable_compile", False)))
    if not chose:
        out["disable_compile"] = True
    return out

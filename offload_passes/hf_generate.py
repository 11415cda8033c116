"""``generate()`` under a server's traffic: the cache ``offload(model)`` supplies and the decode graphs it compiles.

Left alone, ``generate()`` builds a ``DynamicCache`` (offloaded on CPU with a symbolic cache length, its decode
graphs sharing the prefill's Dynamo frame) or, with ``cache_implementation="static"``, a ``StaticCache`` sized
per call whose decode graphs share one Dynamo frame and reach its ``recompile_limit`` after a few lengths.
:class:`GenerateRouter` runs for the duration of ``offload(model).generate`` (and the class form's ``generate``):

* the cache (:meth:`GenerateRouter.prepare_cache`): where the caller chose none, a ``StaticCache``
  (``HostStaticCache`` with ``host_kv=True``) of a bucketed length (:func:`bucket_cache_len`), one per
  (class, rows, length, device, dtype), kept and reset for the next call of that shape, as
  ``generate(cache_implementation="static")`` keeps its own: the decode graph then sees the same tensors at
  every call (a torch that guards a static-address tensor by its identity, 2.8, would otherwise recompile
  once per call);
* the decode step (:meth:`GenerateRouter.forward`): one compiled function per decode key (the cache's class
  and shapes), each its own code object, so each key compiles once under a budget of its own;
* the prefill: the model's own ``forward``, eagerly (dense by design on a new cache);
* with a store (``offload(model, store=kv)``, :meth:`GenerateRouter.run`): a call of one sequence whose cache
  starts empty (the supplied one or the caller's) gets the store's longest prefix of its prompt reloaded into
  that cache (all but the last prompt token at most), so generate() computes only the rest, and the whole
  sequence is stored after the call. A caller's cache that already holds tokens is used as given, neither
  reloaded into nor stored.
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

__all__ = ["GenerateRouter", "bucket_cache_len", "check_cache_len_buckets", "check_store", "own_method",
           "MIN_CACHE_LEN"]

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


def check_store(value: Any, where: str = "offload") -> Any:
    """``store`` as given to ``offload``: a :class:`~offload_passes.store.KVStore` or None."""
    from .store import KVStore

    if value is not None and not isinstance(value, KVStore):
        raise TypeError(f"{where}: store must be a KVStore (offload_passes.store) or None, got "
                        f"{type(value).__name__}")
    return value


def _prompt(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """A generate() call's token ids when they are one sequence ``[1, T]`` (the store's unit), else None."""
    if kwargs.get("inputs_embeds") is not None:
        return None
    ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        return None
    return ids if ids.dim() == 2 and ids.size(0) == 1 and ids.size(1) >= 1 else None


def _empty_cache(cache: Any) -> bool:
    """A cache a reload can fill: a Cache with layers that holds no token yet."""
    layers = getattr(cache, "layers", None)
    return isinstance(layers, list) and bool(layers) and int(cache.get_seq_length()) == 0


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
    """Per model: the cache ``generate()`` gets where the caller chose none, one compiled decode function per
    decode key, and with ``store`` the reload and store of each call (module doc). ``compiled`` counts the
    decode functions made; ``backend.reports`` their graphs; ``reloaded`` the tokens the last call reloaded."""

    def __init__(self, backend: Any, cache_len_buckets: Optional[tuple[int, ...]] = None,
                 host_kv: bool = False, store: Any = None):
        if not isinstance(host_kv, bool):
            raise TypeError(f"offload: host_kv must be a bool, got {type(host_kv).__name__}")
        self.store = check_store(store)
        self._store_checked = False
        self._ids: Optional[torch.Tensor] = None  # the call's prompt, while the store may serve the call
        self._stored: Any = None  # the call's cache, when it started empty and the store served it
        self.reloaded = 0
        self.backend = backend
        self.buckets = check_cache_len_buckets(cache_len_buckets)
        self.host_kv = host_kv
        self._decode: dict[tuple, Callable] = {}
        self._eager: Optional[Callable] = None
        self._caches: dict[tuple, Any] = {}  # the supplied caches, one per shape (make_cache)
        self.supplied = 0  # calls this router supplied the cache of

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
        ``max_cache_len``, when given); the one made for an earlier call of the same shape, reset."""
        need = max(max_cache_length, generation_config.max_cache_len or 0)
        length = bucket_cache_len(need, self.buckets)
        text = model.config.get_text_config(decoder=True)
        rows = max(generation_config.num_beams, generation_config.num_return_sequences or 1) * batch_size
        key = (self.host_kv, id(text), rows, length, model.device, model.dtype)
        cache = self._caches.get(key)
        if cache is not None:
            cache.reset()
        elif self.host_kv:
            from .hf_cache import HostStaticCache

            cache = HostStaticCache(text, max_cache_len=length, batch_size=rows, device=model.device,
                                    dtype=model.dtype)
        else:
            from transformers import StaticCache

            cache = StaticCache(config=text, max_cache_len=length)
        self._caches[key] = cache
        self.supplied += 1
        log.debug("generate(): %s with max_cache_len %d (needs %d)", type(cache).__name__, length, need)
        return cache

    def prepare_cache(self, model: nn.Module, orig: Callable) -> Callable:
        """``model._prepare_cache_for_generation`` for one call: supplies the cache or defers to ``orig``."""
        def prepare(generation_config: Any, model_kwargs: dict, generation_mode: Any, batch_size: int,
                    max_cache_length: int) -> Any:
            out = None
            if self.wants_cache(model, generation_config, model_kwargs, generation_mode):
                model_kwargs[_compat.hf_cache_kwarg()] = self.make_cache(model, generation_config, batch_size,
                                                                          max_cache_length)
            else:
                out = orig(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
            self._reload(model, generation_config, model_kwargs)
            return out

        return prepare

    # -- the store ------------------------------------------------------------------------------------
    def check_store(self, model: nn.Module) -> None:
        """Refuse a store whose fingerprint is not ``model``'s (``store.hf.check_hf_store``), once per router."""
        if self.store is not None and not self._store_checked:
            from .store.hf import check_hf_store

            check_hf_store(model, self.store, where="offload")
            self._store_checked = True

    def _reload(self, model: nn.Module, generation_config: Any, model_kwargs: dict) -> None:
        """The store's longest prefix of the call's prompt into the call's cache, when the call is one
        sequence (one beam, one return sequence, no padding) and the cache holds nothing yet."""
        if self._ids is None or model.config.is_encoder_decoder:
            return
        cache = model_kwargs.get(_compat.hf_cache_kwarg())
        if cache is None:
            cache = model_kwargs.get("past_key_values")
        mask = model_kwargs.get("attention_mask")
        if generation_config.num_beams != 1 or (generation_config.num_return_sequences or 1) != 1:
            return
        if (mask is not None and not bool(mask.all())) or not _empty_cache(cache):
            return
        from .store.hf import reload_hf

        self.reloaded = reload_hf(self.store, model, self._ids, cache)  # keeps the last prompt token computed
        self._stored = cache
        if self.reloaded and mask is None:
            # generate() slices the prompt past the cache's tokens when it knows the mask's length; it records
            # that length only for a model whose forward names attention_mask (the router's takes **kwargs)
            generation_config._mask_length = self._ids.size(1)

    def run(self, model: nn.Module, generate: Callable, args: tuple, kwargs: dict) -> Any:
        """One ``generate(*args, **kwargs)`` call with the router :meth:`installed`; with a store, the call's
        prompt reloaded into its cache first (:meth:`_reload`) and the whole sequence stored after."""
        self.check_store(model)
        self._ids = _prompt(args, kwargs) if self.store is not None else None
        self._stored, self.reloaded = None, 0
        try:
            with self.installed(model):
                out = generate(*args, **kwargs)
            if self._stored is not None:
                from .store.hf import save_hf

                seq = out.sequences if hasattr(out, "sequences") else out
                save_hf(self.store, seq[0], self._stored)
        finally:
            self._ids = self._stored = None
        return out

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

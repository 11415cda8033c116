"""Decode runs of the models on the CUDA path, shared by the GPU benchmark (``gpu_graphs.py``: time per step) and
the device tests (``tests/cuda/test_device_models.py``: logits): the offload backend in exe_mode "cuda", a
synthetic context for an HF model, the recipe model's captured or op-by-op decode, a delay on the install side
stream. On a CPU the same runs take host tensors (the tests' CPU mode); the timings are then left out."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from _harness import gen, randn

#: cycles of the deliberate side-stream delay (about 25 ms at 2 GHz: longer than a decode step of these models)
DELAY_CYCLES = 50_000_000


def cuda_backend(**opts: Any):
    """The offload backend in exe_mode "cuda"."""
    from offload_passes import make_offload_backend

    return make_offload_backend(exe_mode="cuda", **opts)


@contextlib.contextmanager
def side_stream_delay(cycles: int) -> Iterator[None]:
    """Every install scope starts with ``torch.cuda._sleep(cycles)`` on the side stream (a GPU only: on the CPU the
    stream ops do nothing). A join placed too late shows as a difference in the logits."""
    from offload_passes.lowering.cuda import RUNTIME

    enter = RUNTIME.scope_enter

    def delayed(tag: int) -> None:
        enter(tag)
        if RUNTIME.enabled():
            torch.cuda._sleep(cycles)

    RUNTIME.scope_enter = delayed
    try:
        yield
    finally:
        RUNTIME.scope_enter = enter


def step_time(dev: torch.device, timings: Optional[list], fn: Callable[[], Any]) -> Any:
    """``fn()``, its wall time on the device appended to ``timings`` (CUDA events; nothing on the CPU)."""
    if timings is None or dev.type != "cuda":
        return fn()
    a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    out = fn()
    e.record()
    e.synchronize()
    timings.append(a.elapsed_time(e) / 1e3)
    return out


def max_diff(a: list, b: list, relative: bool = False) -> float:
    """The largest absolute difference of two lists of logits (``relative``: over the largest logit of ``b``)."""
    d = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))
    return d / max(float(y.float().abs().max()) for y in b) if relative else d


def fill_context(model: Any, cache: Any, ids: torch.Tensor, ctx: int, dev: torch.device, seed: int = 0) -> None:
    """Make ``cache`` hold ``ctx`` tokens without a dense prefill: a one-token prefill (eager) allocates what is
    lazy, then rows ``[0, ctx)`` of every latent / rope / indexer cache get random rows generated on ``dev`` and
    the counters say ``ctx``. A host cache's rows go through its write op (stream-ordered stores through the
    pinned address), a device cache's with ``copy_``."""
    from offload_passes.hf_cache import HostIndexedLayer

    g = gen(dev, seed)
    with torch.no_grad():
        model(ids[:, :1], past_key_values=cache, use_cache=True)
        for layer in cache.layers:
            if isinstance(layer, HostIndexedLayer):
                k, v = layer.keys, layer.values
                pos = torch.arange(ctx, device=dev)
                torch.ops.offload_ref.static_cache_write_(k, v, pos, randn(k[:, :, :ctx].shape, dev, g, k.dtype),
                                                          randn(v[:, :, :ctx].shape, dev, g, v.dtype))
            else:
                for t in (layer.keys, layer.values):
                    t.narrow(2, 0, ctx).copy_(randn(t.narrow(2, 0, ctx).shape, dev, g, t.dtype))
            ik = getattr(layer, "indexer_keys", None)
            if ik is not None:
                ik.narrow(1, 0, ctx).copy_(randn(ik.narrow(1, 0, ctx).shape, dev, g, ik.dtype))
            for name in ("cumulative_length", "indexer_cumulative_length"):
                c = getattr(layer, name, None)
                if isinstance(c, torch.Tensor):
                    c.fill_(ctx)


def hf_logits(b: Any, model: Any, fn: Callable, host_kv: bool, ctx: int, steps: int, dev: torch.device,
              timings: Optional[list] = None) -> list:
    """``steps`` decode steps of ``fn`` after a synthetic context of ``ctx`` tokens (B = 1): a ``HostStaticCache``
    (host KV) or transformers' ``StaticCache`` (device KV). ``timings``: seconds per step (CUDA events)."""
    import transformers as tf

    from offload_passes.hf_cache import HostStaticCache

    n = ctx + steps + 2
    dtype = next(model.parameters()).dtype
    cache = (HostStaticCache(b.config, max_cache_len=n, batch_size=1, device=dev, dtype=dtype) if host_kv
             else tf.StaticCache(config=b.config, max_cache_len=n))
    ids = torch.randint(0, b.config.vocab_size, (1, n), generator=gen(dev, 7), device=dev)
    fill_context(model, cache, ids, ctx, dev)
    out = []
    with torch.no_grad():
        for s in range(steps):
            pos = torch.full((1, 1), ctx + s, dtype=torch.long, device=dev)
            res = step_time(dev, timings, lambda: fn(ids[:, ctx + s:ctx + s + 1], past_key_values=cache,
                                                     use_cache=True, position_ids=pos))
            out.append(res.logits.detach().clone())
    return out


def recipe_model(dev: torch.device, steps: int) -> Any:
    """The recipe ``tiny`` model with host KV: its full caches pinned on the host on a GPU (``place_full_caches``),
    host tensors on the CPU."""
    from offload_passes import models

    b = models.build("tiny", enable_offload=True, decode_steps=steps, device=dev)
    if dev.type == "cuda":
        from offload_passes.cuda import place_full_caches

        place_full_caches(b.model, dev)
    return b


def recipe_graph_logits(dev: torch.device, steps: int, captured: bool, timings: Optional[list] = None) -> tuple:
    """The recipe ``tiny`` model with host KV, its decode step compiled in exe_mode "cuda" with
    ``mode="reduce-overhead"`` (captured: the lowering's own capture) or without (op by op): the logits of
    ``steps`` steps and the backend."""
    torch._dynamo.reset()
    b = recipe_model(dev, steps)
    be = cuda_backend(pool_size=1024)
    fn = torch.compile(b.model, backend=be, **({"mode": "reduce-overhead"} if captured else {}))
    b.driver.prefill()
    out = [step_time(dev, timings, lambda: b.driver.step(fn)).logits.detach().clone() for _ in range(steps)]
    return out, be


def hf_graph_logits(preset: str, ctx: int, pool: int, dev: torch.device, steps: int, captured: bool,
                    timings: Optional[list] = None) -> tuple:
    """HF ``preset`` with host KV after ``ctx`` tokens, compiled in exe_mode "cuda" (pool of ``pool`` rows) with
    ``mode="reduce-overhead"`` or without: the logits of ``steps`` steps and the backend."""
    from offload_passes.models import hf

    torch._dynamo.reset()
    b = hf.build(preset)
    model = b.model.to(dev)
    be = cuda_backend(pool_size=pool)
    fn = torch.compile(model, backend=be, fullgraph=True, dynamic=False,
                       **({"mode": "reduce-overhead"} if captured else {}))
    return hf_logits(b, model, fn, True, ctx, steps, dev, timings=timings), be

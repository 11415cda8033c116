"""The models on the CUDA path, compiled in ``exe_mode="cuda"``, on the device (``dev``: the GPU with
``OFFLOAD_PASSES_GPU=1``, else host tensors on the CPU, where the ops take their CPU kernels and the stream ops do
nothing):

* the recipe ``tiny`` model with host KV (its full caches pinned on a GPU) equals the unmodified model bit for bit;
* ``hf-tiny`` (and on a GPU ``hf-glm5-attn``) with host KV (``offload_passes.hf_cache.HostStaticCache``) equals
  the same compiled model on device KV bit for bit (the KV's place changes nothing), and is within the bf16
  bound of the unmodified model (the rewrite reduces over K rows instead of T; docs/hf.md);
* on a GPU only: the same with a delay at every install scope's start on the side stream (``torch.cuda._sleep``):
  a join placed too late shows as a difference (on a CPU the stream ops do nothing: no case is generated);
* one CUDA graph per decode step (``mode="reduce-overhead"``, ``offload_passes/lowering/cuda_graphs.py``) on the
  recipe ``tiny`` and on ``hf-glm5-attn`` at 16K (``hf-tiny`` at 128 on a CPU): logits equal to the same compile
  op by op, every step after the warm-up and the capture a replay (none on host tensors: nothing to capture),
  no capture problem in the decode graph. The capture itself on a CPU: ``test_step_capture.py`` (test double).

The figures go into the JUnit report (``record_property``; ``scripts/lent_gpu.sh`` writes it under ``$OUT``). The
runs are ``benchmarks/_gpu_models.py``'s, which the ``graphs`` timing of ``benchmarks/gpu_check.py`` also uses.
"""
from __future__ import annotations

import pytest
import torch

from _device import ON_GPU, sync
from _gpu_models import (DELAY_CYCLES, cuda_backend, hf_graph_logits, hf_logits, max_diff, recipe_graph_logits,
                         recipe_model, side_stream_delay)

pytestmark = pytest.mark.device

#: offload-demo's bf16 bound (docs/hf.md): the rewritten bf16 model against the unmodified one, relative to the
#: largest logit
BF16_BOUND = 2e-2
STEPS = 4 if ON_GPU else 2
DELAYS = (0, DELAY_CYCLES) if ON_GPU else (0,)
HF_PRESETS = ("hf-tiny", "hf-glm5-attn") if ON_GPU else ("hf-tiny",)


def _raise_device_errors() -> None:
    from offload_passes.cuda import raise_device_errors

    sync()
    raise_device_errors()


@pytest.mark.parametrize("delay", DELAYS, ids=lambda d: "side-stream-delay" if d else "no-delay")
def test_tiny_with_host_kv_equals_unmodified(dev, delay, record_property):
    torch._dynamo.reset()
    from offload_passes import models

    base = models.build("tiny", enable_offload=True, decode_steps=STEPS, device=dev)
    comp = recipe_model(dev, STEPS)
    be = cuda_backend(pool_size=1024)
    r0 = base.driver.run(steps=STEPS)
    with side_stream_delay(delay):
        r1 = comp.driver.run(steps=STEPS, step_fn=torch.compile(comp.model, backend=be))
    _raise_device_errors()
    diff = max_diff(r0.logits, r1.logits)
    record_property("max_abs_diff", diff)
    assert be.reports and be.reports[-1]["rewritten"]
    assert diff == 0


_HF_RUNS: dict = {}


def _hf_run(preset: str, dev: torch.device, kind: str, ctx: int = 256) -> list:
    """Logits of ``STEPS`` decode steps of ``preset`` after ``ctx`` tokens: ``unmodified``, or compiled in the cuda
    mode on ``device`` KV, ``host`` KV, host KV with a side-stream ``delay``; the compiled runs' offload engaged.
    Kept per module: the three tests of a preset share its runs."""
    key = (preset, kind)
    if key not in _HF_RUNS:
        from offload_passes.models import hf

        if preset not in _HF_RUNS:  # one model per preset: every run of it reads the same weights
            b = hf.build(preset)
            _HF_RUNS[preset] = (b, b.model.to(dev))
        b, model = _HF_RUNS[preset]
        if kind == "unmodified":
            _HF_RUNS[key] = hf_logits(b, model, model, False, ctx, STEPS, dev)
        else:
            torch._dynamo.reset()
            be = cuda_backend()
            fn = torch.compile(model, backend=be, fullgraph=True, dynamic=False)
            with side_stream_delay(DELAY_CYCLES if kind == "delay" else 0):
                logits = hf_logits(b, model, fn, kind != "device", ctx, STEPS, dev)
            _raise_device_errors()
            rep = be.reports[-1] if be.reports else {}
            assert rep.get("rewritten") and rep.get("hf", {}).get("offload"), f"{preset} {kind}: not offloaded"
            _HF_RUNS[key] = logits
    return _HF_RUNS[key]


#: what the host-KV run is compared with, bit for bit: the same compile on device KV; on a GPU also the host-KV run
#: with a side-stream delay (on a CPU the stream ops do nothing: no such case)
HOST_KV_TWINS = ("device", "delay") if ON_GPU else ("device",)


@pytest.mark.parametrize("other", HOST_KV_TWINS, ids={"device": "vs-device-kv", "delay": "vs-side-stream-delay"}.get)
@pytest.mark.parametrize("preset", HF_PRESETS)
def test_hf_host_kv_equals(dev, preset, other, record_property):
    diff = max_diff(_hf_run(preset, dev, other), _hf_run(preset, dev, "host"))
    record_property("max_abs_diff", diff)
    assert diff == 0


@pytest.mark.parametrize("preset", HF_PRESETS)
def test_hf_host_kv_within_the_bf16_bound_of_unmodified(dev, preset, record_property):
    rel = max_diff(_hf_run(preset, dev, "host"), _hf_run(preset, dev, "unmodified"), relative=True)
    record_property("max_diff_over_max_logit", rel)
    assert rel <= BF16_BOUND


#: (path, HF preset or None for the recipe tiny, context, pool rows): the GPU's, and the CPU's (smaller HF model)
GRAPH_PATHS = ({"tiny": (None, 0, 1024), "hf": ("hf-glm5-attn", 16384, 8192)} if ON_GPU
               else {"tiny": (None, 0, 1024), "hf": ("hf-tiny", 128, 1024)})


@pytest.mark.parametrize("path", list(GRAPH_PATHS))
def test_captured_decode_step_equals_op_by_op(dev, path, record_property):
    from offload_passes.lowering.cuda_graphs import capture_problems

    preset, ctx, pool = GRAPH_PATHS[path]
    steps = 6 if ON_GPU else 3
    runs = {}
    for captured in (False, True):
        if preset is None:
            runs[captured] = recipe_graph_logits(dev, steps, captured)
        else:
            runs[captured] = hf_graph_logits(preset, ctx, pool, dev, steps, captured)
        _raise_device_errors()
    (eager, _), (graph, be) = runs[False], runs[True]
    diff = max_diff(eager, graph)
    replays = sum(r.replays for r in be.lowering.replays.values())
    problems = capture_problems(be.final_graph())
    record_property("max_abs_diff", diff)
    record_property("replays", replays)
    record_property("capture_problems", len(problems))
    assert problems == []
    assert diff == 0
    assert replays == (steps - 2 if dev.type == "cuda" else 0)  # warm-up and capture, then replays

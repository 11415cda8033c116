"""Runs an HF preset unmodified and compiled with the backend, teacher-forced, and keeps the graph."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from offload_passes.backend import make_offload_backend
from offload_passes.models import hf

STEPS = 64
PATTERNS = {"FSSS": {"num_hidden_layers": 4, "index_topk_pattern": "FSSS"},
            "irregular": {"num_hidden_layers": 6, "index_topk_pattern": "FSFFSS"}}  # groups [0,1] [2] [3,4,5]


@dataclass
class Pair:
    ref: list  # logits per step, unmodified model (eager PyTorch)
    out: list  # logits per step, compiled with the backend
    backend: Any
    graph: torch.fx.GraphModule  # the rewritten Dynamo graph of the decode step
    report: dict
    decoder: Any = None  # keeps the caches, hence the backend's offload state, alive (torch 2.10 frees them)


def rel_err(ref: list, out: list) -> float:
    """max over steps of max|out - ref| / max|ref| (fp32)."""
    return max(float((o.float() - r.float()).abs().max() / r.float().abs().max()) for r, o in zip(ref, out))


@functools.lru_cache(maxsize=None)
def run_pair(attn: str, pattern: str, dtype: str, offload: bool, steps: int = STEPS) -> Pair:
    torch._dynamo.reset()
    over = dict(PATTERNS[pattern], dtype=dtype, decode_steps=steps)
    base = hf.build("hf-tiny", attn=attn, **over)
    comp = hf.build("hf-tiny", attn=attn, **over)
    assert all(torch.equal(a, b) for a, b in zip(base.model.parameters(), comp.model.parameters()))
    backend = make_offload_backend(enable_offload=offload)
    graphs = []

    def capture(gm, example_inputs):
        fn = backend(gm, example_inputs)
        graphs.append(gm)  # rewritten in place by the backend
        return fn

    fn = torch.compile(comp.model, backend=capture, fullgraph=True)
    ref = base.run(steps=steps)
    dec = comp.decoder()  # what comp.run does, but the decoder (its caches) outlives the run
    dec.prefill()
    out = [dec.step(fn) for _ in range(steps)]
    assert len(graphs) == 1, f"decode compiled {len(graphs)} graphs (expected 1, no recompile)"
    return Pair(ref, out, backend, graphs[0], backend.reports[-1], dec)

"""GLM-5.2 decode model as the NPU recipe writes it (the "unmodified" input of the offload pass).

This package never imports the passes (only ``offload_passes.custom_ops``, to get the ops registered).

One-call API::

    from offload_passes import models

    b = models.build("tiny")                                   # preset name, yaml path or mapping
    b = models.build("tiny", enable_offload=True, next_n=3)    # any model / runner key as override
    b.model        # GlmMoeDsaForCausalLM; forward(input_ids [B,S] int64, positions [B,S] int64) -> logits [B,S,V]
    b.config       # ModelConfig (HF glm_moe_dsa keys: num_hidden_layers, index_topk, indexer_types, ...)
    b.runner       # RunnerConfig (recipe keys: batch_size, prefill_len, decode_steps, next_n, pa_block_size,
                   #               pa_max_length, enable_offload, exe_mode, enlarge_pool_size, ...)
    b.driver       # Driver: deterministic prompt + decode tokens
    b.driver.prefill()                       # dense causal prefill, fills every cache (eager)
    ids, pos = b.driver.next_inputs()        # example inputs of the decode step (for torch.compile)
    step = torch.compile(b.model, backend=...)
    res = b.driver.run(step_fn=step, collect=True)    # prefill + decode_steps steps
    res.logits[i]           # [B, S, V] per step
    res.steps[i].attn       # per-layer SFA outputs [B*S, H, kv_lora_rank]   (collect=True)
    res.steps[i].topk       # per IndexShare group [B, S, K] int32            (collect=True)
    b.driver.save_trace("topk.pt")           # top-k trace for tools (format in models/glm/driver.py)

    models.list_presets()   # ['glm-5.2-78l', 'glm-5.2-78l-w8a8', 'small', 'tiny', 'tiny-w8a8']
    b.model.groups()  # IndexShare groups, e.g. [[0,1,2,3],[4,5,6,7]] for tiny
    b.model.reset_rows([b]) # a batch row starts a new request: caches + gather ledger cleared
    b.model.memory_footprint()  # bytes of parameters / caches / selection buffers

``build(..., parallel=ParallelLayout.current())`` builds this rank's share of the recipe's multi-rank
layout (``models/glm/parallel.py``: the runner's ``batch_size`` is the global batch, split across ranks;
expert-parallel MoE, vocab-parallel embedding / lm_head, all through functional collectives); every rank
must build, prefill and step together. World size 1 builds exactly the single-process model.

``build(..., weights="<dir>")`` loads a safetensors directory with HF ``glm_moe_dsa`` names instead of the
seeded random initialisation; ``device="meta"`` builds without allocating (shape inspection).

The decode graph follows docs/ARCHITECTURE.md §3 exactly (indexer -> view [B,S,1,K] -> per-layer
``custom.npu_gather_selection_kv_cache`` (offload) -> ``where(arange(K) < act, arange(K), -1)`` -> SFA);
the indexer / SFA namespace is chosen once in ``models/glm/npu_ops.py``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from .glm import (
    Driver,
    GlmConfig,
    GlmMoeDsaForCausalLM,
    ModelConfig,
    RunnerConfig,
    init_weights,
    list_presets,
    load_config,
    load_safetensors,
    model_config_from_hf,
    save_safetensors,
)
from .glm.parallel import ParallelLayout

log = logging.getLogger("offload_passes.models")


@dataclass
class Built:
    model: GlmMoeDsaForCausalLM
    config: ModelConfig
    runner: RunnerConfig
    driver: Optional[Driver]

    def example_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode-step inputs right after prefill (does not prefill)."""
        return self.driver.next_inputs()


def build(
    preset_or_yaml: Union[str, Path, Mapping[str, Any]] = "tiny",
    *,
    weights: Optional[Union[str, Path]] = None,
    device: Optional[Union[str, torch.device]] = None,
    parallel: Optional[ParallelLayout] = None,
    **overrides: Any,
) -> Built:
    """Build model + configs + driver for a preset / yaml file / mapping, with key overrides.

    Weights: seeded random (``runner_config.seed``) unless ``weights`` names a safetensors directory.
    ``parallel``: this rank's place in a multi-rank layout (None or world size 1: single process);
    ``Built.runner`` is then this rank's runner (``batch_size`` = its rows of the global batch).
    """
    cfg: GlmConfig = load_config(preset_or_yaml, **overrides)
    global_batch, row_offset = cfg.runner.batch_size, 0
    if parallel is not None and parallel.world_size > 1:
        import dataclasses

        parallel.check(global_batch, cfg.model.vocab_size, cfg.model.n_routed_experts)
        if weights is not None:
            raise ValueError("build: weights=<dir> with a parallel layout is not supported (the safetensors "
                             "loader expects unsharded tensors); use the seeded weights")
        row_offset, hi = parallel.shard(global_batch, "batch_size")
        cfg.runner = dataclasses.replace(cfg.runner, batch_size=hi - row_offset)
    model = GlmMoeDsaForCausalLM(cfg.model, cfg.runner, device=device,
                                 seed=None if weights is not None else cfg.runner.seed, parallel=parallel)
    model.eval()
    model.requires_grad_(False)  # inference model: no autograd state in eager or in traced graphs
    if str(device) == "meta":
        return Built(model=model, config=cfg.model, runner=cfg.runner, driver=None)
    if weights is not None:
        load_safetensors(model, weights)
    driver = (Driver(model, cfg.runner) if row_offset == 0 and global_batch == cfg.runner.batch_size
              else Driver(model, cfg.runner, global_batch=global_batch, row_offset=row_offset))
    return Built(model=model, config=cfg.model, runner=cfg.runner, driver=driver)


__all__ = [
    "build", "Built", "Driver", "ParallelLayout", "GlmConfig", "GlmMoeDsaForCausalLM", "ModelConfig", "RunnerConfig",
    "init_weights", "list_presets", "load_config", "load_safetensors", "model_config_from_hf", "save_safetensors",
]

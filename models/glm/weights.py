"""Weights: seeded random initialisation and safetensors I/O with HF ``glm_moe_dsa`` parameter names.

Names (``state_dict()`` of :class:`GlmMoeDsaForCausalLM` equals the checkpoint layout)::

    model.embed_tokens.weight, model.norm.weight, lm_head.weight
    model.layers.{i}.input_layernorm.weight, model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.self_attn.{q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj}.weight
    model.layers.{i}.self_attn.{q_a_layernorm,kv_a_layernorm}.weight
    model.layers.{i}.self_attn.indexer.{wq_b,wk,weights_proj}.weight, ...indexer.k_norm.{weight,bias}   ("full" layers)
    model.layers.{i}.mlp.{gate_proj,up_proj,down_proj}.weight                                           (dense layers)
    model.layers.{i}.mlp.gate.weight, model.layers.{i}.mlp.gate.e_score_correction_bias                 (MoE layers)
    model.layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight
    model.layers.{i}.mlp.shared_experts.{gate_proj,up_proj,down_proj}.weight

Checkpoint tensors for layers ``>= num_hidden_layers`` (the MTP module) are ignored, as HF does.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Union

import torch
from torch import nn

log = logging.getLogger("offload_passes.models.weights")

_MTP_RE = re.compile(r"^model\.layers\.(\d+)\.")


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0, std: float | None = None) -> None:
    """Deterministic init, independent of dtype and device: values are drawn in fp32 on the CPU from
    one generator in ``state_dict`` order. Linear/embedding ~ N(0, initializer_range); norms 1 / bias 0;
    the router correction bias ~ N(0, 0.01) (non-zero, so it matters)."""
    cfg = model.config
    std = cfg.initializer_range if std is None else std
    g = torch.Generator().manual_seed(seed)
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith("k_norm.bias"):
            t.zero_()
        elif name.endswith("e_score_correction_bias"):
            t.copy_(torch.randn(t.shape, generator=g) * 0.01)
        else:
            t.copy_((torch.randn(t.shape, generator=g) * std).to(t.dtype))


def expected_names(model: nn.Module) -> list[str]:
    return list(model.state_dict().keys())


def _files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({directory / f for f in weight_map.values()})
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise RuntimeError(f"load_safetensors: no *.safetensors files in {directory}")
    return files


@torch.no_grad()
def load_safetensors(model: nn.Module, directory: Union[str, Path], strict: bool = True) -> dict:
    """Load HF-named tensors from ``directory`` (single file, shards, or an index json).

    Tensors are cast to the parameter dtype. ``strict``: every model tensor must be present and no
    unknown tensor may appear (MTP layers ``>= num_hidden_layers`` excepted). Shape mismatches always
    raise. Returns ``{"loaded": n, "ignored": [...], "missing": [...]}``.
    """
    from safetensors import safe_open

    directory = Path(directory)
    sd = model.state_dict(keep_vars=True)
    n_layers = model.config.num_hidden_layers
    loaded: set[str] = set()
    ignored: list[str] = []
    unexpected: list[str] = []
    for f in _files(directory):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                m = _MTP_RE.match(name)
                if m and int(m.group(1)) >= n_layers:
                    ignored.append(name)
                    continue
                if name not in sd:
                    unexpected.append(name)
                    continue
                t = fh.get_tensor(name)
                dst = sd[name]
                if tuple(t.shape) != tuple(dst.shape):
                    raise RuntimeError(
                        f"load_safetensors: tensor '{name}' has shape {tuple(t.shape)}, model expects "
                        f"{tuple(dst.shape)}"
                    )
                dst.copy_(t.to(dst.dtype))
                loaded.add(name)
    missing = [n for n in sd if n not in loaded]
    if strict and (missing or unexpected):
        raise RuntimeError(
            "load_safetensors: checkpoint does not match the model: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)}), "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})"
        )
    log.info("loaded %d tensors from %s (%d MTP tensors ignored)", len(loaded), directory, len(ignored))
    return {"loaded": len(loaded), "ignored": ignored, "missing": missing, "unexpected": unexpected}


def save_safetensors(model: nn.Module, directory: Union[str, Path], config_json: bool = True) -> Path:
    """Write ``model.safetensors`` (HF names) and, optionally, an HF-style ``config.json``."""
    import dataclasses

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    path = directory / "model.safetensors"
    save_file(sd, str(path))
    if config_json:
        d = dataclasses.asdict(model.config)
        d["architectures"] = ["GlmMoeDsaForCausalLM"]
        (directory / "config.json").write_text(json.dumps(d, indent=2))
    return path

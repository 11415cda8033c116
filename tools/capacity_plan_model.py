"""Model shape for ``offload-capacity``: read a model preset or a user yaml (HF ``glm_moe_dsa`` key names).

The presets live in ``models/configs/<name>.yaml`` (installed as ``offload_passes/models/configs``).
Keys are HF ``GlmMoeDsaConfig`` names (``num_hidden_layers``, ``kv_lora_rank``, ...) plus the recipe's
runner keys (``next_n``, ``pa_block_size``, ``enlarge_pool_size``, ``pa_max_length``); they may sit at
the top level or inside nested sections (``model_config:``, ``runner:`` ...): the first occurrence in
breadth-first order wins, so a yaml laid out like the recipe's runner files works as well as a flat
HF ``config.json``-style file.

IndexShare groups follow HF ``GlmMoeDsaConfig``: an explicit ``indexer_types`` list wins, then
``index_topk_pattern`` ("F"/"S" string or list), then the period rule
``full iff max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0``. A config with none of the
three keys (a GLM-5 checkpoint) has one indexer per layer: every layer is "full".
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from offload_passes._cli import readable_file

log = logging.getLogger("offload_passes.tools.capacity_plan")

#: Keys the KV arithmetic cannot do without.
REQUIRED_KEYS = ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim", "index_head_dim", "index_topk")

#: Keys only the weight estimate needs (``--weights-gib`` replaces the estimate when they are missing).
WEIGHT_KEYS = (
    "hidden_size", "num_attention_heads", "q_lora_rank", "qk_nope_head_dim", "v_head_dim",
    "n_routed_experts", "moe_intermediate_size", "intermediate_size", "first_k_dense_replace",
    "vocab_size", "index_n_heads",
)

#: HF GlmMoeDsaConfig defaults used when a key is absent (only for keys whose absence is harmless).
HF_DEFAULTS: dict[str, Any] = {
    "index_skip_topk_offset": 3,
    "num_nextn_predict_layers": 1,
    "n_shared_experts": 1,
    "moe_layer_freq": 1,
}


#: Full-size GLM-5.2 (built in, because the repository preset ``glm-5.2-78l`` keeps the real KV /
#: indexer layout but shrinks hidden size, heads and experts to fit a CPU, so its weights are tiny).
#: Model keys: HF ``GlmMoeDsaConfig`` defaults as restated in hicann/cann-recipes-infer
#: ``models/glm_5_2/models/configuration_glm.py`` (GLM-5 / GLM-5.2 sizes; the recipe README names
#: q_lora_rank 2048, qk_nope_head_dim 192, v_head_dim 256 as GLM-5.2's real attention dims).
#: Runner keys: ``config/glm_5_2_rank_32_32ep_w8a8_offload_mtp.yaml`` (next_n 3, pa_block_size 128).
BUILTIN: dict[str, dict[str, Any]] = {
    "glm-5.2": {
        "model_config": {
            "num_hidden_layers": 78, "hidden_size": 6144, "intermediate_size": 12288,
            "moe_intermediate_size": 2048, "num_attention_heads": 64, "n_shared_experts": 1,
            "n_routed_experts": 256, "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 192, "v_head_dim": 256, "vocab_size": 154880, "first_k_dense_replace": 3,
            "moe_layer_freq": 1, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
            "index_topk_freq": 4, "index_skip_topk_offset": 3, "num_nextn_predict_layers": 1,
        },
        "runner_config": {"next_n": 3, "pa_block_size": 128, "enlarge_pool_size": False},
    },
}


def configs_dir() -> Path:
    """``models/configs`` next to this package (same relative place in the repo and when installed)."""
    return Path(__file__).resolve().parent.parent / "models" / "configs"


def list_presets() -> list[str]:
    """Built-in full-size configs plus the repository presets."""
    d = configs_dir()
    files = sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []
    return sorted(BUILTIN) + [f for f in files if f not in BUILTIN]


def _flatten(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Breadth-first over nested mappings; the first occurrence of a key wins."""
    out: dict[str, Any] = {}
    queue: list[Mapping[str, Any]] = [doc]
    while queue:
        cur = queue.pop(0)
        for k, v in cur.items():
            if isinstance(v, Mapping):
                queue.append(v)
            elif k not in out:
                out[str(k)] = v
    return out


def derive_indexer_types(keys: Mapping[str, Any], n_layers: int) -> tuple[list[str], str]:
    """Per-layer "full"/"shared" list and a one-line note saying where it came from."""
    if keys.get("indexer_types") is not None:
        types = [str(t) for t in keys["indexer_types"]]
        src = "indexer_types"
    elif keys.get("index_topk_pattern") is not None:
        pat = keys["index_topk_pattern"]
        try:
            types = [{"F": "full", "S": "shared"}[c] for c in pat] if isinstance(pat, str) else [str(t) for t in pat]
        except KeyError as e:
            raise ValueError(f"index_topk_pattern: letters must be 'F' or 'S', got {e.args[0]!r}") from None
        src = "index_topk_pattern"
    elif keys.get("index_topk_freq") is not None:
        freq = max(int(keys["index_topk_freq"]), 1)
        off = int(keys.get("index_skip_topk_offset", HF_DEFAULTS["index_skip_topk_offset"]))
        types = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]
        src = f"index_topk_freq={freq}, index_skip_topk_offset={off}"
    else:
        types = ["full"] * n_layers
        src = "no IndexShare keys: one indexer per layer"
    if len(types) != n_layers:
        raise ValueError(f"indexer_types: has {len(types)} entries, num_hidden_layers is {n_layers}")
    bad = sorted({t for t in types if t not in ("full", "shared")})
    if bad:
        raise ValueError(f"indexer_types: entries must be 'full' or 'shared', got {bad}")
    if types and types[0] != "full":
        raise ValueError("indexer_types: layer 0 must be 'full' (a shared layer needs an earlier full layer)")
    return types, src


def groups_of(types: list[str]) -> list[list[int]]:
    """IndexShare groups: each full layer opens a group, following shared layers join it."""
    groups: list[list[int]] = []
    for i, t in enumerate(types):
        if t == "full":
            groups.append([i])
        else:
            groups[-1].append(i)
    return groups


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs from a model config. Sizes in elements, not bytes."""

    name: str
    source: str
    num_hidden_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    index_topk: int
    indexer_types: tuple[str, ...]
    indexer_types_source: str
    num_nextn_predict_layers: int
    runner: dict[str, Any] = field(default_factory=dict)   # next_n, pa_block_size, enlarge_pool_size, ...
    dims: dict[str, int] = field(default_factory=dict)     # WEIGHT_KEYS found in the file

    @property
    def groups(self) -> list[list[int]]:
        return groups_of(list(self.indexer_types))

    @property
    def n_full(self) -> int:
        return sum(t == "full" for t in self.indexer_types)

    def has_weight_dims(self) -> bool:
        return all(k in self.dims for k in WEIGHT_KEYS)


def shape_from_mapping(doc: Mapping[str, Any], name: str, source: str) -> ModelShape:
    if not isinstance(doc, Mapping):
        raise ValueError(f"config {source}: expected a yaml mapping, got {type(doc).__name__}")
    keys = _flatten(doc)
    missing = [k for k in REQUIRED_KEYS if k not in keys]
    if missing:
        raise ValueError(f"config {source}: missing required key(s) {missing} (HF glm_moe_dsa names)")
    ints = {}
    for k in REQUIRED_KEYS:
        try:
            ints[k] = int(keys[k])
        except (TypeError, ValueError):
            raise ValueError(f"config {source}: {k} must be an integer, got {keys[k]!r}") from None
        if ints[k] <= 0:
            raise ValueError(f"config {source}: {k} must be > 0, got {ints[k]}")
    types, src = derive_indexer_types(keys, ints["num_hidden_layers"])
    runner = {k: keys[k] for k in ("next_n", "pa_block_size", "enlarge_pool_size", "pa_max_length",
                                   "batch_size", "world_size", "kv_cache_quant_mode") if k in keys}
    dims = {k: int(keys[k]) for k in WEIGHT_KEYS + ("n_shared_experts", "moe_layer_freq", "num_experts_per_tok") if k in keys}
    return ModelShape(
        name=name, source=source, indexer_types=tuple(types), indexer_types_source=src,
        num_nextn_predict_layers=int(keys.get("num_nextn_predict_layers", HF_DEFAULTS["num_nextn_predict_layers"])),
        runner=runner, dims=dims, **ints)


def load_model_shape(config: str) -> ModelShape:
    """``config`` is a built-in name (``glm-5.2``), a preset (``models/configs/<name>.yaml``) or a yaml path."""
    if config in BUILTIN:
        return shape_from_mapping(BUILTIN[config], name=config,
                                  source="built-in (HF GlmMoeDsaConfig defaults + recipe runner yaml)")
    path = Path(config)
    if config in list_presets() or not (path.suffix in (".yaml", ".yml") or path.exists()):  # a preset wins
        path = configs_dir() / f"{config}.yaml"
        if not path.is_file():
            have = ", ".join(list_presets()) or "none installed"
            raise ValueError(f"--config {config!r}: not a yaml file and not a preset (presets: {have})")
    readable_file(path, "--config")  # a directory, a FIFO, a missing file: named, never read
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"--config {config!r}: not valid yaml ({e})") from None
    if not doc:  # an empty config is a mistake, not the defaults
        raise ValueError(f"--config {config!r} is empty: give HF glm_moe_dsa keys (model_config / runner_config "
                         f"sections or flat keys)")
    if not isinstance(doc, dict):
        raise ValueError(f"--config {config!r}: the top level must be a mapping, got a {type(doc).__name__}")
    return shape_from_mapping(doc, name=path.stem, source=str(path))

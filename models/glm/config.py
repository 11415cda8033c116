"""Configuration of the GLM-5.2 decode model: HF ``glm_moe_dsa`` model keys + the recipe's runner keys.

A config file (yaml) has two sections::

    model_config:   # keys named exactly as in HF transformers' GlmMoeDsaConfig (config.json)
      num_hidden_layers: 8
      index_topk: 64
      index_topk_pattern: FSSSFSSS
      ...
    runner_config:  # keys named as in the NPU recipe's yaml
      batch_size: 2
      prefill_len: 256
      ...

Unknown keys and inconsistent values raise ``ValueError`` naming the key. Presets live in
``models/configs/<name>.yaml`` (``tiny``, ``small``, ``glm-5.2-78l``, and their W8A8C16 variants
``tiny-w8a8``, ``glm-5.2-78l-w8a8`` with the recipe's ``quant_config``).

IndexShare schedule (``indexer_types``), exactly as HF ``GlmMoeDsaConfig.__post_init__``:
``indexer_types`` if given; else ``index_topk_pattern`` ("F"/"S" per layer); else
``full iff max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0`` with HF's defaults
``index_topk_freq = 1``, ``index_skip_topk_offset = 2``. When several of these are given they must agree.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

log = logging.getLogger("offload_passes.models.config")

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
from offload_passes.modes import check_exe_mode  # noqa: E402  (the one list of modes; offload_passes/modes.py imports nothing)
#: ``cache_write``: ``index_put`` (``cache.view(-1, D).index_put_``) or ``inplace`` (the reference's
#: in-place cache-write ops: MLA-prolog KV write, ``npu_scatter_nd_update_`` for the indexer cache).
CACHE_WRITES = ("index_put", "inplace")
#: torch_npu's limit on the lightning indexer's ``sparse_count``.
MAX_INDEX_TOPK = 2048
MAX_NEXT_N = 3


def _err(key: str, msg: str) -> ValueError:
    return ValueError(f"config key '{key}': {msg}")


#: Values of the recipe's quant_config keys that this model implements (first = default).
QUANT_MODES = {
    "mm_quant_mode": ("w16a16",),
    "kv_cache_quant_mode": ("unquant",),
    "li_cache_quant_mode": ("unquant", "int8"),
}
#: Values the recipe knows but this model refuses, with the reason (named in the error).
_QUANT_REFUSED = {
    ("mm_quant_mode", "w8a8"): "int8 linears are not modelled (only the indexer path is quantised: "
                               "li_cache_quant_mode 'int8'); the linears stay bf16",
    ("kv_cache_quant_mode", "int8"): "int8 ('C8') KV caches are not modelled: W8A8C16 keeps a bf16 KV cache",
    ("kv_cache_quant_mode", "float8"): "float8 KV caches are Ascend 950 only",
    ("li_cache_quant_mode", "float8"): "float8 indexer caches are Ascend 950 only (no CPU reference)",
    ("li_cache_quant_mode", "hifloat8"): "hifloat8 indexer caches are Ascend 950 only (no CPU reference)",
}


@dataclass
class QuantConfig:
    """The recipe's ``quant_config`` keys (cann-recipes-infer GLM-5: ``config.quant_config.*``).

    * ``mm_quant_mode``: ``w16a16`` (bf16 linears; the W8A8 checkpoint's int8 linears are not modelled:
      they change no DSA data flow);
    * ``kv_cache_quant_mode``: ``unquant`` (the "C16" of W8A8C16: bf16 latent / rope KV cache);
    * ``li_cache_quant_mode``: ``unquant`` or ``int8`` (Hadamard-rotated, per-token dynamic int8 indexer
      q and k, int8 indexer key cache + fp16 dequant-scale cache, ``npu_quant_lightning_indexer``).
      The recipe sets ``int8`` for every quantised checkpoint on A3.
    """

    mm_quant_mode: str = "w16a16"
    kv_cache_quant_mode: str = "unquant"
    li_cache_quant_mode: str = "unquant"

    @classmethod
    def from_any(cls, v: Any) -> Optional["QuantConfig"]:
        if v is None or isinstance(v, QuantConfig):
            return v
        if not isinstance(v, Mapping):
            raise _err("quant_config", f"must be a mapping of {sorted(QUANT_MODES)}, got {v!r}")
        for k, val in v.items():
            if k not in QUANT_MODES:
                raise _err(f"quant_config.{k}", f"unknown key (known: {sorted(QUANT_MODES)})")
            why = _QUANT_REFUSED.get((k, val))
            if why is not None:
                raise _err(f"quant_config.{k}", f"{val!r} is not supported: {why}; supported: {list(QUANT_MODES[k])}")
            if val not in QUANT_MODES[k]:
                raise _err(f"quant_config.{k}", f"must be one of {list(QUANT_MODES[k])}, got {val!r}")
        return cls(**dict(v))


@dataclass
class ModelConfig:
    """Model keys, named as in HF ``GlmMoeDsaConfig`` (defaults = the real GLM-5.2 values)."""

    model_type: str = "glm_moe_dsa"
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: Optional[int] = None
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 3
    mlp_layer_types: Optional[list] = None
    moe_layer_freq: int = 1
    kv_lora_rank: int = 512
    q_lora_rank: int = 2048
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 192
    v_head_dim: int = 256
    rope_theta: float = 8000000.0
    rope_interleave: bool = True
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    attention_bias: bool = False
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    indexer_types: Optional[list] = None
    index_topk_pattern: Optional[str] = None
    index_topk_freq: Optional[int] = None
    index_skip_topk_offset: Optional[int] = None
    indexer_rope_interleave: bool = True
    index_share_for_mtp_iteration: bool = True
    num_nextn_predict_layers: int = 0
    #: The NPU recipe's ``quant_config`` (W8A8C16: ``li_cache_quant_mode: int8``); None = unquantised.
    quant_config: Optional[Any] = None
    torch_dtype: str = "bfloat16"
    bos_token_id: Optional[Any] = None
    eos_token_id: Optional[Any] = None
    pad_token_id: Optional[Any] = None

    # ---------------------------------------------------------------- derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.torch_dtype]

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    @property
    def quant(self) -> "QuantConfig":
        """The validated ``quant_config`` (defaults = unquantised when none is given)."""
        return self.quant_config if isinstance(self.quant_config, QuantConfig) else QuantConfig()

    @property
    def li_cache_int8(self) -> bool:
        """True when the indexer cache is int8 (the indexer runs ``npu_quant_lightning_indexer``)."""
        return self.quant.li_cache_quant_mode == "int8"

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"

    def groups(self) -> list[list[int]]:
        """IndexShare groups: each "full" layer opens a group, following "shared" layers join it."""
        groups: list[list[int]] = []
        for i, t in enumerate(self.indexer_types):
            if t == "full":
                groups.append([i])
            else:
                groups[-1].append(i)
        return groups

    #: Deprecated name of ``groups`` (removed in the next release; docs/glossary.md, "Renamed").
    index_groups = groups

    # ---------------------------------------------------------------- validation
    def finalize(self) -> "ModelConfig":
        """Derive ``indexer_types`` / ``mlp_layer_types`` and check consistency (ValueError names the key)."""
        n = self.num_hidden_layers
        _positive(self, "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "n_routed_experts", "num_experts_per_tok",
                  "n_group", "topk_group", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                  "qk_nope_head_dim", "v_head_dim", "index_topk", "index_head_dim", "index_n_heads",
                  "max_position_embeddings")
        if self.model_type != "glm_moe_dsa":
            raise _err("model_type", f"must be 'glm_moe_dsa', got {self.model_type!r}")
        if self.torch_dtype not in _DTYPES:
            raise _err("torch_dtype", f"must be one of {sorted(_DTYPES)}, got {self.torch_dtype!r}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_key_value_heads != self.num_attention_heads:
            raise _err("num_key_value_heads", f"must equal num_attention_heads={self.num_attention_heads} "
                       f"(MLA), got {self.num_key_value_heads}")
        if self.n_shared_experts < 0:
            raise _err("n_shared_experts", f"must be >= 0, got {self.n_shared_experts}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise _err("num_experts_per_tok", f"must be <= n_routed_experts={self.n_routed_experts}, "
                       f"got {self.num_experts_per_tok}")
        if self.n_routed_experts % self.n_group:
            raise _err("n_group", f"must divide n_routed_experts={self.n_routed_experts}, got {self.n_group}")
        if self.topk_group > self.n_group:
            raise _err("topk_group", f"must be <= n_group={self.n_group}, got {self.topk_group}")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise _err("n_group", "needs at least 2 experts per group (group score = sum of the top-2)")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise _err("num_experts_per_tok", "exceeds the experts of the topk_group selected groups")
        if self.scoring_func != "sigmoid":
            raise _err("scoring_func", f"only 'sigmoid' is implemented, got {self.scoring_func!r}")
        if self.topk_method != "noaux_tc":
            raise _err("topk_method", f"only 'noaux_tc' is implemented, got {self.topk_method!r}")
        if self.hidden_act != "silu":
            raise _err("hidden_act", f"only 'silu' is implemented, got {self.hidden_act!r}")
        if self.attention_bias:
            raise _err("attention_bias", "must be false (GLM-5.2 has no attention bias)")
        if self.tie_word_embeddings:
            raise _err("tie_word_embeddings", "must be false (GLM-5.2 has a separate lm_head)")
        if self.rope_scaling is not None:
            raise _err("rope_scaling", "RoPE scaling is not implemented; must be null")
        if self.moe_layer_freq != 1:
            raise _err("moe_layer_freq", f"must be 1, got {self.moe_layer_freq}")
        if self.qk_rope_head_dim % 2:
            raise _err("qk_rope_head_dim", f"must be even, got {self.qk_rope_head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise _err("index_head_dim", f"must be >= qk_rope_head_dim={self.qk_rope_head_dim}, "
                       f"got {self.index_head_dim}")
        if self.index_topk > MAX_INDEX_TOPK:
            raise _err("index_topk", f"must be <= {MAX_INDEX_TOPK} (lightning indexer limit), got {self.index_topk}")
        if not 0 <= self.first_k_dense_replace <= n:
            raise _err("first_k_dense_replace", f"must be in [0, num_hidden_layers={n}], "
                       f"got {self.first_k_dense_replace}")
        if self.mlp_layer_types is None:
            self.mlp_layer_types = (["dense"] * self.first_k_dense_replace
                                    + ["sparse"] * (n - self.first_k_dense_replace))
        else:
            self.mlp_layer_types = list(self.mlp_layer_types)
            if len(self.mlp_layer_types) != n or any(t not in ("dense", "sparse") for t in self.mlp_layer_types):
                raise _err("mlp_layer_types", f"must be {n} entries of 'dense'/'sparse', got {self.mlp_layer_types}")
        self.indexer_types = _derive_indexer_types(self)
        self.quant_config = QuantConfig.from_any(self.quant_config)
        if self.quant_config is not None and self.li_cache_int8:
            d = self.index_head_dim
            if d & (d - 1):
                raise _err("index_head_dim", f"must be a power of two for li_cache_quant_mode 'int8' (Hadamard "
                           f"rotation of the indexer q/k), got {d}")
        return self


def _positive(cfg: Any, *keys: str) -> None:
    for k in keys:
        v = getattr(cfg, k)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise _err(k, f"must be a positive integer, got {v!r}")


def indexer_types_from_freq(num_layers: int, freq: int = 1, offset: int = 2) -> list[str]:
    """HF's formula: layer i is "full" iff ``max(i - offset + 1, 0) % freq == 0``."""
    freq = max(int(freq), 1)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def indexer_types_from_pattern(pattern: str) -> list[str]:
    return [{"F": "full", "S": "shared"}[c] for c in pattern]


def _derive_indexer_types(cfg: ModelConfig) -> list[str]:
    n = cfg.num_hidden_layers
    candidates: list[tuple[str, list[str]]] = []
    if cfg.indexer_types is not None:
        types = list(cfg.indexer_types)
        if len(types) != n or any(t not in ("full", "shared") for t in types):
            raise _err("indexer_types", f"must be {n} entries of 'full'/'shared', got {types}")
        candidates.append(("indexer_types", types))
    if cfg.index_topk_pattern is not None:
        p = cfg.index_topk_pattern
        if not isinstance(p, str) or len(p) != n or set(p) - {"F", "S"}:
            raise _err("index_topk_pattern", f"must be a string of {n} 'F'/'S' characters, got {p!r}")
        candidates.append(("index_topk_pattern", indexer_types_from_pattern(p)))
    if cfg.index_topk_freq is not None or cfg.index_skip_topk_offset is not None:
        freq = 1 if cfg.index_topk_freq is None else cfg.index_topk_freq
        offset = 2 if cfg.index_skip_topk_offset is None else cfg.index_skip_topk_offset
        if isinstance(freq, bool) or not isinstance(freq, int) or freq <= 0:
            raise _err("index_topk_freq", f"must be a positive integer, got {freq!r}")
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise _err("index_skip_topk_offset", f"must be an integer, got {offset!r}")
        candidates.append(("index_topk_freq/index_skip_topk_offset", indexer_types_from_freq(n, freq, offset)))
    if not candidates:
        candidates.append(("index_topk_freq/index_skip_topk_offset (HF defaults)", indexer_types_from_freq(n)))
    name0, types0 = candidates[0]
    for name, types in candidates[1:]:
        if types != types0:
            bad = next(i for i in range(n) if types[i] != types0[i])
            raise _err(name, f"disagrees with {name0} at layer {bad}: {types[bad]!r} vs {types0[bad]!r}")
    if types0[0] != "full":
        raise _err(name0.split("/")[0], "layer 0 must be 'full' (a shared layer needs a previous full layer)")
    return types0


@dataclass
class RunnerConfig:
    """Runner keys, named as in the NPU recipe's yaml.

    ``shared_indexer_offload``, ``enlarge_pool_size`` and ``exe_mode`` are carried for the offload
    backend (pool size 8192 / 16384, execution mode); the model itself never reads them — it always
    builds the unmodified graph (``enable_offload`` picks basic offload vs non-offload).
    """

    batch_size: int = 1
    prefill_len: int = 256
    decode_steps: int = 32
    next_n: int = 0
    pa_block_size: int = 128
    pa_max_length: int = 2048
    enable_offload: bool = False
    shared_indexer_offload: bool = False
    enlarge_pool_size: bool = False
    exe_mode: str = "eager"
    seed: int = 0
    cache_write: str = "index_put"

    @property
    def seq_per_step(self) -> int:
        """S = 1 + next_n query tokens per batch row and decode step."""
        return 1 + self.next_n

    @property
    def cache_len(self) -> int:
        """Blocks per batch row of the full (PA) cache: ``pa_max_length // pa_block_size``."""
        return self.pa_max_length // self.pa_block_size

    def finalize(self, model: ModelConfig) -> "RunnerConfig":
        for k in ("batch_size", "prefill_len", "pa_block_size", "pa_max_length"):
            _positive(self, k)
        for k in ("decode_steps", "next_n", "seed"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise _err(k, f"must be a non-negative integer, got {v!r}")
        for k in ("enable_offload", "shared_indexer_offload", "enlarge_pool_size"):
            if not isinstance(getattr(self, k), bool):
                raise _err(k, f"must be true/false, got {getattr(self, k)!r}")
        if self.next_n > MAX_NEXT_N:
            raise _err("next_n", f"must be in [0, {MAX_NEXT_N}] (S = 1 + next_n <= 4), got {self.next_n}")
        if self.enable_offload and model.torch_dtype not in ("bfloat16",):
            raise _err("torch_dtype", "enable_offload needs a bfloat16 model: custom.npu_gather_selection_kv_cache "
                       f"copies only float16/bfloat16/int8 caches, got {model.torch_dtype!r}")
        check_exe_mode(self.exe_mode, name="config key 'exe_mode':")
        if self.cache_write not in CACHE_WRITES:
            raise _err("cache_write", f"must be one of {CACHE_WRITES}, got {self.cache_write!r}")
        if self.pa_max_length % self.pa_block_size:
            raise _err("pa_max_length", f"must be a multiple of pa_block_size={self.pa_block_size}, "
                       f"got {self.pa_max_length}")
        if model.index_topk % self.pa_block_size:
            raise _err("pa_block_size", f"must divide index_topk={model.index_topk} (selection buffers hold "
                       f"K/pa_block_size blocks per query row), got {self.pa_block_size}")
        need = self.prefill_len + self.decode_steps * self.seq_per_step
        if need > self.pa_max_length:
            raise _err("pa_max_length", f"must hold prefill_len + decode_steps * (1 + next_n) = {need} tokens, "
                       f"got {self.pa_max_length}")
        if need > model.max_position_embeddings:
            raise _err("max_position_embeddings", f"must be >= {need} (prefill + decode tokens), "
                       f"got {model.max_position_embeddings}")
        return self


@dataclass
class GlmConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)

    def to_dict(self) -> dict:
        return {"model_config": dataclasses.asdict(self.model), "runner_config": dataclasses.asdict(self.runner)}


_MODEL_KEYS = {f.name for f in dataclasses.fields(ModelConfig)}
_RUNNER_KEYS = {f.name for f in dataclasses.fields(RunnerConfig)}
#: HF config.json keys accepted and ignored by ``ModelConfig.from_hf`` (bookkeeping, not architecture).
HF_IGNORED_KEYS = frozenset({
    "architectures", "transformers_version", "auto_map", "use_cache", "head_dim", "qk_head_dim",
    "ep_size", "layer_types", "output_indexer_scores", "indexer_loss_coef", "indexer_dense_warmup",
    "quantization_config", "moe_router_dtype", "mlp_bias", "_name_or_path",
})


def _split_overrides(overrides: Mapping[str, Any]) -> tuple[dict, dict]:
    m, r = {}, {}
    for k, v in overrides.items():
        if k in _MODEL_KEYS:
            m[k] = v
        elif k in _RUNNER_KEYS:
            r[k] = v
        elif k == "dtype":
            m["torch_dtype"] = v
        else:
            raise ValueError(f"config key '{k}': unknown key (not a glm_moe_dsa model key nor a runner key)")
    return m, r


def _model_from_mapping(d: Mapping[str, Any], section: str) -> dict:
    out = {}
    for k, v in d.items():
        if k == "dtype":  # newer HF config.json spelling
            k = "torch_dtype"
        if k not in _MODEL_KEYS:
            raise ValueError(f"config key '{section}.{k}': unknown model key (expected HF glm_moe_dsa names)")
        out[k] = v
    return out


def preset_path(name: str) -> Path:
    p = CONFIG_DIR / f"{name}.yaml"
    if not p.exists():
        known = sorted(x.stem for x in CONFIG_DIR.glob("*.yaml"))
        raise ValueError(f"config preset '{name}': unknown (known presets: {known})")
    return p


def list_presets() -> list[str]:
    return sorted(x.stem for x in CONFIG_DIR.glob("*.yaml"))


def load_config(preset_or_path: Union[str, Path, Mapping[str, Any]], **overrides: Any) -> GlmConfig:
    """Load a preset name (``tiny``), a yaml path, or an already-parsed mapping; apply overrides.

    Overrides may be any model or runner key (``next_n=3``, ``enable_offload=True``,
    ``torch_dtype="float32"``). Raises ``ValueError`` naming the key on unknown keys / bad values.
    """
    import yaml

    if isinstance(preset_or_path, Mapping):
        data = dict(preset_or_path)
    else:
        s = str(preset_or_path)
        # a preset name wins over a file or folder of the same name in the working folder
        is_path = not (isinstance(preset_or_path, str) and s in list_presets()) and (
            s.endswith((".yaml", ".yml")) or Path(s).exists())
        path = Path(s) if is_path else preset_path(s)
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    if not isinstance(data, Mapping):
        raise ValueError("config: top level must be a mapping with 'model_config' and 'runner_config'")
    for k in data:
        if k not in ("model_config", "runner_config"):
            raise ValueError(f"config key '{k}': unknown section (expected 'model_config', 'runner_config')")
    mdict = _model_from_mapping(data.get("model_config") or {}, "model_config")
    rdict = {}
    for k, v in (data.get("runner_config") or {}).items():
        if k not in _RUNNER_KEYS:
            raise ValueError(f"config key 'runner_config.{k}': unknown runner key (known: {sorted(_RUNNER_KEYS)})")
        rdict[k] = v
    mo, ro = _split_overrides(overrides)
    mdict.update(mo)
    rdict.update(ro)
    model = ModelConfig(**mdict).finalize()
    runner = RunnerConfig(**rdict).finalize(model)
    return GlmConfig(model=model, runner=runner)


def model_config_from_hf(config_json: Union[str, Path, Mapping[str, Any]], **overrides: Any) -> ModelConfig:
    """Read an HF ``config.json`` of a ``glm_moe_dsa`` checkpoint (bookkeeping keys are ignored)."""
    import json

    if isinstance(config_json, Mapping):
        d = dict(config_json)
    else:
        p = Path(config_json)
        if p.is_dir():
            p = p / "config.json"
        d = json.loads(p.read_text())
    d = {k: v for k, v in d.items() if k not in HF_IGNORED_KEYS}
    rope = d.pop("rope_parameters", None)
    if rope is not None:  # newer HF spelling: {"rope_type": "default", "rope_theta": ...}
        if not isinstance(rope, Mapping) or rope.get("rope_type", "default") != "default":
            raise _err("rope_parameters", f"only the default RoPE type is implemented, got {rope!r}")
        if "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
    m = _model_from_mapping(d, "config.json")
    m.update(overrides)
    return ModelConfig(**m).finalize()

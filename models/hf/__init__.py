"""Adapter for an *unmodified* Hugging Face ``transformers`` DSA model (``GlmMoeDsaForCausalLM``, model
type ``glm_moe_dsa``, by default; a preset's ``model_type`` picks another family, ``families.py``): presets,
random initialisation (no weights download; or a local
``from_pretrained`` directory), a ``StaticCache`` decode driver and a synthetic long context.

Never imports the passes. Needs the ``hf`` extra (``pip install .[hf]``).

    from offload_passes.models import hf
    b = hf.build("hf-tiny", attn="sdpa")          # preset name or yaml path; any model / runner key as override
    b.model                                       # GlmMoeDsaForCausalLM (eval, random init, seeded)
    dec = b.decoder()                             # StaticCache of max_cache_len, batch_size rows
    dec.prefill()                                 # deterministic prompt of prefill_len tokens (eager, dense)
    logits = dec.step(step_fn)                    # one decode step (S = 1) through step_fn (default: the model)
    res = b.run(step_fn, steps=64)                # prefill + steps, teacher-forced tokens -> list of logits
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
import yaml

from offload_passes import _compat

from . import families

log = logging.getLogger("offload_passes.models.hf")

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
RUNNER_KEYS = ("batch_size", "prefill_len", "max_cache_len", "decode_steps", "dtype", "attn_implementation", "seed",
               "cache", "fullgraph")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: the transformers releases this adapter and the HF pass are verified against (setup.py's ``hf`` extra allows
#: 5.23 to 5.25; scripts/setup.sh installs 5.25.0; tests/hf run on both)
TRANSFORMERS_VERIFIED = ("5.23.0", "5.25.0")


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - the [hf] extra is part of the documented set-up
        raise ImportError("the Hugging Face adapter needs transformers: pip install 'offload_passes[hf]'") from e
    return transformers


def list_presets() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("hf-*.yaml"))


@dataclass
class HfRunner:
    batch_size: int = 2
    prefill_len: int = 96
    max_cache_len: int = 192
    decode_steps: int = 64
    dtype: str = "float32"
    attn_implementation: str = "eager"
    seed: int = 0
    # "static": a StaticCache (one decode graph); "dynamic": transformers' DynamicCache, for a model whose
    # cache layers StaticCache cannot hold (deepseek_v4's compressor state); it recompiles as the cache grows
    cache: str = "static"
    # False for a model whose decode step Dynamo cannot trace into one graph (transformers' own data-dependent
    # branches: qwen4_exp, kolibri1_1); the demo then compiles it with graph breaks (fullgraph=False)
    fullgraph: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"runner dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.attn_implementation not in ("eager", "sdpa"):
            raise ValueError(f"attn_implementation must be 'eager' or 'sdpa', got {self.attn_implementation!r}")
        if self.cache not in ("static", "dynamic"):
            raise ValueError(f"runner cache must be 'static' or 'dynamic', got {self.cache!r}")
        if not isinstance(self.fullgraph, bool):
            raise ValueError(f"runner fullgraph must be true or false, got {self.fullgraph!r}")
        for k in ("batch_size", "prefill_len", "max_cache_len"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"runner {k} must be >= 1, got {getattr(self, k)}")
        if self.prefill_len + self.decode_steps > self.max_cache_len:
            raise ValueError(f"prefill_len + decode_steps = {self.prefill_len + self.decode_steps} exceeds "
                             f"max_cache_len = {self.max_cache_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def load_config(config: Union[str, Path, Mapping], **over: Any) -> tuple[Any, HfRunner]:
    """``(GlmMoeDsaConfig, HfRunner)`` from a preset name (``hf-tiny``), a yaml path or a mapping with
    ``model_config`` / ``runner_config``; keyword overrides go to whichever section knows the key."""
    _transformers()  # the [hf] extra's import error, before any yaml is read
    if isinstance(config, Mapping):
        raw = dict(config)
    else:
        p = Path(config)
        if not p.suffix:
            p = CONFIG_DIR / f"{config}.yaml"
            if not p.exists():
                raise ValueError(f"unknown HF preset {config!r}; presets: {list_presets()}")
        raw = yaml.safe_load(p.read_text())
    mc = dict(raw.get("model_config", {}))
    rc = dict(raw.get("runner_config", {}))
    for k, v in over.items():
        (rc if k in RUNNER_KEYS else mc)[k] = v
    runner = HfRunner(**rc)
    # the config class comes from the preset's model_type (models/hf/families.py); glm_moe_dsa by default
    cfg = families.make_config(raw.get("model_type", families.DEFAULT_MODEL_TYPE), mc)
    families.set_attn_implementation(cfg, families.model_class(cfg), runner.attn_implementation)
    if "experts_implementation" not in mc and not _compat.hf_grouped_mm_traceable_on_cpu():
        # torch <= 2.10 (2.8, 2.10): under torch.compile on CPU, transformers' grouped_mm experts path checks
        # data_ptr() alignment, which Dynamo cannot trace (Unsupported: builtin mod), and "eager" uses nonzero
        # (data-dependent shapes). batched_mm traces with static shapes.
        cfg._experts_implementation = "batched_mm"
    return cfg, runner


@dataclass
class HfBuilt:
    model: Any
    config: Any
    runner: HfRunner
    # The decoder of the last run(), kept until the next one: its StaticCache owns whatever a compiler
    # attached to it (an offload state lives as long as the caches it serves), so it can be read after
    # run() returns. Without it the caches die with run() on torch 2.10 and live on by accident on 2.13.
    last_decoder: Optional["HfDecoder"] = field(default=None, repr=False, compare=False)

    def decoder(self, batch_size: Optional[int] = None, max_cache_len: Optional[int] = None) -> "HfDecoder":
        return HfDecoder(self.model, self.config, self.runner, batch_size or self.runner.batch_size,
                         max_cache_len or self.runner.max_cache_len)

    def run(self, step_fn: Optional[Callable] = None, steps: Optional[int] = None) -> list[torch.Tensor]:
        """Prefill (eager) + ``steps`` teacher-forced decode steps through ``step_fn``; the logits per step."""
        self.last_decoder = None  # the previous run's caches go before this run allocates its own
        dec = self.decoder()
        dec.prefill()
        self.last_decoder = dec
        return [dec.step(step_fn) for _ in range(self.runner.decode_steps if steps is None else steps)]


def build(config: Union[str, Path, Mapping] = "hf-tiny", weights: Optional[str] = None, attn: Optional[str] = None,
          **over: Any) -> HfBuilt:
    """The unmodified HF model: seeded random init (no download), or ``weights`` = a local
    ``from_pretrained`` directory. ``attn`` overrides ``attn_implementation`` (eager / sdpa)."""
    if attn is not None:
        over["attn_implementation"] = attn
    cfg, runner = load_config(config, **over)
    cls = families.model_class(cfg)
    if weights is not None:
        model = cls.from_pretrained(weights, config=cfg, torch_dtype=runner.torch_dtype, local_files_only=True)
    else:
        torch.manual_seed(runner.seed)
        model = cls(cfg).to(runner.torch_dtype)
    model.eval()
    return HfBuilt(model, cfg, runner)


@dataclass
class HfDecoder:
    """Decode driver over a ``StaticCache`` (the static-shape cache: one decode graph, no recompiles)."""

    model: Any
    config: Any
    runner: HfRunner
    batch_size: int
    max_cache_len: int
    pos: int = 0
    tokens: torch.Tensor = field(init=False)
    cache: Any = field(init=False)

    def __post_init__(self) -> None:
        tf = _transformers()
        if self.runner.cache == "dynamic":
            self.cache = tf.DynamicCache(config=self.config)
        else:
            self.cache = tf.StaticCache(config=self.config, max_cache_len=self.max_cache_len,
                                        max_batch_size=self.batch_size)
        g = torch.Generator().manual_seed(self.runner.seed + 1)
        # deterministic token stream, the same for every model built from one preset (teacher forcing)
        vocab = families.text_config(self.config).vocab_size
        self.tokens = torch.randint(0, vocab, (self.batch_size, self.max_cache_len), generator=g)

    def cache_kwargs(self) -> dict:
        """``{name: cache}`` with the cache argument's name of the installed transformers (``past_key_values``
        up to 5.23, ``cache`` from 5.24: ``_compat.hf_cache_kwarg``)."""
        return {_compat.hf_cache_kwarg(): self.cache}

    @torch.no_grad()
    def prefill(self, length: Optional[int] = None) -> torch.Tensor:
        n = self.runner.prefill_len if length is None else length
        if not 0 < n <= self.max_cache_len:
            raise ValueError(f"prefill length must be in [1, max_cache_len={self.max_cache_len}], got {n}")
        out = self.model(self.tokens[:, :n], use_cache=True, **self.cache_kwargs())
        self.pos = n
        return out.logits

    @torch.no_grad()
    def step(self, step_fn: Optional[Callable] = None) -> torch.Tensor:
        """One decode step at position ``pos`` (S = 1); returns the logits ``[B, 1, V]``."""
        if self.pos >= self.max_cache_len:
            raise ValueError(f"cache full: position {self.pos} >= max_cache_len {self.max_cache_len}")
        fn = self.model if step_fn is None else step_fn
        ids = self.tokens[:, self.pos:self.pos + 1]
        pos = torch.full((self.batch_size, 1), self.pos, dtype=torch.long)
        out = fn(ids, use_cache=True, position_ids=pos, **self.cache_kwargs())
        self.pos += 1
        return out.logits

    @torch.no_grad()
    def synthetic_context(self, length: int, seed: int = 0) -> None:
        """Make the cache look like ``length`` tokens were already processed, without a prefill:
        a one-token prefill initialises the static buffers, then every latent / rope / indexer row
        below ``length`` is seeded random data and the cache counters are set to ``length``.
        (Benchmarks at 32K context; the decode step's cost does not depend on where the rows came from.)"""
        if not 1 <= length < self.max_cache_len:
            raise ValueError(f"context length must be in [1, max_cache_len={self.max_cache_len}), got {length}")
        self.prefill(1)
        g = torch.Generator().manual_seed(seed)
        for layer in self.cache.layers:
            for name in ("keys", "values", "indexer_keys"):
                t = getattr(layer, name, None)
                if t is None:
                    continue
                seq_dim = 2 if t.dim() == 4 else 1
                src = torch.randn(t.narrow(seq_dim, 0, length).shape, generator=g).to(t.dtype)
                t.narrow(seq_dim, 0, length).copy_(src)
            for name in ("cumulative_length", "indexer_cumulative_length"):
                c = getattr(layer, name, None)
                if isinstance(c, torch.Tensor):
                    c.fill_(length)
        self.pos = length


__all__ = ["HfBuilt", "HfDecoder", "HfRunner", "build", "list_presets", "load_config", "TRANSFORMERS_VERIFIED"]

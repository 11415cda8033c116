"""Backend options (``OffloadOptions``): keyword options or the recipe's yaml keys.

Recipe keys understood (anywhere in the yaml, nested sections are searched): ``enable_offload``,
``shared_indexer_offload``, ``enlarge_pool_size``, ``pa_block_size``, ``next_n``, ``exe_mode``.
``pa_block_size`` and ``next_n`` are *expectations*: the graph decides the real values, and a
mismatch is refused (the graph is compiled unmodified) rather than silently trusted.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

DEFAULT_POOL_SIZE = 8192
LARGE_POOL_SIZE = 16384
MAX_POOL_SIZE = 16384
WAYS = 16
MIN_ID_RANGE = 131072
EXE_MODES = ("eager", "inductor", "npugraph_ex", "ge_graph")
CPU_EXE_MODES = ("eager", "inductor")

RECIPE_KEYS = ("enable_offload", "shared_indexer_offload", "enlarge_pool_size", "pa_block_size", "next_n",
               "exe_mode")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class OffloadOptions:
    """Options of the ``dsa_offload`` backend.

    pool_size: pool slots per batch row (PS); ``None`` = 8192, or 16384 with ``enlarge_pool_size``.
    exe_mode: ``eager`` (default) or ``inductor`` on CPU; the NPU modes live in ``npu_modes.py``.
    dump_dir: write graphs before/after each pass and ``report.json`` there (env ``OFFLOAD_PASSES_DUMP``).
    strict: raise ``RuntimeError`` on any refusal instead of compiling the graph unmodified.
    id_range: ``id_to_slot`` width (IR); ``None`` = max(131072, cache length F).
    update_ledger: keep the model's gather ledger (``sel_status``) valid after serve.
    """

    pool_size: int | None = None
    enlarge_pool_size: bool = False
    exe_mode: str = "eager"
    dump_dir: str | None = None
    strict: bool = False
    id_range: int | None = None
    enable_offload: bool = True
    shared_indexer_offload: bool = True
    pa_block_size: int | None = None
    next_n: int | None = None
    update_ledger: bool = True
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        ps = self.resolved_pool_size
        if not isinstance(ps, int) or ps <= 0 or ps > MAX_POOL_SIZE:
            raise ValueError(f"pool_size must be in (0, {MAX_POOL_SIZE}], got {ps}")
        if ps % WAYS:
            raise ValueError(f"pool_size must be a multiple of {WAYS} (16-way sets), got {ps}")
        if not _pow2(ps // WAYS):
            raise ValueError(f"pool_size/16 (number of sets) must be a power of two, got pool_size={ps}")
        if self.exe_mode not in EXE_MODES:
            raise ValueError(f"exe_mode must be one of {EXE_MODES}, got {self.exe_mode!r}")
        if self.id_range is not None and self.id_range <= 0:
            raise ValueError(f"id_range must be > 0, got {self.id_range}")
        if self.next_n is not None and not 0 <= self.next_n <= 3:
            raise ValueError(f"next_n must be in [0, 3] (raw_seq = 1 + next_n <= 4), got {self.next_n}")
        if self.pa_block_size is not None and not (_pow2(self.pa_block_size) and 16 <= self.pa_block_size <= 128):
            raise ValueError(f"pa_block_size must be a power of two in [16, 128], got {self.pa_block_size}")

    @property
    def resolved_pool_size(self) -> int:
        if self.pool_size is not None:
            return self.pool_size
        return LARGE_POOL_SIZE if self.enlarge_pool_size else DEFAULT_POOL_SIZE

    @property
    def resolved_dump_dir(self) -> str | None:
        return self.dump_dir or os.environ.get("OFFLOAD_PASSES_DUMP") or None

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        d["resolved_pool_size"] = self.resolved_pool_size
        return d

    def replace(self, **kw: Any) -> "OffloadOptions":
        return dataclasses.replace(self, **kw)

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def from_any(cls, config: "OffloadOptions | Mapping | str | Path | None" = None, **kw: Any) -> "OffloadOptions":
        """From an ``OffloadOptions``, a dict of options / recipe keys, a yaml path, plus keyword overrides."""
        if isinstance(config, OffloadOptions):
            base = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        elif config is None:
            base = {}
        elif isinstance(config, (str, Path)):
            base = cls._from_yaml_dict(_load_yaml(config))
        elif isinstance(config, Mapping):
            base = cls._from_yaml_dict(config)
        else:
            raise ValueError(f"config must be OffloadOptions, a mapping or a yaml path, got {type(config).__name__}")
        base.update(kw)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(base) - names)
        if unknown:
            raise ValueError(f"unknown offload option(s) {unknown}; known: {sorted(names - {'extra'})}")
        return cls(**base)

    @classmethod
    def from_yaml(cls, path: str | Path, **kw: Any) -> "OffloadOptions":
        return cls.from_any(Path(path), **kw)

    @classmethod
    def _from_yaml_dict(cls, data: Mapping) -> dict:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        out: dict = {}
        top_level = {k: v for k, v in data.items() if not isinstance(v, Mapping)}
        # option names at top level win; recipe keys may sit in nested sections (model_config ...)
        for k, v in _walk(data):
            if k in RECIPE_KEYS and k not in out:
                out[k] = v
        for k, v in top_level.items():
            if k in names:
                out[k] = v
        if "exe_mode" in out and out["exe_mode"] not in EXE_MODES:
            raise ValueError(f"exe_mode must be one of {EXE_MODES}, got {out['exe_mode']!r}")
        return out


def _walk(data: Mapping):
    for k, v in data.items():
        if isinstance(v, Mapping):
            yield from _walk(v)
        else:
            yield k, v


def _load_yaml(path: str | Path) -> Mapping:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config yaml {str(p)!r} does not exist")
    with open(p) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, Mapping):
        raise ValueError(f"config yaml {str(p)!r} must hold a mapping at top level")
    return data

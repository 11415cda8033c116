"""Backend options (``OffloadOptions``): keyword options or the recipe's yaml keys.

Recipe keys understood (anywhere in the yaml, nested sections are searched): ``enable_offload``,
``shared_indexer_offload``, ``enlarge_pool_size``, ``pa_block_size``, ``next_n``, ``exe_mode``.
``pa_block_size`` and ``next_n`` are *expectations*: the graph decides the real values, and a
mismatch is refused (the graph is compiled unmodified) rather than silently trusted.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .custom_ops import spec_for
from .custom_ops._library import is_pow2
from .custom_ops._pool import pool_size_problem

_INSTALL = spec_for("dsa_install")  # the pool's limits are the install's (its OpSpec)
DEFAULT_POOL_SIZE = 8192
LARGE_POOL_SIZE = 16384
MAX_POOL_SIZE = _INSTALL.limit("MAX_POOL")
WAYS = _INSTALL.limit("WAYS")
MAX_NEXT_N = _INSTALL.limit("MAX_RAW_SEQ") - 1  # raw_seq = 1 + next_n
#: id_to_slot is [B, id_range] int32 per group: bounded by the install kernel's limit (1.4 M ids, 5.4 MiB a row)
MAX_ID_RANGE = _INSTALL.limit("MAX_ID_RANGE")
from .modes import MODES, check_exe_mode, check_replacement_policy  # noqa: E402  (modes.py: the one list of each)

RECIPE_KEYS = ("enable_offload", "shared_indexer_offload", "enlarge_pool_size", "pa_block_size", "next_n",
               "exe_mode")


@dataclass(frozen=True)
class OffloadOptions:
    """Options of the ``dsa_offload`` backend.

    pool_size: pool slots per batch row (PS); ``None`` = 8192, or 16384 with ``enlarge_pool_size``.
    exe_mode: ``eager`` (default) or ``inductor`` on CPU; the NPU modes live in ``lowering/npu.py``.
    dump_dir: write graphs before/after each pass and ``report.json`` there (env ``OFFLOAD_PASSES_DUMP``).
    strict: raise ``RuntimeError`` on any refusal instead of compiling the graph unmodified.
    id_range: ``id_to_slot`` width (IR); ``None`` = max(131072, cache length F) (``custom_ops/_pool.py``:
        ``id_range_for``).
    update_ledger: keep the model's gather ledger (``sel_status``) valid after serve.
    replacement_policy: ``fifo`` (CANN's 16-way set-associative FIFO) or ``second_chance`` (CPU and CUDA
        modes, one reference bit per way); ``None``: the mode's default (:attr:`resolved_replacement_policy`).
    npu_bookkeeping: keep the per-step pool statistics and the ledger update in the NPU modes' graphs (off by
        default there: main-stream work the reference does not do; always on elsewhere).
    cuda_graphs: ``exe_mode="cuda"`` only: capture each lowered step in one CUDA graph per input signature
        and replay it, as ``torch.compile(mode="reduce-overhead")`` does there.
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
    npu_bookkeeping: bool = False
    replacement_policy: str | None = None
    cuda_graphs: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        _check_types(self)
        ps = self.resolved_pool_size
        problem = pool_size_problem(ps)
        if problem is not None:
            raise ValueError(f"option pool_size {problem[0]}, got {problem[1]}")
        check_exe_mode(self.exe_mode, name="option exe_mode")
        if self.id_range is not None and self.id_range <= 0:
            raise ValueError(f"option id_range must be > 0, got {self.id_range}")
        if self.id_range is not None and self.id_range > MAX_ID_RANGE:
            raise ValueError(f"option id_range must be <= {MAX_ID_RANGE} (custom::dsa_install's MAX_ID_RANGE: "
                             f"id_to_slot is [B, id_range] int32 per group), got {self.id_range}")
        if self.next_n is not None and not 0 <= self.next_n <= MAX_NEXT_N:
            raise ValueError(f"option next_n must be in [0, {MAX_NEXT_N}] (raw_seq = 1 + next_n <= "
                             f"{MAX_NEXT_N + 1}), got {self.next_n}")
        if self.pa_block_size is not None and not (is_pow2(self.pa_block_size) and 16 <= self.pa_block_size <= 128):
            raise ValueError(f"option pa_block_size must be a power of two in [16, 128], got {self.pa_block_size}")
        check_replacement_policy(self.resolved_replacement_policy, self.exe_mode, name="option replacement_policy")
        if self.cuda_graphs and self.exe_mode != "cuda":
            raise ValueError(f"option cuda_graphs applies to exe_mode='cuda' only, got exe_mode={self.exe_mode!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, str):  # a PathLike: keep it as text
            object.__setattr__(self, "dump_dir", os.fspath(self.dump_dir))

    @property
    def resolved_pool_size(self) -> int:
        if self.pool_size is not None:
            return self.pool_size
        return LARGE_POOL_SIZE if self.enlarge_pool_size else DEFAULT_POOL_SIZE

    @property
    def resolved_replacement_policy(self) -> str:
        """The policy the rewrite installs with: the option, or the mode's default (``modes.Mode.default_policy``)."""
        if self.replacement_policy is not None:
            return self.replacement_policy
        return MODES[self.exe_mode].default_policy

    @property
    def resolved_dump_dir(self) -> str | None:
        return self.dump_dir or os.environ.get("OFFLOAD_PASSES_DUMP") or None

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        d["resolved_pool_size"] = self.resolved_pool_size
        d["resolved_replacement_policy"] = self.resolved_replacement_policy
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
        _known({k: v for k, v in base.items() if k != "extra"}, _option_names(cls), "")
        return cls(**base)

    @classmethod
    def from_yaml(cls, path: str | Path, **kw: Any) -> "OffloadOptions":
        return cls.from_any(Path(path), **kw)

    @classmethod
    def _from_yaml_dict(cls, data: Mapping) -> dict:
        """Options from a mapping: a flat mapping of option names (every key must be known), or the
        recipe's yaml (sections such as ``model_config``): then the recipe keys are read wherever they
        sit, option names at top level too, and an ``offload_passes:`` section holds our options."""
        names = _option_names(cls)
        if not any(isinstance(v, Mapping) for v in data.values()):
            return _known(dict(data), names, "")
        out: dict = {}
        for path, v in _walk({k: v for k, v in data.items() if k != OWN_SECTION}):
            k = path[-1]
            if k in RECIPE_KEYS:
                if k not in out:
                    out[k] = v
            elif len(path) > 1 and (close := _near_recipe_key(k)):
                # a section holds many settings that are not ours; one a typo away from a recipe key is a
                # typo (it would be silently ignored and the backend would run with the default)
                raise ValueError(f"unknown recipe key {'.'.join(map(str, path))!r} (did you mean {close!r}?)")
        for k, v in data.items():
            if isinstance(v, Mapping):
                continue
            if k in names:
                out[k] = v
            else:  # other recipe settings (model_path, world_size ...) are not ours, but a near-miss of
                # one of our names is a typo, not a recipe setting
                close = difflib.get_close_matches(str(k), names, n=1, cutoff=0.85)
                if close:
                    raise ValueError(f"unknown offload option {k!r} (did you mean {close[0]!r}?)")
        own = data.get(OWN_SECTION)
        if own is not None:
            if not isinstance(own, Mapping):
                raise ValueError(f"the {OWN_SECTION!r} section must be a mapping of option names")
            out.update(_known(dict(own), names, f" in section {OWN_SECTION!r}"))
        return out


#: A recipe yaml may carry our own options in a section of this name.
OWN_SECTION = "offload_passes"


def _option_names(cls: type) -> list[str]:
    return sorted(f.name for f in dataclasses.fields(cls) if f.name != "extra")


def _known(d: dict, names: list[str], where: str) -> dict:
    unknown = sorted(set(d) - set(names), key=str)
    if unknown:
        hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(str(k), names, n=1)) else repr(k)
                 for k in unknown]
        raise ValueError(f"unknown offload option(s){where}: {', '.join(hints)}; known options: {names}")
    return d


def _check_types(opts: "OffloadOptions") -> None:
    """Type-check every field against its annotation (``bool``, ``int``, ``str``, ``X | None``), so a yaml
    string ``"false"`` or a float ``1.5`` fails here, naming the option, instead of misbehaving later."""
    hints = typing.get_type_hints(type(opts))
    for f in dataclasses.fields(opts):
        if f.name == "extra":
            continue
        v = getattr(opts, f.name)
        allowed = typing.get_args(hints[f.name]) or (hints[f.name],)
        if v is None and type(None) in allowed:
            continue
        ok = False
        for t in allowed:
            if t is bool:
                ok = ok or isinstance(v, bool)
            elif t is int:
                ok = ok or (isinstance(v, int) and not isinstance(v, bool))
            elif t is str:
                ok = ok or isinstance(v, str) or (f.name == "dump_dir" and isinstance(v, os.PathLike))
            elif t is float:
                ok = ok or (isinstance(v, (int, float)) and not isinstance(v, bool))
            elif isinstance(t, type) and t is not type(None):
                ok = ok or isinstance(v, t)
        if not ok:
            want = " or ".join("None" if t is type(None) else getattr(t, "__name__", str(t)) for t in allowed)
            raise ValueError(f"option {f.name} must be {want}, got {type(v).__name__} {v!r}")


def _walk(data: Mapping, prefix: tuple = ()):
    """``(path of keys, value)`` of every leaf of a nested mapping."""
    for k, v in data.items():
        if isinstance(v, Mapping):
            yield from _walk(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def _edits(a: str, b: str) -> int:
    """Edit distance with adjacent transpositions (optimal string alignment)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[-1][-1]


def _near_recipe_key(key: Any) -> str | None:
    """The recipe key ``key`` is a typo of: at most 2 edits (1 for the short ``next_n``). Stricter than
    ``difflib``: the recipe's own settings (``enable_kv_offload``-like names, ``block_size``, ...) are
    3+ edits away from ours and must pass."""
    if not isinstance(key, str):
        return None
    for known in RECIPE_KEYS:
        if _edits(key, known) <= (1 if len(known) <= 6 else 2):
            return known
    return None


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

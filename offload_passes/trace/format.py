"""Top-k trace files (``.npz``): what the indexer selected, per IndexShare group and decode step.

Format ``offload_passes.trace`` version 1 — a NumPy ``.npz`` with three named arrays:

* ``header``  0-d unicode array holding a JSON object: ``format``, ``version``, ``model`` (preset or
  description), ``source`` (``"model"``: unmodified model / gather path; ``"compiled"``: the ``dsa_plan``
  inputs of a compiled run; ``"synthetic"``), ``K`` (top-k width the kernels saw), ``P`` (ranked columns
  stored, ``P >= K``), ``S`` (query tokens per row and step), ``B``, ``steps``, ``groups`` (layers per
  group, owner first) and ``ranked`` (true when columns are in descending score order, so columns
  ``K..P-1`` are ranks beyond the top-k).
* ``topk``    int32 ``[steps, G, B, S, P]``: ids, suffix-padded with -1 (columns ``0..K-1`` are exactly
  the top-k handed to ``dsa_plan`` / the gather op).
* ``lengths`` int32 ``[steps, B]``: cache length *including* the step's S tokens (``full_kv_actual_seq``).

``load_trace`` also accepts the ``torch.save`` dict of ``models.glm.driver.Driver.save_trace``.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np

log = logging.getLogger("offload_passes.trace.format")

FORMAT = "offload_passes.trace"
VERSION = 1


@dataclass
class Trace:
    """One trace in memory (arrays as described in the module docstring)."""

    topk: np.ndarray                # int32 [T, G, B, S, P]
    lengths: np.ndarray             # int32 [T, B]
    K: int
    groups: list = field(default_factory=list)
    model: str = "unknown"
    source: str = "model"
    ranked: bool = True
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.topk = np.ascontiguousarray(self.topk, dtype=np.int32)
        self.lengths = np.ascontiguousarray(self.lengths, dtype=np.int32)
        if self.topk.ndim != 5:
            raise ValueError(f"trace topk must be [steps, G, B, S, P], got shape {self.topk.shape}")
        T, G, B, S, P = self.topk.shape
        if self.lengths.shape != (T, B):
            raise ValueError(f"trace lengths must be [steps={T}, B={B}], got shape {self.lengths.shape}")
        if not 0 < self.K <= P:
            raise ValueError(f"trace K must be in (0, P={P}], got {self.K}")
        if not self.groups:
            self.groups = [[g] for g in range(G)]
        if len(self.groups) != G:
            raise ValueError(f"trace groups must list {G} groups, got {len(self.groups)}")

    @property
    def steps(self) -> int:
        return self.topk.shape[0]

    @property
    def B(self) -> int:
        return self.topk.shape[2]

    @property
    def S(self) -> int:
        return self.topk.shape[3]

    @property
    def P(self) -> int:
        return self.topk.shape[4]

    @property
    def id_range(self) -> int:
        """One past the largest id that can ever be cached (>= 1).

        Only ids below the step's cache length are eligible (``dsa_plan`` skips the rest), so the id maps
        are sized by the lengths, never by a stray large id (a 2-step trace with id 1e9 must not allocate
        gigabytes)."""
        top = int(self.topk.max(initial=-1))
        return max(min(top, int(self.lengths.max(initial=0)) - 1), 0) + 1

    def header(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "model": self.model, "source": self.source,
                "K": self.K, "P": self.P, "S": self.S, "B": self.B, "steps": self.steps,
                "groups": [list(map(int, g)) for g in self.groups], "ranked": self.ranked, **self.extra}

    def with_k(self, K: int) -> "Trace":
        """The same trace seen with a smaller top-k (first ``K`` columns; needs ``ranked``)."""
        if K > self.P:
            raise ValueError(f"with_k: K={K} exceeds the stored ranks P={self.P}")
        return Trace(self.topk, self.lengths, K, self.groups, self.model, self.source, self.ranked, dict(self.extra))


def save_trace(trace: Trace, path: Union[str, Path]) -> Path:
    path = Path(path)
    with open(path, "wb") as f:  # a file object keeps numpy from appending ".npz" to the name
        np.savez_compressed(f, header=np.array(json.dumps(trace.header())), topk=trace.topk, lengths=trace.lengths)
    log.info("trace written to %s (%d steps, %d groups)", path, trace.steps, len(trace.groups))
    return path


def load_trace(path: Union[str, Path]) -> Trace:
    """Read an ``offload_passes.trace`` npz (or a ``Driver.save_trace`` torch file)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace file {path} does not exist")
    if not path.is_file():
        raise ValueError(f"trace {path} is not a file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PK\x03\x04":
        try:
            z = np.load(path, allow_pickle=False)
            names = set(z.files)
        except Exception:
            names = set()
        if {"header", "topk", "lengths"} <= names:
            try:
                h = json.loads(str(z["header"]))
                arrays = (z["topk"], z["lengths"])
            except Exception as e:  # corrupt member, bad JSON: one readable error, not a traceback
                raise ValueError(f"{path}: unreadable trace file ({type(e).__name__}: {e})") from None
            if not isinstance(h, dict):
                raise ValueError(f"{path}: trace header must be a JSON object")
            if h.get("format") != FORMAT:
                raise ValueError(f"{path}: header format is {h.get('format')!r}, expected {FORMAT!r}")
            if int(h.get("version", 0)) > VERSION:
                raise ValueError(f"{path}: trace version {h['version']} is newer than supported ({VERSION})")
            known = {"format", "version", "model", "source", "K", "P", "S", "B", "steps", "groups", "ranked"}
            return Trace(arrays[0], arrays[1], int(h.get("K", 0)), h.get("groups", []), h.get("model", "unknown"),
                         h.get("source", "model"), bool(h.get("ranked", True)),
                         {k: v for k, v in h.items() if k not in known})
    return from_driver_trace(_torch_load(path))


def _torch_load(path: Path) -> dict:
    import torch

    try:
        d = torch.load(path, weights_only=True)
    except Exception as e:  # not a zip / pickle at all: a user mistake, one line
        raise ValueError(f"{path}: unreadable trace file: neither an {FORMAT} npz nor a Driver.save_trace "
                         f"file ({type(e).__name__})") from None
    if not isinstance(d, dict) or d.get("format") != "offload_passes.topk_trace":
        raise ValueError(f"{path}: neither an {FORMAT} npz nor a Driver.save_trace file")
    return d


def from_driver_trace(d: dict, model: str = "unknown", source: str = "model") -> Trace:
    """Convert ``Driver.trace()`` (``topk [steps, G, B, S, K]`` tensors) to a :class:`Trace`."""
    topk = d["topk"].numpy() if hasattr(d["topk"], "numpy") else np.asarray(d["topk"])
    lengths = d["kv_len"].numpy() if hasattr(d["kv_len"], "numpy") else np.asarray(d["kv_len"])
    return Trace(topk, lengths, int(d["K"]), [list(g) for g in d["groups"]], model, source, True)

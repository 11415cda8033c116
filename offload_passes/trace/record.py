"""Trace recorders.

* :class:`PlanRecorder` — records the inputs of every ``custom::dsa_plan`` CPU call (top-k, lengths) of a
  compiled run, keyed by the ``pool_ids`` storage so calls map to an :class:`OffloadState`'s groups;
  ``offload-demo --record-trace`` uses it.
* :class:`StateRecorder` — the recorder behind ``OffloadState.record_trace()`` / ``.trace()``: the state's
  recording hook (``offload_passes/state/recording.py``) hands it its groups' calls; importing this module
  registers it (the state never imports the trace package).
* :func:`record_model` — runs the *unmodified* model (gather path) and returns its indexer top-k per
  group and step; with ``P > K`` it also records ranks ``K..P-1`` by asking the (CPU reference) lightning
  indexer for its top-P on the same inputs (the model itself still gets exactly its top-K).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional

import numpy as np
import torch

from ..state import recording
from .format import Trace

log = logging.getLogger("offload_passes.trace.record")


class PlanRecorder:
    """Collects ``(pool_ids data_ptr, topk [B,S,K], lengths [B])`` of each ``dsa_plan`` CPU call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.active = False

    def __call__(self, topk: torch.Tensor, lengths: torch.Tensor, pool_ids: torch.Tensor, raw_seq: int) -> None:
        B, K = topk.size(0), topk.size(-1)
        self.calls.append((pool_ids.data_ptr(), topk.detach().reshape(B, raw_seq, K).clone(),
                           lengths.detach().clone().to(torch.int32)))

    def start(self) -> "PlanRecorder":
        from ..custom_ops import dsa_plan

        if not self.active:
            dsa_plan.add_plan_observer(self)  # every call then takes the op's Python path (docs/ops.md §13)
            self.active = True
        return self

    def stop(self) -> "PlanRecorder":
        from ..custom_ops import dsa_plan

        if self.active:
            dsa_plan.remove_plan_observer(self)
            self.active = False
        return self

    def __enter__(self) -> "PlanRecorder":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def trace_for(self, state, model: str = "unknown") -> Trace:
        """The calls that belong to ``state``'s groups, as a :class:`Trace` (``source="compiled"``)."""
        ptrs = {g.pool_ids.data_ptr(): i for i, g in enumerate(state.groups)}
        per: list[list] = [[] for _ in state.groups]
        lens: list[list] = [[] for _ in state.groups]
        for ptr, tk, L in self.calls:
            if ptr in ptrs:
                per[ptrs[ptr]].append(tk)
                lens[ptrs[ptr]].append(L)
        return _group_trace(per, lens, state, model)


def _group_trace(per: list[list], lens: list[list], state, model: str) -> Trace:
    """Per group, its calls' top-k and lengths (step order) as one :class:`Trace` of ``state``'s groups."""
    n = {len(p) for p in per}
    if not per or n == {0}:
        raise RuntimeError("record_trace: no dsa_plan call of this state was recorded")
    if len(n) != 1:
        raise RuntimeError(f"record_trace: groups recorded different step counts {sorted(n)}")
    for g in range(1, len(per)):
        if any(not torch.equal(a, b) for a, b in zip(lens[0], lens[g])):
            raise RuntimeError("record_trace: groups saw different lengths at the same step")
    topk = torch.stack([torch.stack(p) for p in per], dim=1)  # [T, G, B, S, K]
    lengths = torch.stack(lens[0])
    return Trace(topk.numpy(), lengths.numpy(), int(topk.size(-1)), [list(g.layers) for g in state.groups],
                 model, "compiled", True)


class StateRecorder:
    """The recorder ``OffloadState.record_trace()`` attaches (``state.recording.TraceRecorder``): per group
    of the state, the top-k ``[B, S, K]`` and lengths of each of its ``dsa_plan`` calls."""

    def __init__(self) -> None:
        self.per: dict[int, list[torch.Tensor]] = {}
        self.lens: dict[int, list[torch.Tensor]] = {}

    def __call__(self, group: int, topk: torch.Tensor, lengths: torch.Tensor) -> None:
        self.per.setdefault(group, []).append(topk.clone())
        self.lens.setdefault(group, []).append(lengths.clone().to(torch.int32))

    def trace(self, state, model: str = "unknown") -> Trace:
        """What was recorded, as a :class:`Trace` of ``state``'s groups (``source="compiled"``)."""
        G = len(state.groups)
        return _group_trace([self.per.get(g, []) for g in range(G)], [self.lens.get(g, []) for g in range(G)],
                            state, model)


recording.set_trace_recorder(StateRecorder)


@contextlib.contextmanager
def _top_p(P: int, store: list) -> Iterator[None]:
    """Make the model's ``npu_ops.lightning_indexer`` also produce a top-P ranking (recorded in ``store``)."""
    from ..models.glm import npu_ops

    orig = npu_ops.lightning_indexer

    def wrapped(*args: Any, **kwargs: Any):
        out = orig(*args, **kwargs)
        K = int(kwargs.get("sparse_count", 2048))
        if P > K:
            wide = orig(*args, **{**kwargs, "sparse_count": P})[0]
            store.append((out[0].detach().clone(), wide.detach().clone()))
        else:
            store.append((out[0].detach().clone(), None))
        return out

    npu_ops.lightning_indexer = wrapped
    try:
        yield
    finally:
        npu_ops.lightning_indexer = orig


def _merge_ranks(topk: torch.Tensor, wide: Optional[torch.Tensor], P: int) -> torch.Tensor:
    """``[T, K]`` model top-k + ``[T, P]`` wide ranking -> ``[T, P]``: columns ``:K`` are exactly the
    model's top-k; later columns the wide ranking's ids not already selected, in rank order."""
    T, K = topk.shape
    out = torch.full((T, P), -1, dtype=torch.int32)
    out[:, :K] = topk
    if wide is None:
        return out
    for r in range(T):
        chosen = set(topk[r][topk[r] >= 0].tolist())
        rest = [x for x in wide[r].tolist() if x >= 0 and x not in chosen][: P - K]
        if rest:
            out[r, K:K + len(rest)] = torch.tensor(rest, dtype=torch.int32)
    return out


@torch.no_grad()
def record_model(config: str = "tiny", steps: int = 16, P: Optional[int] = None, threads: int = 1,
                 **overrides: Any) -> Trace:
    """Top-k (and top-P) trace of the unmodified model in eager mode (the gather path)."""
    from .. import models

    if threads > 0:
        torch.set_num_threads(threads)
    built = models.build(config, decode_steps=steps, **overrides)
    drv = built.driver
    K = drv.K
    P = K if P is None else P
    if P < K:
        raise ValueError(f"record_model: P must be >= K={K}, got {P}")
    store: list = []
    with _top_p(P, store):
        drv.run(steps=steps, collect=True)
    tr = drv.trace()
    G = len(tr["groups"])
    if len(store) != steps * G:
        raise RuntimeError(f"record_model: expected {steps * G} indexer calls, saw {len(store)}")
    B, S = drv.B, drv.S
    topk = torch.empty(steps, G, B, S, P, dtype=torch.int32)
    for i, (tk, wide) in enumerate(store):
        t, g = divmod(i, G)
        merged = _merge_ranks(tk.reshape(B * S, K), None if wide is None else wide.reshape(B * S, -1), P)
        topk[t, g] = merged.view(B, S, P)
    if not torch.equal(topk[..., :K], tr["topk"]):
        raise RuntimeError("record_model: indexer calls do not line up with the driver's top-k trace")
    return Trace(topk.numpy(), tr["kv_len"].numpy().astype(np.int32), K, [list(g) for g in tr["groups"]],
                 str(config), "model", True, {"overrides": {k: v for k, v in overrides.items()}})


def main(argv: Optional[list] = None) -> int:
    """``python -m offload_passes.trace.record``: record the unmodified model's top-k (top-P) trace."""
    import argparse
    import sys

    from .format import save_trace

    ap = argparse.ArgumentParser(prog="python -m offload_passes.trace.record", description=main.__doc__)
    ap.add_argument("--config", default="tiny", help="model preset or yaml")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--top-p", type=int, default=None, help="ranked columns to store (>= K; default K)")
    ap.add_argument("--next-n", type=int, default=None, help="MTP tokens (S = 1 + next_n)")
    ap.add_argument("-o", "--output", required=True, help="trace .npz to write")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error(f"--steps must be >= 1, got {a.steps}")
    over = {} if a.next_n is None else {"next_n": a.next_n}
    try:
        tr = record_model(a.config, a.steps, a.top_p, **over)
    except (ValueError, RuntimeError) as e:
        print(f"record: error: {e}", file=sys.stderr)
        return 2
    print(save_trace(tr, a.output))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

"""The recipe's multi-rank layout of the GLM decode model on ``torch.distributed`` (gloo on the CPU).

One :class:`ParallelLayout` per rank says how the world of W ranks splits the model, as the NPU recipe
deploys it (cann-recipes-infer GLM-5 / DeepSeek-V3.2: attention data parallel, MoE expert parallel,
embedding and lm_head tensor parallel):

* **attention data parallel**: the runner's ``batch_size`` is the global batch; rank r owns rows
  ``[r*B/W, (r+1)*B/W)`` (its caches, selection buffers and ledgers hold only those rows);
* **MoE expert parallel**: rank r holds routed experts ``[r*E/W, (r+1)*E/W)``; tokens travel to the
  experts and back through a dispatch / combine pair with MC2's semantics (``moe_comm.py``); the router
  and the shared expert are replicated;
* **embedding tensor parallel** (vocab-parallel rows): every rank looks up the gathered token ids of
  all ranks in its vocab shard, a reduce-scatter sums the shards and hands each rank its own rows;
* **lm_head tensor parallel** (vocab-parallel columns): the final hidden states are all-gathered, each
  rank computes its vocab shard of every rank's logits, an all-to-all returns each rank its own rows
  with every shard.

Every collective is a ``torch.distributed._functional_collectives`` call, so Dynamo records it as a
``_c10d_functional`` op (and its ``wait_tensor``) in the FX graph, and ``fullgraph=True`` holds. Every
shape is static and identical on all ranks (equal rows per rank, worst-case expert capacity), so every
rank traces the same graph, up to its own rank-local values.

World size 1 builds no layout (``None``): the model and its graph are exactly the single-process ones.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from offload_passes import _compat

funcol = _compat.functional_collectives()

log = logging.getLogger("offload_passes.models.parallel")

# all_gather_tensor / reduce_scatter_tensor exist (and trace to the same _c10d_functional ops) on every
# torch we support; their *_single successors do not exist on 2.8, so the old names stay, unwarned.
warnings.filterwarnings("ignore", message=r".*_functional_collectives\.(all_gather_tensor|reduce_scatter_tensor)`? "
                        r"is deprecated", category=FutureWarning)


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits: ``world_size`` ranks, this one is ``rank``; ``group`` is the process group
    of every collective (None: the default world group)."""

    world_size: int
    rank: int
    group: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"ParallelLayout: world_size must be an integer >= 1, got {self.world_size!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"ParallelLayout: rank must be in [0, world_size={self.world_size}), got {self.rank!r}")

    @classmethod
    def current(cls, group: Any = None) -> "ParallelLayout":
        """The layout of the initialised default process group (``torch.distributed.init_process_group``)."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ParallelLayout.current: torch.distributed is not initialised "
                               "(call torch.distributed.init_process_group first)")
        return cls(world_size=dist.get_world_size(group), rank=dist.get_rank(group), group=group)

    @property
    def pg(self) -> Any:
        return self.group if self.group is not None else dist.group.WORLD

    @property
    def group_name(self) -> str:
        """The process group's name (what ``_c10d_functional`` ops and MC2's ``group_ep`` carry)."""
        return self.pg.group_name

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """``[lo, hi)`` of this rank's equal share of ``n`` items; ``what`` names the count in the error."""
        if n % self.world_size:
            raise ValueError(f"world size {self.world_size} must divide {what}={n}")
        per = n // self.world_size
        return self.rank * per, (self.rank + 1) * per

    def check(self, batch_size: int, vocab_size: int, n_routed_experts: int) -> None:
        """Every split must be even (static, equal shapes on every rank); errors name the key."""
        self.shard(batch_size, "batch_size (the global batch, split across ranks)")
        self.shard(vocab_size, "vocab_size (embedding / lm_head tensor parallel)")
        self.shard(n_routed_experts, "n_routed_experts (expert parallel)")


def as_layout(parallel: Optional[ParallelLayout]) -> Optional[ParallelLayout]:
    """``None`` and world size 1 both mean: no layout (the single-process model)."""
    if parallel is None or parallel.world_size == 1:
        return None
    if not isinstance(parallel, ParallelLayout):
        raise TypeError(f"parallel must be a ParallelLayout or None, got {type(parallel).__name__}")
    return parallel


# ------------------------------------------------------------------------------------------ collectives


def all_gather_rows(x: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """``[n, ...]`` on every rank -> ``[W*n, ...]`` (rank order)."""
    return funcol.wait_tensor(funcol.all_gather_tensor(x, 0, layout.pg))


def reduce_scatter_rows(x: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """``[W*n, ...]`` summed over ranks; this rank keeps rows ``[r*n, (r+1)*n)``."""
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(x, "sum", 0, layout.pg))


def all_to_all_rows(x: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """Equal splits: chunk j of ``x [W*n, ...]`` goes to rank j; chunk j of the result came from rank j."""
    return funcol.wait_tensor(funcol.all_to_all_single(x, None, None, layout.pg))


# ------------------------------------------------------------------------------------------ embedding / lm_head


def embed_tp(embedding: torch.nn.Embedding, ids: torch.Tensor, layout: ParallelLayout, vocab: int) -> torch.Tensor:
    """Vocab-parallel embedding of this rank's token ids ``[n]`` -> ``[n, hidden]``.

    Exact in any dtype: each row has exactly one non-zero contribution (the owning shard's), so the
    reduce-scatter's sum adds zeros only.
    """
    lo, hi = layout.shard(vocab, "vocab_size")
    ids_all = all_gather_rows(ids, layout)                       # [W*n]
    local = ids_all - lo
    own = (local >= 0) & (local < hi - lo)
    emb = embedding(torch.where(own, local, torch.zeros_like(local)))
    emb = torch.where(own.unsqueeze(-1), emb, torch.zeros_like(emb))
    return reduce_scatter_rows(emb, layout)


def lm_head_tp(lm_head: torch.nn.Linear, h: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """Vocab-parallel lm_head: this rank's hidden states ``[n, hidden]`` -> its logits ``[n, vocab]``."""
    W = layout.world_size
    n = h.size(0)
    h_all = all_gather_rows(h, layout)                           # [W*n, hidden]
    part = lm_head(h_all)                                        # [W*n, vocab/W]: every rank's rows, my shard
    mine = all_to_all_rows(part, layout)                         # chunk j: my rows, shard j
    return mine.view(W, n, -1).transpose(0, 1).reshape(n, -1)


# ------------------------------------------------------------------------------------------ weights


@torch.no_grad()
def init_sharded_weights(model: torch.nn.Module, full_model_meta: torch.nn.Module, seed: int,
                         layout: ParallelLayout, std: Optional[float] = None) -> None:
    """Seeded init of a sharded model with exactly the values of the single-process model.

    ``weights.init_weights`` draws every tensor from one generator in ``state_dict`` order, so the draws
    are replayed in the *global* order (``full_model_meta``: the W=1 model built on ``meta``) and each
    rank keeps its slice: rows of the vocab-sharded embedding / lm_head, its own experts (named by
    their global index), the replicated rest whole.
    """
    cfg = model.config
    std = cfg.initializer_range if std is None else std
    g = torch.Generator().manual_seed(seed)
    local = model.state_dict(keep_vars=True)
    for name, t in full_model_meta.state_dict(keep_vars=True).items():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            val = None
        elif name.endswith("k_norm.bias"):
            val = None
        elif name.endswith("e_score_correction_bias"):
            val = torch.randn(t.shape, generator=g) * 0.01
        else:
            val = torch.randn(t.shape, generator=g) * std
        dst = local.get(name)
        if dst is None:  # another rank's expert
            continue
        if val is None:
            dst.fill_(0.0 if name.endswith("bias") else 1.0)
            continue
        if tuple(dst.shape) != tuple(val.shape):  # vocab-sharded rows
            lo, hi = layout.shard(val.size(0), name)
            val = val[lo:hi]
        dst.copy_(val.to(dst.dtype))
